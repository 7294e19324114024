//! `ds4-convert official --dry-run`: the exact output size of every layout from the
//! checkpoint's headers alone.
//!
//! The full-size test writes DeepSeek V4 Flash's release layout (FP8 E4M3 dense weights with
//! 128 × 128 E8M0 scales, packed FP4 experts with one E8M0 scale per 32 inputs, BF16/F32
//! where the release has them; 43 layers, 256 experts, the real vocabulary size) as
//! safetensors headers over sparse data: ~160 GB apparent, a few MB on disk. The dry run must
//! agree with ds4-model's recipes (the same tensor table `ds4-convert synthetic` writes) and
//! with the figures docs/gguf.md §2 gives, and it must not need the data.

mod common;

use std::path::Path;

use common::{config_json, tensors, Dims, Naming};
use ds4_convert::{dry_run, HfOptions};
use ds4_gguf::Header;
use ds4_model::layout::{model_header, TypeRecipe};
use ds4_model::HParams;

fn flash_dims() -> Dims {
    let h = HParams::flash();
    Dims {
        e: h.n_embd,
        v: h.n_vocab,
        h: h.n_head,
        d: h.head_dim,
        r: h.rope_dim,
        q: h.q_lora_rank,
        g: h.o_groups,
        o: h.o_lora_rank,
        n: h.n_expert,
        k: h.n_expert_used,
        f: h.expert_ff,
        m: h.hc_mult,
        ih: h.indexer_heads,
        id: h.indexer_head_dim,
        ratios: h.compress_ratios.iter().map(|&r| r as usize).collect(),
        hash: h.hash_layer_count,
    }
}

/// (name, safetensors dtype, shape, bytes) of every stored tensor of the release format, as
/// `tests/official.rs` builds its small one: FP8 + block scales for 2-D dense weights, packed
/// FP4 + scales for routed experts, BF16 for the compressors and the router, F32/I64 else.
fn release_entries(d: &Dims) -> Vec<(String, &'static str, Vec<usize>, usize)> {
    let mut all = Vec::new();
    let mut srcs = tensors(d, Naming::Official);
    // The release's MTP block (`mtp.0.*`), shaped as tools/oracle/make_official_ckpt.py builds
    // it: a window-only layer (layer 0's tensors), a top-k router (the first top-k layer's),
    // the MTP-only projections, norms and HC head.
    let topk = format!("layers.{}.ffn.gate.", d.hash);
    let mut mtp = Vec::new();
    for s in &srcs {
        let from = if s.name.starts_with("layers.0.") && !s.name.contains(".ffn.gate.") {
            s.name.strip_prefix("layers.0.")
        } else if s.name.starts_with(&topk) {
            s.name.strip_prefix(&format!("layers.{}.", d.hash))
        } else {
            None
        };
        if let Some(rest) = from {
            let mut m = s.clone();
            m.name = format!("mtp.0.{rest}");
            mtp.push(m);
        }
    }
    let (e, m) = (d.e, d.m);
    for (name, shape) in [
        ("e_proj.weight", vec![e, e]),
        ("h_proj.weight", vec![e, e]),
        ("enorm.weight", vec![e]),
        ("hnorm.weight", vec![e]),
        ("norm.weight", vec![e]),
        ("hc_head_fn", vec![m, m * e]),
        ("hc_head_base", vec![m]),
        ("hc_head_scale", vec![1]),
    ] {
        let mut t = srcs[0].clone();
        t.name = format!("mtp.0.{name}");
        t.shape = shape;
        t.int = false;
        mtp.push(t);
    }
    srcs.extend(mtp);
    for s in srcs {
        let (name, shape) = (&s.name, &s.shape);
        let n: usize = shape.iter().product();
        let plain = s.int
            || shape.len() != 2
            || name.contains("hc_")
            || name.ends_with(".ape")
            || name.ends_with("attn_sink");
        let base = name.strip_suffix(".weight").unwrap_or(name).to_string();
        if plain {
            let (dt, w) = if s.int { ("I64", 8) } else { ("F32", 4) };
            all.push((name.clone(), dt, shape.clone(), n * w));
        } else if name.contains("compressor.w") || name.ends_with("ffn.gate.weight") {
            all.push((name.clone(), "BF16", shape.clone(), n * 2));
        } else if name.contains(".experts.") && !name.contains("shared") {
            let (rows, cols) = (shape[0], shape[1]);
            all.push((name.clone(), "I8", vec![rows, cols / 2], n / 2));
            let sc = vec![rows, cols / 32];
            all.push((format!("{base}.scale"), "F8_E8M0", sc, n / 32));
        } else {
            let (rows, cols) = (shape[0], shape[1]);
            all.push((name.clone(), "F8_E4M3", shape.clone(), n));
            let (tr, tc) = (rows.div_ceil(128), cols.div_ceil(128));
            all.push((format!("{base}.scale"), "F8_E8M0", vec![tr, tc], tr * tc));
        }
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// Writes the entries as `shards` safetensors files plus the index: a real header each, the
/// data region a hole (`set_len`), so the files read back zeros and take no disk.
fn write_header_only(dir: &Path, d: &Dims, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config_json(d)).unwrap(),
    )
    .unwrap();
    let all = release_entries(d);
    let per = all.len().div_ceil(shards);
    let mut map = serde_json::Map::new();
    for (i, chunk) in all.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let mut meta = serde_json::Map::new();
        let mut at = 0usize;
        for (name, dt, shape, bytes) in chunk {
            meta.insert(
                name.clone(),
                serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [at, at + bytes]}),
            );
            at += bytes;
            map.insert(name.clone(), file.clone().into());
        }
        let mut head = serde_json::to_vec(&meta).unwrap();
        while !head.len().is_multiple_of(8) {
            head.push(b' ');
        }
        let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&head);
        let path = dir.join(&file);
        std::fs::write(&path, &bytes).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len((bytes.len() + at) as u64).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
}

