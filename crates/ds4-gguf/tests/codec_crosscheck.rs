//! Bit-exact cross-check of our codecs against PyPI gguf 0.19.0.
//!
//! The vectors in `tests/fixtures/codec-vectors/` were written by
//! `tools/codecs/gen_codec_vectors.py` (see its docstring for the file layout and recipes).
//! They store a seed, a hash of every input record, a hash of every expected output record
//! and the first records in full. This test regenerates the inputs with the same SplitMix64
//! recipes, proves they are the script's inputs (input hash), runs our codec on every record
//! and compares the hash of our output with gguf's, so every element of every record is
//! checked bit-exactly (f32 NaN matches any NaN). The stored full records give a readable,
//! element-by-element diff when something breaks.

use std::path::PathBuf;

use ds4_gguf::quant;
use ds4_gguf::GgmlType;

// ---------------------------------------------------------------------------------------
// The generator, shared with the Python script (keep the two in step).

const BASE_SEED: u64 = 0x6473_3463_6F64_6563;
const N_BLOCKS: usize = 10240;
const PLAIN_RUN: usize = 256;

const F16_SPECIALS: [u16; 20] = [
    0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00, 0x7C00,
    0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0x1400, 0x2E66, 0x5BFF,
];
const F32_SPECIALS: [u32; 20] = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
    0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0x33800000,
    0x477FE000, 0x477FF000, 0x3EAAAAAB, 0x4B000001,
];
const I32_SPECIALS: [i64; 18] = [
    0,
    1,
    -1,
    (1 << 31) - 1,
    -(1 << 31),
    1 << 24,
    (1 << 24) + 1,
    (1 << 24) + 3,
    -((1 << 24) + 1),
    (1 << 31) - 65,
    (1 << 31) - 64,
    (1 << 31) - 63,
    123456789,
    -987654321,
    16777217 * 2,
    255,
    -256,
    65535,
];
const F16_Q_SPECIALS: [u32; 21] = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x477FE000, 0xC77FE000, 0x477FEFFF, 0x33800000,
    0x33000000, 0x33400000, 0x38800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x2EDBE6FF,
    0x3DCCCCCD, 0x3EAAAAAB, 0x3F801000, 0x3F803000, 0x387FC000,
];
const BF16_Q_SPECIALS: [u32; 18] = [
    0x00000000, 0x80000000, 0x3F800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFF800001,
    0x7FFFFFFF, 0x7F7F7FFF, 0x00000001, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x3F817FFF,
    0x3DCCCCCD, 0x80008001,
];

struct SplitMix64(u64);

impl SplitMix64 {
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }

    fn raw(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.u64().to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xCBF29CE484222325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001B3);
    }
    h
}

fn f32_bits(sign: u64, exp: u64, mant: u64) -> u32 {
    ((sign << 31) | (exp << 23) | mant) as u32
}

