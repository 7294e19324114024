//! The parser's memory stays within the file's size plus a small constant, whatever the
//! header says: hostile files built to make each file byte cost many heap bytes (1-byte
//! array elements, empty strings, tiny keys, nested empty arrays, minimal tensor records)
//! are measured with a counting global allocator, next to the real V4 vocabulary file
//! (metadata only, the largest legitimate case per byte).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts live heap bytes and their peak (this test binary only).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak heap bytes above the starting level while parsing `bytes`, and the outcome.
fn peak_parse(bytes: &[u8]) -> (usize, Result<(), String>) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = ds4_gguf::parse(bytes).map(drop).map_err(|e| e.to_string());
    (PEAK.load(Ordering::Relaxed) - base, r)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A GGUF header with `n_kv` metadata records written by `kvs` and no tensors.
fn gguf(n_tensors: u64, n_kv: u64, body: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b.extend_from_slice(body);
    b
}

/// One key holding an array of `n` elements of type `code`, each element `elem` bytes.
fn one_array(code: u32, n: u64, elem: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    put_str(&mut body, "k");
    body.extend_from_slice(&9u32.to_le_bytes());
    body.extend_from_slice(&code.to_le_bytes());
    body.extend_from_slice(&n.to_le_bytes());
    for _ in 0..n {
        body.extend_from_slice(elem);
    }
    gguf(0, 1, &body)
}

const MB: usize = 1 << 20;
/// What the parser may use beyond the file's size (the reader's documented slack).
const SLACK: usize = ds4_gguf::PARSE_MEMORY_SLACK as usize;

#[test]
fn parse_memory_is_bounded_by_the_file_size() {
    let n = 2 * MB as u64;
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("u8 array", one_array(0, n, &[7])),
        ("bool array", one_array(7, n, &[1])),
        ("empty strings", one_array(8, n / 8, &0u64.to_le_bytes())),
    ];
    // Nested empty arrays: each element is a u8 array of length 0 (12 bytes).
    let mut nested = Vec::new();
    nested.extend_from_slice(&0u32.to_le_bytes());
    nested.extend_from_slice(&0u64.to_le_bytes());
    cases.push(("nested empty arrays", one_array(9, n / 12, &nested)));
    // Many one-letter keys holding one u8 each (14 bytes a record).
    let mut body = Vec::new();
    let n_kv = n / 16;
    for i in 0..n_kv {
        put_str(&mut body, &format!("{:05x}", i & 0xFFFFF));
        body.extend_from_slice(&0u32.to_le_bytes());
        body.push(1);
    }
    cases.push(("tiny keys", gguf(0, n_kv, &body)));
    // Minimal tensor records (1-dim, 4-char names), no data.
    let mut body = Vec::new();
    let n_t = n / 40;
    for i in 0..n_t {
        put_str(&mut body, &format!("{:04x}", i & 0xFFFF));
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&0u64.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        body.extend_from_slice(&0u64.to_le_bytes());
    }
    cases.push(("tensor records", gguf(n_t, 0, &body)));
    // The real vocabulary file: all metadata, and it must still parse.
    let vocab = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/vocab/deepseek-v4-vocab.gguf"
    ))
    .unwrap();
    cases.push(("V4 vocabulary", vocab));

    let mut report = Vec::new();
    let mut over = Vec::new();
    for (name, bytes) in &cases {
        let (peak, r) = peak_parse(bytes);
        let ratio = peak as f64 / bytes.len() as f64;
        report.push(format!(
            "{name}: file {} B, peak {} B ({ratio:.2}x), {}",
            bytes.len(),
            peak,
            match &r {
                Ok(()) => "accepted".to_string(),
                Err(e) => format!("refused: {e}"),
            }
        ));
        if peak > bytes.len() + SLACK {
            over.push(*name);
        }
        if *name == "V4 vocabulary" {
            assert!(r.is_ok(), "{r:?}");
        }
    }
    let report = report.join("\n");
    println!("{report}");
    assert!(
        over.is_empty(),
        "over file size + slack: {over:?}\n{report}"
    );
}
