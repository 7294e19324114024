//! Synthetic models: exact sizes against the spec, validation, and that the streamed file
//! holds exactly what the in-memory generator produces.

use std::io::Write;

use ds4_convert::synthetic::{flash_hparams, SyntheticModel};
use ds4_convert::NoProgress;
use ds4_gguf::{quant, GgmlType, GgufFile};
use ds4_model::layout::TypeRecipe;
use ds4_model::{expected_tensors, ModelSpec, Strictness};

const VOCAB_FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/vocab/deepseek-v4-vocab.gguf"
);

#[test]
fn full_size_dry_run_matches_the_spec() {
    // docs/gguf.md §7.1: q2 tensor data 86,714,777,664 B, q4 164,628,168,768 B (padded,
    // back to back), 1328 tensors.
    let q2 = SyntheticModel::new(TypeRecipe::Q2, 43, 0).unwrap();
    let q4 = SyntheticModel::new(TypeRecipe::Q4, 43, 0).unwrap();
    assert_eq!(q2.header().tensors.len(), 1328);
    assert_eq!(q2.file_size() - q2.data_offset(), 86_714_777_664);
    assert_eq!(q4.file_size() - q4.data_offset(), 164_628_168_768);
    // At the real size validation applies ds4's own rules (dims, exact types).
    let spec = ModelSpec::from_header(q2.header(), Strictness::Ds4).unwrap();
    assert_eq!(spec.routed_bits(), 2);
    ModelSpec::from_header(q4.header(), Strictness::Ds4).unwrap();
    // The native MXFP4 layout (docs/gguf.md §7.1): 155,971,125,312 B of tensor data.
    let mx = SyntheticModel::new(TypeRecipe::MXFP4, 43, 0).unwrap();
    assert_eq!(mx.file_size() - mx.data_offset(), 155_971_125_312);
    let spec = ModelSpec::from_header(mx.header(), Strictness::Ds4).unwrap();
    assert_eq!(spec.routed_bits(), 4);
    let gate = spec
        .layer_tensor(42, ds4_model::LayerTensor::DownExps)
        .unwrap();
    assert_eq!((gate.ty, gate.n_bytes), (GgmlType::Mxfp4, 1_140_850_688));

    // With the real vocabulary and the 57 KVs, docs/gguf.md §7.1: data at 5,328,480, file
    // 86,720,106,144 B (= 80.76 GiB).
    let f = GgufFile::open(VOCAB_FIXTURE).unwrap();
    let tok = ds4_convert::tokenizer::from_gguf(VOCAB_FIXTURE.as_ref(), f.header()).unwrap();
    let real = SyntheticModel::with_tokenizer(TypeRecipe::Q2, 43, 0, &tok).unwrap();
    assert_eq!(real.header().metadata.len(), 57);
    assert_eq!(real.data_offset(), 5_328_480);
    assert_eq!(real.file_size(), 86_720_106_144);
    assert_eq!(
        format!("{:.2}", real.file_size() as f64 / (1u64 << 30) as f64),
        "80.76"
    );
    assert_eq!(
        real.file_size(),
        ds4_gguf::file_size(real.header()).unwrap()
    );
}

/// A sink that counts bytes and keeps only chosen windows of the stream.
struct Probe {
    pos: u64,
    windows: Vec<(u64, Vec<u8>)>,
    fill: Vec<usize>,
}