fn gen_blocks(rng: &mut SplitMix64, block_bytes: usize, f16_offsets: &[usize]) -> Vec<u8> {
    let mut all = Vec::with_capacity(N_BLOCKS * block_bytes);
    for i in 0..N_BLOCKS {
        let mut b = rng.raw(block_bytes);
        let r = rng.u64();
        for (k, &off) in f16_offsets.iter().enumerate() {
            let sel = (r >> (8 * k)) & 0xFF;
            if sel >= 128 {
                let v = F16_SPECIALS[(sel % 20) as usize];
                b[off..off + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        if i == 0 {
            b.fill(0);
        } else if i == 1 {
            b.fill(0xFF);
        }
        all.extend_from_slice(&b);
    }
    all
}

fn gen_f32_bits(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    let mut v = F32_SPECIALS.to_vec();
    while v.len() < n {
        v.push(rng.u64() as u32);
    }
    v
}

fn gen_i32(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    let mut vals: Vec<u32> = I32_SPECIALS.iter().map(|&v| v as i32 as u32).collect();
    while vals.len() < n {
        let v = rng.u64();
        let shift = (v >> 32) % 32;
        let mag = (v as u32) >> shift;
        vals.push(if v >> 63 != 0 {
            mag.wrapping_neg()
        } else {
            mag
        });
    }
    vals
}

fn gen_q8_0_block(rng: &mut SplitMix64, out: &mut Vec<u32>) {
    let r = rng.u64();
    let mode = r & 7;
    let eb = 87 + ((r >> 8) % 62);
    match mode {
        0..=3 => {
            for _ in 0..32 {
                let v = rng.u64();
                let exp = eb.saturating_sub((v >> 32) % 16);
                out.push(f32_bits(v >> 63, exp, v & 0x7FFFFF));
            }
        }
        4 => {
            let s = ((r >> 20) % 17) as i32 - 8;
            let scale = f32::from_bits(((127 + s) as u32) << 23);
            for i in 0..32 {
                let k = rng.u64() % 509;
                let mut val = ((k as f32 - 254.0) * 0.5) * scale;
                if i == 0 {
                    val = if (r >> 16) & 1 != 0 { 127.0 } else { -127.0 } * scale;
                }
                out.push(val.to_bits());
            }
        }
        5 => {
            for _ in 0..32 {
                out.push(f32_bits(rng.u64() >> 63, 0, 0));
            }
        }
        6 => {
            let v = rng.u64();
            let c = f32_bits(v >> 63, eb.saturating_sub((v >> 32) % 16), v & 0x7FFFFF);
            out.extend(std::iter::repeat_n(c, 32));
        }
        _ => {
            for _ in 0..32 {
                let v = rng.u64();
                out.push(f32_bits(v >> 63, (v >> 32) % 9, v & 0x7FFFFF));
            }
        }
    }
}

fn gen_mxfp4_blocks(rng: &mut SplitMix64) -> Vec<u8> {
    let mut all = Vec::with_capacity(N_BLOCKS * 17);
    for i in 0..N_BLOCKS {
        let mut b = rng.raw(17);
        b[0] = (i % 256) as u8;
        if i == 0 {
            b.fill(0);
        } else if i == 1 {
            b.fill(0xFF);
        }
        all.extend_from_slice(&b);
    }
    all
}

fn gen_mxfp4_qblock(rng: &mut SplitMix64, out: &mut Vec<u32>) {
    let r = rng.u64();
    let mode = r & 7;
    let eb = (r >> 8) % 255;
    match mode {
        0 | 1 => {
            for _ in 0..32 {
                let v = rng.u64();
                out.push(f32_bits(
                    v >> 63,
                    eb.saturating_sub((v >> 32) % 8),
                    v & 0x7FFFFF,
                ));
            }
        }
        2 => {
            let s = ((r >> 20) % 231) as i32 - 120;
            let scale = f32::from_bits(((127 + s) as u32) << 23);
            for i in 0..32 {
                let t = rng.u64() % 97;
                let mut val = ((t as f32 - 48.0) * 0.25) * scale;
                if i == 0 {
                    val = if (r >> 16) & 1 != 0 { 12.0 } else { -12.0 } * scale;
                }
                out.push(val.to_bits());
            }
        }
        3 => {
            for _ in 0..32 {
                out.push(f32_bits(rng.u64() >> 63, 0, 0));
            }
        }
        4 => {
            let v = rng.u64();
            out.extend(std::iter::repeat_n(f32_bits(v >> 63, eb, v & 0x7FFFFF), 32));
        }
        5 => {
            for _ in 0..32 {
                let v = rng.u64();
                out.push(f32_bits(v >> 63, (v >> 32) % 5, v & 0x7FFFFF));
            }
        }
        6 => {
            let top = eb.max(1);
            let start = out.len();
            for _ in 0..32 {
                let v = rng.u64();
                out.push(f32_bits(
                    v >> 63,
                    (top - 1).saturating_sub((v >> 32) % 8),
                    v & 0x7FFFFF,
                ));
            }
            out[start + ((r >> 32) % 32) as usize] =
                f32_bits((r >> 63) & 1, top, 0x7FFFFF - ((r >> 40) % 48));
        }
        _ => {
            for _ in 0..32 {
                let v = rng.u64();
                out.push(f32_bits(v >> 63, (v >> 32) % 255, v & 0x7FFFFF));
            }
        }
    }
}

fn gen_f16_input(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    let mut vals = F16_Q_SPECIALS.to_vec();
    while vals.len() < n {
        let v = rng.u64();
        let exp = 101 + ((v >> 32) % 41);
        let mut mant = v & 0x7FFFFF;
        if (v >> 40) & 3 == 0 {
            mant = (mant & !0x1FFF) | 0x1000;
        }
        vals.push(f32_bits(v >> 63, exp, mant));
    }
    vals
}

fn gen_bf16_input(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    let mut vals = BF16_Q_SPECIALS.to_vec();
    while vals.len() < n {
        let v = rng.u64();
        let exp = (v >> 32) % 254;
        let mut mant = v & 0x7FFFFF;
        if (v >> 48) & 3 == 0 {
            mant = (mant & !0xFFFF) | 0x8000;
        }
        vals.push(f32_bits(v >> 63, exp, mant));
    }
    vals
}

fn u32s_to_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn seed_for(op: u32, code: u32) -> u64 {
    BASE_SEED ^ (u64::from(op) << 40) ^ (u64::from(code) << 48)
}

/// Regenerate the inputs of vector file (op, ty), concatenated.
fn regenerate(op: u32, ty: GgmlType) -> Vec<u8> {
    let mut rng = SplitMix64(seed_for(op, ty.code()));
    let n_plain = 64 * PLAIN_RUN;
    match (op, ty) {
        (0, GgmlType::Q8_0) => gen_blocks(&mut rng, 34, &[0]),
        (0, GgmlType::Q2K) => gen_blocks(&mut rng, 84, &[80, 82]),
        (0, GgmlType::Q4K) => gen_blocks(&mut rng, 144, &[0, 2]),
        (0, GgmlType::Iq2Xxs) => gen_blocks(&mut rng, 66, &[0]),
        (0, GgmlType::Mxfp4) => gen_mxfp4_blocks(&mut rng),
        (0, GgmlType::F16 | GgmlType::Bf16) => (0..=u16::MAX).flat_map(u16::to_le_bytes).collect(),
        (0, GgmlType::F32) => u32s_to_bytes(&gen_f32_bits(&mut rng, n_plain)),
        (0, GgmlType::I32) => u32s_to_bytes(&gen_i32(&mut rng, n_plain)),
        (1, GgmlType::Q8_0) => {
            let mut bits = Vec::with_capacity(N_BLOCKS * 32);
            for _ in 0..N_BLOCKS {
                gen_q8_0_block(&mut rng, &mut bits);
            }
            u32s_to_bytes(&bits)
        }
        (1, GgmlType::Mxfp4) => {
            let mut bits = Vec::with_capacity(N_BLOCKS * 32);
            for _ in 0..N_BLOCKS {
                gen_mxfp4_qblock(&mut rng, &mut bits);
            }
            u32s_to_bytes(&bits)
        }
        (1, GgmlType::F16) => u32s_to_bytes(&gen_f16_input(&mut rng, n_plain)),
        (1, GgmlType::Bf16) => u32s_to_bytes(&gen_bf16_input(&mut rng, n_plain)),
        other => panic!("no recipe for {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Fixture files.

struct Vectors {
    op: u32,
    ty: GgmlType,
    n_records: usize,
    elems: usize,
    in_bytes: usize,
    out_bytes: usize,
    n_full: usize,
    seed: u64,
    input_hash: u64,
    out_hashes: Vec<u64>,
    full_in: Vec<u8>,
    full_out: Vec<u8>,
}

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/codec-vectors")
}

fn load(name: &str) -> Vectors {
    let path = fixture_dir().join(name);
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(b.len() >= 56, "{name}: too short");
    assert_eq!(&b[..8], b"DS4CVEC1", "{name}: bad magic");
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let (n_records, elems) = (u32_at(16) as usize, u32_at(20) as usize);
    let (in_bytes, out_bytes, n_full) = (
        u32_at(24) as usize,
        u32_at(28) as usize,
        u32_at(32) as usize,
    );
    assert_eq!(u32_at(36), 1, "{name}: unknown recipe version");
    let hashes_end = 56 + 8 * n_records;
    let full_in_end = hashes_end + n_full * in_bytes;
    assert_eq!(b.len(), full_in_end + n_full * out_bytes, "{name}: size");
    Vectors {
        op: u32_at(8),
        ty: GgmlType::from_code(u32_at(12)),
        n_records,
        elems,
        in_bytes,
        out_bytes,
        n_full,
        seed: u64_at(40),
        input_hash: u64_at(48),
        out_hashes: (0..n_records).map(|i| u64_at(56 + 8 * i)).collect(),
        full_in: b[hashes_end..full_in_end].to_vec(),
        full_out: b[full_in_end..].to_vec(),
    }
}

/// Regenerate the inputs and check they are the ones the script used.
fn inputs(v: &Vectors, name: &str) -> Vec<u8> {
    assert_eq!(v.seed, seed_for(v.op, v.ty.code()), "{name}: seed");
    let inp = regenerate(v.op, v.ty);
    assert_eq!(
        inp.len(),
        v.n_records * v.in_bytes,
        "{name}: regenerated length"
    );
    let mut record_hashes = Vec::with_capacity(v.n_records * 8);
    for rec in inp.chunks_exact(v.in_bytes) {
        record_hashes.extend_from_slice(&fnv1a64(rec).to_le_bytes());
    }
    assert_eq!(
        fnv1a64(&record_hashes),
        v.input_hash,
        "{name}: the Rust generator no longer reproduces the script's inputs"
    );
    assert_eq!(
        &inp[..v.full_in.len()],
        &v.full_in[..],
        "{name}: stored inputs"
    );
    inp
}

/// Blocks checked (for plain types, elements), which the brief wants to be >= 10,000.
fn blocks_checked(v: &Vectors) -> usize {
    v.n_records * v.elems / v.ty.block_elems().unwrap() as usize
}

fn canon_bytes(out: &[f32]) -> Vec<u8> {
    out.iter()
        .flat_map(|x| {
            if x.is_nan() {
                0x7FC0_0000u32
            } else {
                x.to_bits()
            }
            .to_le_bytes()
        })
        .collect()
}

fn check_dequant(name: &str, ty: GgmlType) {
    let v = load(name);
    assert_eq!((v.op, v.ty), (0, ty), "{name}: header");
    assert!(
        blocks_checked(&v) >= 10_000,
        "{name}: only {} blocks",
        blocks_checked(&v)
    );
    let inp = inputs(&v, name);

    // Whole buffer in one call (the row path), then record by record against the hashes.
    let mut out = vec![0f32; v.n_records * v.elems];
    quant::dequantize(ty, &inp, &mut out).unwrap();
    let mut bad = Vec::new();
    for (i, rec) in out.chunks_exact(v.elems).enumerate() {
        if fnv1a64(&canon_bytes(rec)) != v.out_hashes[i] {
            bad.push(i);
        }
    }
    // Element-level comparison on the stored records, for a readable failure.
    let mut diffs = Vec::new();
    for (i, exp) in v.full_out.chunks_exact(4).enumerate() {
        let e = f32::from_le_bytes(exp.try_into().unwrap());
        let g = out[i];
        let same = (e.is_nan() && g.is_nan()) || e.to_bits() == g.to_bits();
        if !same && diffs.len() < 10 {
            diffs.push(format!(
                "record {} elem {}: expected {e:e} ({:#010x}) got {g:e} ({:#010x})",
                i / v.elems,
                i % v.elems,
                e.to_bits(),
                g.to_bits()
            ));
        }
    }
    assert!(
        bad.is_empty() && diffs.is_empty(),
        "{name}: {} of {} records differ from gguf (first: {:?}); {}",
        bad.len(),
        v.n_records,
        &bad[..bad.len().min(10)],
        diffs.join("; ")
    );
    // Sanity: the fixture really exercises non-finite outputs for the block types (MXFP4 has
    // no NaN encoding: only its overflow to ±inf).
    if ty == GgmlType::Mxfp4 {
        assert!(out.iter().any(|x| x.is_infinite()) && !out.iter().any(|x| x.is_nan()));
    } else if ty.is_quantized() {
        assert!(out.iter().any(|x| x.is_nan()) && out.iter().any(|x| x.is_infinite()));
    }
}

fn check_quant(name: &str, ty: GgmlType) {
    let v = load(name);
    assert_eq!((v.op, v.ty), (1, ty), "{name}: header");
    assert!(
        blocks_checked(&v) >= 10_000,
        "{name}: only {} blocks",
        blocks_checked(&v)
    );
    let inp = inputs(&v, name);
    let mut bad = Vec::new();
    let mut first_diff = String::new();
    for (i, rec) in inp.chunks_exact(v.in_bytes).enumerate() {
        let x: Vec<f32> = rec
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let q = quant::quantize(ty, &x, None)
            .unwrap_or_else(|e| panic!("{name}: record {i} refused: {e}"));
        assert_eq!(q.len(), v.out_bytes, "{name}: record {i} size");
        if fnv1a64(&q) != v.out_hashes[i] {
            if bad.is_empty() && i < v.n_full {
                let exp = &v.full_out[i * v.out_bytes..(i + 1) * v.out_bytes];
                first_diff = format!("expected {exp:02x?}\n     got {q:02x?}");
            }
            bad.push(i);
        }
    }
    assert!(
        bad.is_empty(),
        "{name}: {} of {} records differ from gguf (first: {:?}) {first_diff}",
        bad.len(),
        v.n_records,
        &bad[..bad.len().min(10)]
    );
}

#[test]
fn dequantize_q8_0_matches_gguf() {
    check_dequant("dequant-q8_0.bin", GgmlType::Q8_0);
}

#[test]
fn dequantize_q2_k_matches_gguf() {
    check_dequant("dequant-q2_k.bin", GgmlType::Q2K);
}

#[test]
fn dequantize_q4_k_matches_gguf() {
    check_dequant("dequant-q4_k.bin", GgmlType::Q4K);
}

#[test]
fn dequantize_iq2_xxs_matches_gguf() {
    check_dequant("dequant-iq2_xxs.bin", GgmlType::Iq2Xxs);
}

#[test]
fn dequantize_mxfp4_matches_gguf() {
    check_dequant("dequant-mxfp4.bin", GgmlType::Mxfp4);
}

#[test]
fn quantize_mxfp4_matches_gguf() {
    check_quant("quant-mxfp4.bin", GgmlType::Mxfp4);
}

#[test]
fn dequantize_f16_matches_gguf_exhaustively() {
    check_dequant("dequant-f16.bin", GgmlType::F16);
}

#[test]
fn dequantize_bf16_matches_gguf_exhaustively() {
    check_dequant("dequant-bf16.bin", GgmlType::Bf16);
}

#[test]
fn dequantize_f32_matches_gguf() {
    check_dequant("dequant-f32.bin", GgmlType::F32);
}

#[test]
fn dequantize_i32_matches_numpy() {
    check_dequant("dequant-i32.bin", GgmlType::I32);
}

#[test]
fn quantize_q8_0_matches_gguf() {
    check_quant("quant-q8_0.bin", GgmlType::Q8_0);
}

#[test]
fn quantize_f16_matches_gguf() {
    check_quant("quant-f16.bin", GgmlType::F16);
}

#[test]
fn quantize_bf16_matches_gguf() {
    check_quant("quant-bf16.bin", GgmlType::Bf16);
}

/// The checker must be able to fail: changing one 4-bit code of a block with ordinary
/// scales changes our output hash for that block.
#[test]
fn crosscheck_detects_a_corrupted_block() {
    use ds4_gguf::quant::{f16::f16_to_f32, q4_k};
    let name = "dequant-q4_k.bin";
    let v = load(name);
    let mut inp = inputs(&v, name);
    let i = (2..v.n_records)
        .find(|&i| {
            let b: &[u8; 144] = inp[i * 144..(i + 1) * 144].try_into().unwrap();
            let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            let dmin = f16_to_f32(u16::from_le_bytes([b[2], b[3]]));
            let (sc, _) = q4_k::scale_min(0, b[4..16].try_into().unwrap());
            d.is_normal() && dmin.is_finite() && sc != 0
        })
        .expect("an ordinary block");
    inp[i * 144 + 16] ^= 0x01; // lowest bit of element 0's code
    let mut out = vec![0f32; 256];
    quant::dequantize(GgmlType::Q4K, &inp[i * 144..(i + 1) * 144], &mut out).unwrap();
    assert_ne!(fnv1a64(&canon_bytes(&out)), v.out_hashes[i]);
}
