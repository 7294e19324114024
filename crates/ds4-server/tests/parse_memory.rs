//! Memory taken by parsing hostile request bodies, measured with a counting global
//! allocator: for every shape, the bounded pre-scan (`ds4_server::bodyscan`) plus the
//! endpoint's parser peak at no more than `bodyscan::parse_budget(body size)` — 16 × the
//! body, or 64 MiB for small bodies. Each shape is tried dense (refused by the scan, which
//! allocates next to nothing) and diluted to just under the scan's estimate (parsed in full,
//! which checks the estimate against what the parser really takes).
//!
//! One test at a time holds `SERIAL`, so the peak is this test's own.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ds4_server::api::Endpoint;
use ds4_server::bodyscan;
use ds4_server::endpoints;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's layout and pointer unchanged;
// the counters are only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours, forwarded.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (see `alloc`).
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; `ptr` came from `System` with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = CURRENT.fetch_add(new_size - layout.size(), Ordering::Relaxed)
                    + (new_size - layout.size());
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());

/// Bodies of this size (the were 64 MiB; the ratios are the same).
const BODY: usize = 8 << 20;

/// Peak bytes allocated beyond what was live before, while `f` runs.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = f();
    (r, PEAK.load(Ordering::Relaxed).saturating_sub(base))
}

/// What the server does to a generation body before rendering: the scan, then the parser.
fn admit(ep: Endpoint, body: &[u8], ctx: usize) -> Result<(), String> {
    bodyscan::check(body, ctx).map_err(|e| e.message)?;
    let (_turns, _items) = ds4_server::request::count_turns(body);
    endpoints::family(ep)
        .parse(body, ctx as u64)
        .map(drop)
        .map_err(|e| e.message)
}

/// `prefix` + `n` copies of `item` joined by commas + `suffix`, padded with a filler member
/// to `BODY` bytes.
fn body(prefix: &str, item: &str, n: usize, suffix: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(BODY + 64);
    b.extend_from_slice(b"{\"pad\":\"");
    let fixed = prefix.len() + suffix.len() + n * (item.len() + 1) + 16;
    b.resize(b.len() + BODY.saturating_sub(fixed), b'p');
    b.extend_from_slice(b"\",");
    b.extend_from_slice(prefix.as_bytes());
    for i in 0..n {
        if i > 0 {
            b.push(b',');
        }
        b.extend_from_slice(item.as_bytes());
    }
    b.extend_from_slice(suffix.as_bytes());
    b.push(b'}');
    b
}

struct Shape {
    name: &'static str,
    ep: Endpoint,
    prefix: &'static str,
    item: &'static str,
    suffix: &'static str,
}

/// Runs one shape dense (as many items as fit the body) and diluted (the most items whose
/// estimate passes), asserting the peak bound for both; returns the peaks.
fn run(s: &Shape) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = 1 << 20;
    let dense_n = (BODY - s.prefix.len() - s.suffix.len() - 64) / (s.item.len() + 1);
    let dense = body(s.prefix, s.item, dense_n, s.suffix);
    let budget = bodyscan::parse_budget(dense.len());
    let (r, peak) = peak_of(|| admit(s.ep, &dense, ctx));
    let err = r.expect_err("the dense body should be refused");
    eprintln!(
        "{}: dense {} items in {} bytes refused, peak {} KiB ({:.3} × body): {err}",
        s.name,
        dense_n,
        dense.len(),
        peak >> 10,
        peak as f64 / dense.len() as f64
    );
    assert!(
        err.contains("JSON objects") || err.contains("more than once"),
        "{err}"
    );
    assert!(peak <= budget, "{}: peak {peak} > budget {budget}", s.name);
    // Diluted: the largest item count the scan lets through (found by halving).
    let (mut lo, mut hi) = (0usize, dense_n);
    while hi - lo > dense_n / 64 + 1 {
        let mid = (lo + hi) / 2;
        if bodyscan::check(&body(s.prefix, s.item, mid, s.suffix), ctx).is_ok() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let diluted = body(s.prefix, s.item, lo, s.suffix);
    let budget = bodyscan::parse_budget(diluted.len());
    let (r, peak) = peak_of(|| admit(s.ep, &diluted, ctx));
    eprintln!(
        "{}: diluted {} items in {} bytes parsed ({:?}), peak {} MiB ({:.2} × body; budget {} MiB)",
        s.name,
        lo,
        diluted.len(),
        r.as_ref().map(|_| "ok"),
        peak >> 20,
        peak as f64 / diluted.len() as f64,
        budget >> 20
    );
    assert!(lo > 0, "{}: nothing passes", s.name);
    assert!(
        peak <= budget,
        "{}: parsing took {peak} bytes, over the {budget}-byte budget",
        s.name
    );
}

#[test]
fn ignored_member_of_tiny_objects() {
    run(&Shape {
        name: "unknown member of {\"a\":\"\"}",
        ep: Endpoint::Chat,
        prefix: "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"junk\":[",
        item: "{\"a\":\"\"}",
        suffix: "]",
    });
}

#[test]
fn empty_content_parts() {
    run(&Shape {
        name: "empty content parts",
        ep: Endpoint::Chat,
        prefix: "\"messages\":[{\"role\":\"user\",\"content\":[",
        item: "{\"type\":\"text\",\"text\":\"\"}",
        suffix: "]}]",
    });
}

#[test]
fn anthropic_system_blocks() {
    run(&Shape {
        name: "Anthropic system blocks",
        ep: Endpoint::Messages,
        prefix: "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"system\":[",
        item: "{\"type\":\"text\",\"text\":\"\"}",
        suffix: "]",
    });
}

#[test]
fn many_tools() {
    run(&Shape {
        name: "tools",
        ep: Endpoint::Chat,
        prefix: "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[",
        item: "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}",
        suffix: "]",
    });
}

#[test]
fn responses_input_items() {
    run(&Shape {
        name: "Responses input items",
        ep: Endpoint::Responses,
        prefix: "\"input\":[",
        item: "{\"role\":\"system\",\"content\":\"\"}",
        suffix: "]",
    });
}

/// A second `messages` key (which the turn count, reading the first, never saw) is refused
/// by the scan before anything is built.
#[test]
fn duplicated_messages_key() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let b = body(
        "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"messages\":[",
        "{\"role\":\"system\",\"content\":\"\"}",
        (BODY - 200) / 33,
        "]",
    );
    let (r, peak) = peak_of(|| admit(Endpoint::Chat, &b, 1 << 20));
    let err = r.unwrap_err();
    eprintln!(
        "duplicated messages: {} bytes refused, peak {} KiB: {err}",
        b.len(),
        peak >> 10
    );
    assert!(err.contains("\"messages\" appears more than once"), "{err}");
    assert!(peak <= bodyscan::parse_budget(b.len()));
    // With a real context size the long array alone is refused too.
    let b = body(
        "\"messages\":[",
        "{\"role\":\"system\",\"content\":\"\"}",
        5000,
        "]",
    );
    let err = admit(Endpoint::Chat, &b, 4096).unwrap_err();
    assert!(err.contains("`messages` has more than 4096 items"), "{err}");
}
