//! Ctrl+C: interrupts a generation; at an idle prompt, twice in a row exits.
//!
//! SIGINT is received on a dedicated thread (signal-hook's iterator), so the reaction can
//! print and exit without async-signal-safety concerns. While the line editor owns a
//! terminal, Ctrl+C is a key, not a signal (raw mode), and the editor reports it instead;
//! the signal path matters during generation and when input comes from a pipe.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    }

    /// Marks its end; returns whether it was interrupted.
    pub fn end(&self) -> bool {
        self.generating.store(false, Ordering::SeqCst);
        self.cancel.swap(false, Ordering::SeqCst)
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