impl Write for Probe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let (lo, hi) = (self.pos, self.pos + buf.len() as u64);
        // Windows are sorted and disjoint: find the first that may overlap.
        let start = self
            .windows
            .partition_point(|(off, data)| off + data.len() as u64 <= lo);
        for i in start..self.windows.len() {
            let (off, ref mut data) = self.windows[i];
            if off >= hi {
                break;
            }
            let a = off.max(lo);
            let b = (off + data.len() as u64).min(hi);
            data[(a - off) as usize..(b - off) as usize]
                .copy_from_slice(&buf[(a - lo) as usize..(b - lo) as usize]);
            self.fill[i] += (b - a) as usize;
        }
        self.pos = hi;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn layers4_q2_file_validates_and_matches_its_dry_run() {
    let model = SyntheticModel::new(TypeRecipe::Q2, 4, 7).unwrap();
    let dry = model.file_size();
    let h = model.header();
    // Keep the header, and per tensor its first row plus the padding after it.
    let mut windows = vec![(0u64, vec![0u8; model.data_offset() as usize])];
    let mut is_pad = vec![false];
    for (i, t) in h.tensors.iter().enumerate() {
        let (_, rb) = model.rows(i).unwrap();
        windows.push((model.data_offset() + t.offset, vec![0; rb as usize]));
        is_pad.push(false);
        let end = t.offset + t.n_bytes().unwrap();
        let padded = end.div_ceil(32) * 32;
        if padded > end {
            windows.push((
                model.data_offset() + end,
                vec![0xAA; (padded - end) as usize],
            ));
            is_pad.push(true);
        }
    }
    let n = windows.len();
    let probe = Probe {
        pos: 0,
        windows,
        fill: vec![0; n],
    };
    let (probe, written) = model.write_to(probe, &mut NoProgress).unwrap();
    assert_eq!(written, dry, "written size != dry-run size");
    assert_eq!(probe.pos, dry);
    assert!(probe
        .fill
        .iter()
        .zip(&probe.windows)
        .all(|(f, (_, d))| *f == d.len()));

    // Rebuild the file sparsely (header + the captured windows) and open it with the full
    // GGUF parser: every tensor span must lie inside a file of exactly the dry-run size.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("syn4.gguf");
    {
        use std::io::{Seek, SeekFrom};
        let mut f = std::fs::File::create(&path).unwrap();
        f.set_len(dry).unwrap();
        for (off, data) in &probe.windows {
            f.seek(SeekFrom::Start(*off)).unwrap();
            f.write_all(data).unwrap();
        }
    }
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.header(), h);
    assert_eq!(file.layout().data_offset, model.data_offset());
    let spec = ModelSpec::from_header(file.header(), Strictness::Layout).unwrap();
    // Layout validation takes dims from the metadata; additionally hold every tensor to
    // ds4's exact per-family types and the real per-layer dims.
    let want = expected_tensors(&flash_hparams(4).unwrap());
    assert_eq!(spec.tensors.len(), want.len());
    for (b, w) in spec.tensors.iter().zip(&want) {
        assert_eq!(b.expected.dims, w.dims, "{}", w.name);
        assert!(b.expected.rule.accepted(true).contains(&b.ty), "{}", w.name);
    }
    assert_eq!(
        spec.tensor("blk.3.ffn_gate_exps.weight").unwrap().ty,
        GgmlType::Iq2Xxs
    );
    assert_eq!(
        spec.tensor("blk.3.ffn_down_exps.weight").unwrap().ty,
        GgmlType::Q2K
    );

    // Streamed bytes = in-memory generator bytes; padding is zero; first rows decode to
    // finite values of a sane scale.
    for (i, t) in h.tensors.iter().enumerate() {
        let (_, rb) = model.rows(i).unwrap();
        let mut row = vec![0u8; rb as usize];
        model.fill_rows(i, 0, &mut row).unwrap();
        let (info, data) = file.tensor_bytes(&t.name).unwrap();
        assert_eq!(&data[..rb as usize], &row[..], "{}", t.name);
        if t.ty == GgmlType::I32 {
            continue;
        }
        let mut vals = vec![0f32; info.dims[0] as usize];
        quant::dequantize(t.ty, &row, &mut vals).unwrap();
        assert!(
            vals.iter().all(|v| v.is_finite() && v.abs() < 64.0),
            "{}",
            t.name
        );
    }
    // The padding after every tensor was written, as zeros (12-B HC scales, the 4-B output
    // HC scale, ... leave gaps of 1..31 bytes).
    let pads: Vec<&Vec<u8>> = probe
        .windows
        .iter()
        .zip(&is_pad)
        .filter(|(_, p)| **p)
        .map(|((_, d), _)| d)
        .collect();
    assert!(!pads.is_empty());
    assert!(pads.iter().all(|d| d.iter().all(|&b| b == 0)));
}

#[test]
fn tiny_synthetic_file_reads_back_exactly() {
    let mut h = flash_hparams(4).unwrap();
    h.n_embd = 256;
    h.n_vocab = 300;
    h.n_head = 4;
    h.head_dim = 64;
    h.rope_dim = 16;
    h.q_lora_rank = 64;
    h.o_groups = 2;
    h.o_lora_rank = 32;
    h.n_expert = 8;
    h.n_expert_used = 2;
    h.expert_ff = 256;
    h.indexer_heads = 4;
    h.indexer_head_dim = 32;
    h.indexer_top_k = 4;
    let tok = ds4_convert::tokenizer::generated_tokenizer(300);
    for recipe in [
        TypeRecipe::Q2,
        TypeRecipe::Q4,
        TypeRecipe::MXFP4,
        TypeRecipe::F32,
    ] {
        let m = SyntheticModel::from_hparams(h.clone(), recipe, 3, &tok).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("tiny.gguf");
        let f = std::fs::File::create(&path).unwrap();
        let (_, n) = m.write_to(f, &mut NoProgress).unwrap();
        assert_eq!(n, m.file_size());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), n);
        let file = GgufFile::open(&path).unwrap();
        ModelSpec::from_header(file.header(), Strictness::Layout).unwrap();
        for (i, t) in m.header().tensors.iter().enumerate() {
            let mut want = vec![0u8; t.n_bytes().unwrap() as usize];
            m.fill_tensor(i, &mut want).unwrap();
            let (_, got) = file.tensor_bytes(&t.name).unwrap();
            assert_eq!(got, &want[..], "{}", t.name);
            if t.ty != GgmlType::I32 {
                let mut v = vec![0f32; t.n_elements().unwrap() as usize];
                quant::dequantize(t.ty, got, &mut v).unwrap();
                assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            }
        }
        // Same seed → same file; the generator never depends on the write path.
        let again = SyntheticModel::from_hparams(h.clone(), recipe, 3, &tok).unwrap();
        let (bytes, _) = again.write_to(Vec::new(), &mut NoProgress).unwrap();
        assert!(bytes == std::fs::read(&path).unwrap());
    }
    // A vocabulary of the wrong size is refused.
    let e = SyntheticModel::from_hparams(
        h,
        TypeRecipe::Q2,
        0,
        &ds4_convert::tokenizer::generated_tokenizer(299),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("the vocabulary has 299 tokens, the model 300"),
        "{e}"
    );
}