/// The file size and tensor-data size of `recipe` at Flash's shapes, from ds4-model's table
/// and the converter's generated vocabulary, independently of any checkpoint.
fn recipe_sizes(recipe: &TypeRecipe, name: &str) -> (u64, u64) {
    let h = HParams::flash();
    let tok = ds4_convert::tokenizer::generated_tokenizer(h.n_vocab);
    let mut header: Header = model_header(&h, recipe, name, &tok);
    let data = header.assign_offsets().unwrap();
    (ds4_gguf::file_size(&header).unwrap(), data)
}

#[test]
fn full_size_release_headers_give_every_layouts_exact_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("DeepSeek-V4-Flash");
    let d = flash_dims();
    write_header_only(&dir, &d, 46);
    let on_disk: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            use std::os::unix::fs::MetadataExt;
            e.unwrap().metadata().unwrap().blocks() * 512
        })
        .sum();
    assert!(on_disk < 64 << 20, "{on_disk} bytes on disk");

    let mut opts = HfOptions::new("q2").unwrap();
    opts.name = Some("dry run".into());
    let sizes = dry_run(&dir, &opts).unwrap();
    let names: Vec<&str> = sizes.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["q2", "q4", "mxfp4", "f32"]);
    for (name, r) in &sizes {
        let s = r.as_ref().unwrap_or_else(|e| panic!("{name}: {e}"));
        let recipe = TypeRecipe::from_name(name).unwrap();
        let (file, data) = recipe_sizes(&recipe, "dry run");
        assert_eq!((s.file_bytes, s.tensor_bytes), (file, data), "{name}");
        // The sidecar: ds4-model's MTP table (Q4_K experts whatever the main layout; F32
        // for f32), behind a header of a few KiB.
        let mut mtp = ds4_model::layout::mtp_tensor_table(&HParams::flash());
        if *name == "f32" {
            mtp.iter_mut().for_each(|t| t.ty = ds4_gguf::GgmlType::F32);
        }
        let mut mh = Header {
            metadata: Vec::new(),
            tensors: mtp,
        };
        let mtp_data = mh.assign_offsets().unwrap();
        let sidecar = s
            .mtp_bytes
            .unwrap_or_else(|| panic!("{name}: no MTP sidecar size"));
        assert!(
            (mtp_data..mtp_data + (64 << 10)).contains(&sidecar),
            "{name}: {sidecar}"
        );
        if *name != "f32" {
            // docs/gguf.md §2 (ds4 ships one Q4_K sidecar for q2 and q4).
            assert_eq!(sidecar, 3_807_602_400, "{name}");
        }
    }
    let data = |n: &str| {
        sizes
            .iter()
            .find(|(x, _)| *x == n)
            .unwrap()
            .1
            .as_ref()
            .unwrap()
            .tensor_bytes
    };
    // docs/gguf.md §2: the mxfp4 layout's tensor data, and the synthetic q2 file's data
    // (86,720,106,144 B with its data section at byte 5,328,480, §6).
    assert_eq!(data("mxfp4"), 155_971_125_312);
    assert_eq!(data("q2"), 86_720_106_144 - 5_328_480);
    // q4 is "about 153 GiB" in the docs.
    let q4 = data("q4") as f64 / (1u64 << 30) as f64;
    assert!((152.5..153.5).contains(&q4), "q4 {q4:.2} GiB");

    // The binary prints the same figures, one line per layout, and writes nothing.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ds4-convert"))
        .args([
            "official",
            "--dry-run",
            "--types",
            "mxfp4",
            "--name",
            "dry run",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    eprintln!("{text}");
    for (name, r) in &sizes {
        let s = r.as_ref().unwrap();
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(*name))
            .unwrap_or_else(|| panic!("no {name} line in:\n{text}"));
        assert!(line.contains(&format!(" {} bytes", s.file_bytes)), "{line}");
        assert_eq!(line.contains("<- --types"), *name == "mxfp4", "{line}");
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "the dry run wrote something");
}

#[test]
fn dry_run_size_is_what_the_conversion_writes() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/official-tiny");
    let opts = HfOptions::new("f32").unwrap();
    let sizes = dry_run(&fixture, &opts).unwrap();
    let f32 = sizes
        .iter()
        .find(|(n, _)| *n == "f32")
        .unwrap()
        .1
        .as_ref()
        .unwrap();
    // The tiny dims cannot hold the 256-wide blocks: those layouts say why instead of a size.
    let q2 = &sizes.iter().find(|(n, _)| *n == "q2").unwrap().1;
    assert!(q2
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("not a multiple"));

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny.gguf");
    let r = ds4_convert::convert_hf(&fixture, &out, &opts, &mut ds4_convert::NoProgress).unwrap();
    assert_eq!(r.bytes, f32.file_bytes);
    assert_eq!(std::fs::metadata(&out).unwrap().len(), f32.file_bytes);
    let (mtp_path, mtp_bytes, _) = r.mtp.unwrap();
    assert_eq!(Some(mtp_bytes), f32.mtp_bytes);
    assert_eq!(std::fs::metadata(mtp_path).unwrap().len(), mtp_bytes);
}
