//! `ds4 imatrix` on the trained demo model (tests/fixtures/kjv): the routed experts'
//! activation statistics, collected by the CPU engine, written in llama.cpp's legacy format,
//! read back, and used by `ds4-convert requant` to weight the q2 experts. The weighted error
//! on those statistics must not grow (docs/gguf.md §5.4).

use std::path::{Path, PathBuf};

use ds4_convert::imatrix::Imatrix;
use ds4_gguf::GgufFile;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Σ over experts, rows and columns of imp_e[c] · (w − ŵ)² of one routed tensor.
fn weighted_error(f32_file: &GgufFile, q: &GgufFile, name: &str, im: &Imatrix) -> f64 {
    let (t, w) = f32_file.tensor_bytes(name).unwrap();
    let w: Vec<f32> = w
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let (tq, data) = q.tensor_bytes(name).unwrap();
    let mut got = vec![0f32; w.len()];
    ds4_gguf::quant::dequantize(tq.ty, data, &mut got).unwrap();
    let (ne0, ne1, n) = (t.dims[0] as usize, t.dims[1] as usize, t.dims[2] as usize);
    let mut sum = 0f64;
    for e in 0..n {
        let imp = im
            .importance(name, ne0, Some((e, n)))
            .unwrap()
            .unwrap_or_else(|| vec![0.0; ne0]);
        for r in 0..ne1 {
            let at = (e * ne1 + r) * ne0;
            for (c, p) in imp.iter().enumerate() {
                sum += f64::from(*p) * f64::from(w[at + c] - got[at + c]).powi(2);
            }
        }
    }
    sum
}

#[test]
fn collected_imatrix_round_trips_and_lowers_the_weighted_q2_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = root().join("tests/fixtures/kjv/ds4-kjv.gguf");
    let text = tmp.path().join("text.txt");
    let heldout = std::fs::read_to_string(root().join("tests/fixtures/kjv/heldout.txt")).unwrap();
    std::fs::write(&text, &heldout[..6000]).unwrap();
    let out = tmp.path().join("kjv.dat");
    let req = ds4_cli::imatrix::Request {
        model: model.clone(),
        file: text,
        out: out.clone(),
        ctx: 64,
        chunks: Some(2),
        threads: 1,
    };
    let (chunks, entries) = ds4_cli::imatrix::run(&req, &mut std::io::sink()).unwrap();
    assert_eq!(chunks, 2);
    let bytes = std::fs::read(&out).unwrap();
    let im = Imatrix::parse(&bytes).unwrap();
    assert_eq!(im.to_bytes(), bytes, "the file round-trips byte for byte");
    assert_eq!(im.entries.len(), entries);
    assert_eq!(im.chunks, Some(2));
    // Every routed tensor of the 4 layers, with n_expert · ne0 values and some expert used.
    let f = GgufFile::open(&model).unwrap();
    let routed: Vec<String> = f
        .header()
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("_exps.weight"))
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(routed.len(), 12);
    for name in &routed {
        let t = f.header().tensor(name).unwrap();
        let e = &im.entries[name];
        assert_eq!(e.values.len() as u64, t.dims[0] * t.dims[2], "{name}");
        assert!(e.values.iter().any(|v| *v > 0.0), "{name}: no activation");
    }
    // q2 with and without it; the weighted error on the collected statistics.
    let plain = tmp.path().join("q2.gguf");
    let weighted = tmp.path().join("q2-imatrix.gguf");
    let mut o = ds4_convert::HfOptions::new("q2").unwrap();
    ds4_convert::requant::requantize(&model, &plain, &o, &mut ds4_convert::NoProgress).unwrap();
    o.imatrix = Some((out, std::sync::Arc::new(im.clone())));
    ds4_convert::requant::requantize(&model, &weighted, &o, &mut ds4_convert::NoProgress).unwrap();
    let (fp, fw) = (
        GgufFile::open(&plain).unwrap(),
        GgufFile::open(&weighted).unwrap(),
    );
    let (mut tp, mut tw) = (0f64, 0f64);
    for name in &routed {
        let ep = weighted_error(&f, &fp, name, &im);
        let ew = weighted_error(&f, &fw, name, &im);
        eprintln!("{name}: weighted error {ew:.4e} with the imatrix, {ep:.4e} without");
        assert!(ew <= ep, "{name}: {ew} > {ep}");
        tp += ep;
        tw += ew;
    }
    eprintln!("total: {tw:.4e} with, {tp:.4e} without");
}