/// `--sparse-experts`: the routed experts are holes (allocated blocks far below the
/// apparent size), read back as zeros that dequantize to zeros; every other tensor holds
/// exactly the generator's bytes and the file validates.
#[test]
fn sparse_experts_file_has_holes_that_read_as_zero_blocks() {
    use ds4_convert::synthetic::is_routed_expert;
    use std::os::unix::fs::MetadataExt;
    let mut h = flash_hparams(2).unwrap();
    h.n_embd = 256;
    h.n_vocab = 300;
    h.n_head = 4;
    h.head_dim = 64;
    h.rope_dim = 16;
    h.q_lora_rank = 64;
    h.o_groups = 2;
    h.o_lora_rank = 32;
    h.n_expert = 64;
    h.n_expert_used = 2;
    h.expert_ff = 512;
    h.indexer_heads = 4;
    h.indexer_head_dim = 32;
    h.indexer_top_k = 4;
    let tok = ds4_convert::tokenizer::generated_tokenizer(300);
    let m = SyntheticModel::from_hparams(h, TypeRecipe::Q2, 5, &tok).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("sparse.gguf");
    let f = std::fs::File::create(&path).unwrap();
    let written = m.write_sparse_experts(&f, &path, &mut NoProgress).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), m.file_size());
    let experts: u64 = m
        .header()
        .tensors
        .iter()
        .filter(|t| is_routed_expert(&t.name))
        .map(|t| t.n_bytes().unwrap())
        .sum();
    assert_eq!(
        m.header()
            .tensors
            .iter()
            .filter(|t| is_routed_expert(&t.name))
            .count(),
        6
    );
    assert!(experts > (4 << 20), "experts {experts} bytes");
    assert!(written + experts <= m.file_size());
    // Allocated bytes: what was written (plus block rounding), not the experts.
    let allocated = meta.blocks() * 512;
    assert!(
        allocated < m.file_size() - experts / 2,
        "allocated {allocated} of {} (experts {experts})",
        m.file_size()
    );
    let file = GgufFile::open(&path).unwrap();
    ModelSpec::from_header(file.header(), Strictness::Layout).unwrap();
    for (i, t) in m.header().tensors.iter().enumerate() {
        let (_, got) = file.tensor_bytes(&t.name).unwrap();
        if is_routed_expert(&t.name) {
            assert!(got.iter().all(|&b| b == 0), "{}", t.name);
            let mut v = vec![1f32; t.n_elements().unwrap() as usize];
            quant::dequantize(t.ty, got, &mut v).unwrap();
            assert!(v.iter().all(|&x| x == 0.0), "{}", t.name);
        } else {
            let mut want = vec![0u8; t.n_bytes().unwrap() as usize];
            m.fill_tensor(i, &mut want).unwrap();
            assert_eq!(got, &want[..], "{}", t.name);
        }
    }
}

