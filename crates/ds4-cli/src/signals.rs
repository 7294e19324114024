//! Ctrl+C: interrupts a generation; at an idle prompt, twice in a row exits.
//!
//! SIGINT is received on a dedicated thread (signal-hook's iterator), so the reaction can
//! print and exit without async-signal-safety concerns. While the line editor owns a
//! terminal, Ctrl+C is a key, not a signal (raw mode), and the editor reports it instead;
//! the signal path matters during generation and when input comes from a pipe.
//!
//! While a generation runs on a terminal, the terminal's echo of control characters
//! (`ECHOCTL`) is off: otherwise Ctrl+C would print `^C` into the middle of the answer.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::termios::{self, LocalFlags, SetArg, Termios};

use anyhow::Context;

/// Shared flags between the signal thread and the command loop.
#[derive(Clone, Debug, Default)]
pub struct Interrupts {
    /// Raised by Ctrl+C while generating; the generation loop polls it.
    pub cancel: Arc<AtomicBool>,
    /// True while a prefill or generation runs.
    generating: Arc<AtomicBool>,
    /// One Ctrl+C was seen at an idle prompt: the next one exits.
    armed: Arc<AtomicBool>,
    /// The terminal settings to restore at the end of a generation, when `begin` turned
    /// `ECHOCTL` off (stdin is a terminal).
    saved_tty: Arc<Mutex<Option<Termios>>>,
}

impl Interrupts {
    /// Installs the SIGINT thread.
    pub fn install() -> anyhow::Result<Interrupts> {
        let me = Interrupts::default();
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT])
            .context("installing the Ctrl+C handler")?;
        let flags = me.clone();
        std::thread::Builder::new()
            .name("ds4-sigint".into())
            .spawn(move || {
                for _ in signals.forever() {
                    flags.on_interrupt();
                }
            })
            .context("starting the Ctrl+C thread")?;
        Ok(me)
    }

    fn on_interrupt(&self) {
        if self.generating.load(Ordering::SeqCst) {
            self.cancel.store(true, Ordering::SeqCst);
        } else if self.armed.swap(true, Ordering::SeqCst) {
            self.restore_tty();
            let _ = std::io::stderr().write_all(b"\n");
            std::process::exit(130);
        } else {
            let _ = std::io::stderr().write_all(b"\n(Ctrl+C again to exit, or /quit)\n");
        }
    }

    /// Marks the start of a prefill/generation (clears a stale cancel).
    pub fn begin(&self) {
        self.cancel.store(false, Ordering::SeqCst);
        self.armed.store(false, Ordering::SeqCst);
        self.generating.store(true, Ordering::SeqCst);
        self.quiet_control_echo();
    }

    /// Marks its end; returns whether it was interrupted.
    pub fn end(&self) -> bool {
        self.generating.store(false, Ordering::SeqCst);
        self.restore_tty();
        self.cancel.swap(false, Ordering::SeqCst)
    }

    /// Turns the terminal's `ECHOCTL` off for the generation (no `^C` in the answer). Not a
    /// terminal, or settings that cannot be read: nothing to do.
    fn quiet_control_echo(&self) {
        let stdin = std::io::stdin();
        let Ok(saved) = termios::tcgetattr(&stdin) else {
            return;
        };
        if !saved.local_flags.contains(LocalFlags::ECHOCTL) {
            return;
        }
        let mut quiet = saved.clone();
        quiet.local_flags.remove(LocalFlags::ECHOCTL);
        if termios::tcsetattr(&stdin, SetArg::TCSANOW, &quiet).is_ok() {
            if let Ok(mut slot) = self.saved_tty.lock() {
                *slot = Some(saved);
            }
        }
    }

    fn restore_tty(&self) {
        let saved = self.saved_tty.lock().ok().and_then(|mut s| s.take());
        if let Some(saved) = saved {
            let _ = termios::tcsetattr(std::io::stdin(), SetArg::TCSANOW, &saved);
        }
    }

    /// A line was typed: a previous Ctrl+C at the prompt no longer counts.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    /// Ctrl+C reported by the line editor: `true` if it is the second in a row (exit).
    pub fn prompt_interrupt(&self) -> bool {
        self.armed.swap(true, Ordering::SeqCst)
    }
}