/// `--router-skew`: 0 writes exactly the default bytes; S > 0 lowers each top-k layer's
/// bias by S·ln(1+rank) over a per-layer random ranking and draws the hash layers'
/// experts Zipf-like, so a few experts dominate (what an expert cache meets in practice).
#[test]
fn router_skew_favours_few_experts_and_zero_changes_nothing() {
    let mut h = flash_hparams(4).unwrap();
    h.n_embd = 256;
    h.n_vocab = 2000;
    h.n_head = 4;
    h.head_dim = 64;
    h.rope_dim = 16;
    h.q_lora_rank = 64;
    h.o_groups = 2;
    h.o_lora_rank = 32;
    h.n_expert = 64;
    h.n_expert_used = 6;
    h.expert_ff = 256;
    h.indexer_heads = 4;
    h.indexer_head_dim = 32;
    h.indexer_top_k = 4;
    let tok = ds4_convert::tokenizer::generated_tokenizer(2000);
    let model = |s: f32| {
        SyntheticModel::from_hparams(h.clone(), TypeRecipe::F32, 3, &tok)
            .unwrap()
            .with_router_skew(s)
            .unwrap()
    };
    let tensor = |m: &SyntheticModel, name: &str| {
        let i = m.tensor_index(name).unwrap();
        let mut b = vec![0u8; m.header().tensors[i].n_bytes().unwrap() as usize];
        m.fill_tensor(i, &mut b).unwrap();
        b
    };
    let (plain, zero, skewed) = (model(0.0), model(0.0), model(0.5));
    let bias = "blk.3.exp_probs_b.bias";
    let hash = "blk.0.ffn_gate_tid2eid.weight";
    assert!(plain.tensor_index(bias).is_some() && plain.tensor_index(hash).is_some());
    for name in [bias, hash] {
        assert_eq!(tensor(&plain, name), tensor(&zero, name), "{name}");
        assert_ne!(tensor(&plain, name), tensor(&skewed, name), "{name}");
    }
    // The bias: spread S·ln(64) ≈ 2.1 instead of 0.02, the ±0.01 draw on top.
    let b: Vec<f32> = tensor(&skewed, bias)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (lo, hi) = b
        .iter()
        .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    assert!((-0.01..=0.01).contains(&hi), "rank 0 keeps its draw: {hi}");
    assert!((lo - (-0.5 * 64f32.ln())).abs() <= 0.011, "rank 63: {lo}");
    // Hash layer: distinct experts per token, and the most drawn expert far above the
    // least drawn one (uniform draws of 2000×6 would give about 188 ± 14 each).
    let ids: Vec<i32> = tensor(&skewed, hash)
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut count = vec![0usize; 64];
    for row in ids.chunks(6) {
        let mut r = row.to_vec();
        r.sort_unstable();
        r.dedup();
        assert_eq!(r.len(), 6, "distinct experts per token");
        for &e in row {
            count[e as usize] += 1;
        }
    }
    let (min, max) = (count.iter().min().unwrap(), count.iter().max().unwrap());
    assert!(*max > 4 * *min, "counts {min}..{max}");
    assert!(model(0.0).with_router_skew(-1.0).is_err());
    assert!(model(0.0).with_router_skew(f32::NAN).is_err());
}

#[test]
fn synthetic_mtp_sidecar_has_the_published_layout() {
    // docs/gguf.md §4.7: 32 tensors, the last one (norm, 4096 F32) ending at data byte
    // 3,807,600,192; ds4's types (Q8_0 projections, Q4_K experts, F32 rest).
    let q2 = SyntheticModel::new(TypeRecipe::Q2, 1, 0).unwrap();
    let side = q2.mtp_sidecar().unwrap();
    assert_eq!(side.header().tensors.len(), 32);
    assert_eq!(side.file_size() - side.data_offset(), 3_807_600_192);
    ds4_model::mtp::validate_mtp(side.header(), q2.hparams(), true).unwrap();
    let ty = |n: &str| {
        side.header()
            .tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .ty
    };
    assert_eq!(ty("mtp.0.e_proj.weight"), GgmlType::Q8_0);
    assert_eq!(ty("mtp.0.ffn_gate_exps.weight"), GgmlType::Q4K);
    assert_eq!(ty("mtp.0.hnorm.weight"), GgmlType::F32);
    // A tiny f32 sidecar writes and validates as a file, and differs from the main
    // model's random stream.
    let h = ds4_model::HParams {
        n_layer: 2,
        n_embd: 64,
        n_head: 2,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 32,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab: 97,
        n_expert: 4,
        n_expert_used: 2,
        expert_ff: 32,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; 2],
        sliding_window: 8,
        compress_ratios: vec![0, 0],
        context_length: Some(256),
        ..ds4_model::HParams::flash()
    };
    let tok = ds4_model::layout::placeholder_tokenizer(h.n_vocab);
    let tiny = SyntheticModel::from_hparams(h.clone(), TypeRecipe::F32, 3, &tok).unwrap();
    let side = tiny.mtp_sidecar().unwrap();
    let (bytes, _) = side.write_to(Vec::new(), &mut NoProgress).unwrap();
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert!(ds4_model::mtp::has_mtp(f.header()));
    ds4_model::mtp::validate_mtp(f.header(), &h, false).unwrap();
    assert!(f.header().tensors.iter().all(|t| t.ty == GgmlType::F32));
}
