//! Quantization quality of our q2/q4 encoders against ds4's own quantizer, on the same tensors
//! (tools/quantcmp: `run.sh` builds ds4's quantizer from its public source into a scratch
//! directory and runs this with `--driver`).
//!
//! Every tensor goes through both quantizers the way each converter handles it: routed experts
//! one expert at a time (ours: `quant::quantize_matrix` with the expert's slice of the imatrix
//! entry, exactly what `ds4-convert` does; ds4: its tool's own imatrix lookup and conversion
//! function, through `ds4q_driver`), dense tensors whole. Both outputs are dequantized with
//! ds4-gguf's decoders (bit-exact with the `gguf` package) and compared with the f32 input.
//!
//! Sources: the trained demo model's f32 weights (`--model`, classified by the types the q2
//! and q4 recipes give them) and synthetic tensors at Flash's shapes (heavy-tailed values with
//! per-column scales). Importance: none, a synthetic imatrix (log-normal per-column energies
//! with a few outlier channels, written to a `.dat` both sides read), and a collected one
//! (`--imatrix`, e.g. from `ds4 imatrix` on the demo model; it only names the demo's tensors).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ds4_convert::imatrix::{Entry, Imatrix};
use ds4_gguf::quant;
use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::layout::TypeRecipe;

#[derive(Parser)]
struct Args {
    /// ds4q_driver (tools/quantcmp/ds4q_driver.c built against ds4's gguf-tools).
    #[arg(long)]
    driver: PathBuf,
    /// A ds4-layout f32 GGUF whose weights are compared (the trained demo model).
    #[arg(long, default_value = "tests/fixtures/kjv/ds4-kjv.gguf")]
    model: PathBuf,
    /// A collected imatrix for `--model` (`ds4 imatrix`).
    #[arg(long)]
    imatrix: Option<PathBuf>,
    /// Scratch directory for the raw matrices and the synthetic imatrix.
    #[arg(long, default_value = "/tmp/quantcmp")]
    work: PathBuf,
    /// Experts per synthetic routed tensor (Flash shapes: 4096 × ROWS gate/up, 2048 × ROWS down).
    #[arg(long, default_value_t = 8)]
    synthetic_experts: usize,
    /// Rows per synthetic expert (Flash has 2048 for gate/up and 4096 for down; fewer keeps the
    /// run short, the per-row search is the same).
    #[arg(long, default_value_t = 128)]
    synthetic_rows: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Exit with status 1 when ours is more than this many percent above ds4's RMSE anywhere.
    #[arg(long, default_value_t = 2.0)]
    max_excess_pct: f64,
}

/// One tensor to quantize: row-major `n_mat` matrices of `rows × cols` (`n_mat > 1`: experts).
struct Tensor {
    name: String,
    cols: usize,
    rows: usize,
    n_mat: usize,
    data: Vec<f32>,
}

#[derive(Default, Clone, Copy)]
struct Acc {
    n: f64,
    sq_ours: f64,
    sq_ds4: f64,
    wsq_ours: f64,
    wsq_ds4: f64,
    wsum: f64,
    bytes: u64,
    same_bytes: u64,
}

struct SplitMix(u64);

impl SplitMix {
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
    /// Student-t with `nu` degrees of freedom (heavy tails like trained weights).
    fn student_t(&mut self, nu: usize) -> f64 {
        let chi2: f64 = (0..nu).map(|_| self.gauss().powi(2)).sum();
        self.gauss() / (chi2 / nu as f64).sqrt()
    }
}

fn synthetic_tensor(
    rng: &mut SplitMix,
    name: &str,
    cols: usize,
    rows: usize,
    n_mat: usize,
) -> Tensor {
    let mut data = Vec::with_capacity(cols * rows * n_mat);
    for _ in 0..n_mat {
        let col_scale: Vec<f64> = (0..cols).map(|_| (0.3 * rng.gauss()).exp()).collect();
        for _ in 0..rows {
            for s in &col_scale {
                data.push((0.01 * s * rng.student_t(5)) as f32);
            }
        }
    }
    Tensor {
        name: name.to_string(),
        cols,
        rows,
        n_mat,
        data,
    }
}

/// Log-normal per-column energies, a few channels 30× hotter (as activations have).
fn synthetic_importance(rng: &mut SplitMix, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let base = (1.5 * rng.gauss()).exp();
            let hot = if rng.uniform() < 0.01 { 30.0 } else { 1.0 };
            (base * hot) as f32
        })
        .collect()
}

fn read_f32_tensor(f: &GgufFile, name: &str) -> Result<Tensor> {
    let (info, bytes) = f.tensor_bytes(name)?;
    if info.ty != GgmlType::F32 {
        bail!(
            "{name} is {} in {}, need F32",
            info.ty.name(),
            f.path().map_or(String::new(), |p| p.display().to_string())
        );
    }
    let data: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let cols = info.dims[0] as usize;
    let rows = info.dims.get(1).copied().unwrap_or(1) as usize;
    let n_mat = info.dims.get(2).copied().unwrap_or(1) as usize;
    Ok(Tensor {
        name: name.to_string(),
        cols,
        rows,
        n_mat,
        data,
    })
}

fn write_f32(path: &Path, v: &[f32]) -> Result<()> {
    let mut b = Vec::with_capacity(v.len() * 4);
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(path, b).with_context(|| format!("writing {}", path.display()))
}

fn dequant(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n];
    quant::dequantize(ty, bytes, &mut out)?;
    Ok(out)
}

/// Quantizes `t` with both encoders and adds its errors to `acc`.
fn compare(
    args: &Args,
    t: &Tensor,
    ty: GgmlType,
    imatrix: Option<(&Path, &Imatrix)>,
    acc: &mut Acc,
) -> Result<()> {
    let per = t.rows * t.cols;
    let experts = t.n_mat > 1;
    // Ours: what ds4-convert does per expert (convert.rs write_experts) or per dense tensor.
    let mut ours = Vec::new();
    let mut imps: Vec<Option<Vec<f32>>> = Vec::new();
    for e in 0..t.n_mat {
        let imp = match imatrix {
            Some((_, im)) => im.importance(&t.name, t.cols, experts.then_some((e, t.n_mat)))?,
            None => None,
        };
        let m = &t.data[e * per..(e + 1) * per];
        ours.extend(quant::quantize_matrix(ty, m, t.cols, imp.as_deref())?);
        imps.push(imp);
    }
    // ds4's quantizer through the driver.
    let input = args.work.join("in.f32");
    let output = args.work.join("out.bin");
    write_f32(&input, &t.data)?;
    let mut cmd = Command::new(&args.driver);
    cmd.arg(ty.code().to_string())
        .arg(&input)
        .arg(t.n_mat.to_string())
        .arg(t.rows.to_string())
        .arg(t.cols.to_string())
        .arg(&output);
    if let Some((p, _)) = imatrix {
        cmd.arg(p).arg(&t.name);
    }
    let st = cmd
        .status()
        .with_context(|| format!("running {}", args.driver.display()))?;
    if !st.success() {
        bail!("{} failed on {} ({st})", args.driver.display(), t.name);
    }
    let theirs = std::fs::read(&output)?;
    if theirs.len() != ours.len() {
        bail!(
            "{}: ds4 wrote {} bytes, ours {}",
            t.name,
            theirs.len(),
            ours.len()
        );
    }
    let n = t.data.len();
    let dq_ours = dequant(ty, &ours, n)?;
    let dq_ds4 = dequant(ty, &theirs, n)?;
    for e in 0..t.n_mat {
        for i in e * per..(e + 1) * per {
            let x = t.data[i] as f64;
            let (a, b) = (
                (x - dq_ours[i] as f64).powi(2),
                (x - dq_ds4[i] as f64).powi(2),
            );
            acc.sq_ours += a;
            acc.sq_ds4 += b;
            if let Some(imp) = &imps[e] {
                let w = imp[(i - e * per) % t.cols] as f64;
                acc.wsq_ours += w * a;
                acc.wsq_ds4 += w * b;
                acc.wsum += w;
            }
        }
    }
    acc.n += n as f64;
    acc.bytes += ours.len() as u64;
    acc.same_bytes += ours.iter().zip(&theirs).filter(|(a, b)| a == b).count() as u64;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.work)?;
    let mut rng = SplitMix(args.seed);
    let model =
        GgufFile::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
    let spec = ds4_model::ModelSpec::from_header(model.header(), ds4_model::Strictness::Layout)?;
    let hp = &spec.hparams;
    let h_kjv = ds4_model::layout::model_header(
        hp,
        &TypeRecipe::Q2,
        "x",
        &ds4_model::layout::TokenizerData::default(),
    );
    let h_kjv4 = ds4_model::layout::model_header(
        hp,
        &TypeRecipe::Q4,
        "x",
        &ds4_model::layout::TokenizerData::default(),
    );
    let collected = match &args.imatrix {
        Some(p) => Some((p.clone(), Imatrix::read(p)?)),
        None => None,
    };

    // (class, type, tensors) for each source.
    type Class = (&'static str, GgmlType, Vec<Tensor>);
    let mut kjv: Vec<Class> = Vec::new();
    let by = |label: &'static str,
              ty: GgmlType,
              pick: &dyn Fn(&str, GgmlType) -> bool,
              h: &ds4_gguf::Header|
     -> Result<Class> {
        let mut v = Vec::new();
        for t in &h.tensors {
            if pick(&t.name, t.ty) {
                v.push(read_f32_tensor(&model, &t.name)?);
            }
        }
        Ok((label, ty, v))
    };
    let routed_gu = |n: &str, _: GgmlType| n.contains("ffn_gate_exps") || n.contains("ffn_up_exps");
    let routed_d = |n: &str, _: GgmlType| n.contains("ffn_down_exps");
    let routed = |n: &str, _: GgmlType| n.contains("_exps.");
    let q8 = |_: &str, ty: GgmlType| ty == GgmlType::Q8_0;
    kjv.push(by(
        "routed gate/up (q2)",
        GgmlType::Iq2Xxs,
        &routed_gu,
        &h_kjv,
    )?);
    kjv.push(by("routed down (q2)", GgmlType::Q2K, &routed_d, &h_kjv)?);
    kjv.push(by("routed experts (q4)", GgmlType::Q4K, &routed, &h_kjv4)?);
    kjv.push(by(
        "attention/shared/head (q2, q4)",
        GgmlType::Q8_0,
        &q8,
        &h_kjv,
    )?);

    let (ne, nr) = (args.synthetic_experts, args.synthetic_rows);
    let syn: Vec<Class> = vec![
        (
            "routed gate/up (q2)",
            GgmlType::Iq2Xxs,
            vec![
                synthetic_tensor(&mut rng, "blk.0.ffn_gate_exps.weight", 4096, nr, ne),
                synthetic_tensor(&mut rng, "blk.0.ffn_up_exps.weight", 4096, nr, ne),
            ],
        ),
        (
            "routed down (q2)",
            GgmlType::Q2K,
            vec![synthetic_tensor(
                &mut rng,
                "blk.0.ffn_down_exps.weight",
                2048,
                nr,
                ne,
            )],
        ),
        (
            "routed experts (q4)",
            GgmlType::Q4K,
            vec![
                synthetic_tensor(&mut rng, "blk.1.ffn_gate_exps.weight", 4096, nr, ne),
                synthetic_tensor(&mut rng, "blk.1.ffn_up_exps.weight", 4096, nr, ne),
                synthetic_tensor(&mut rng, "blk.1.ffn_down_exps.weight", 2048, nr, ne),
            ],
        ),
        (
            "attention/shared/head (q2, q4)",
            GgmlType::Q8_0,
            vec![synthetic_tensor(
                &mut rng,
                "blk.0.attn_q_a.weight",
                4096,
                4 * nr,
                1,
            )],
        ),
    ];

    println!(
        "| source | tensor class | type | imatrix | values | RMSE ours | RMSE ds4 | ours vs ds4 | imp-weighted RMSE ours | ds4 | same bytes |"
    );
    println!("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut worst = f64::NEG_INFINITY;
    for (source, classes) in [("demo (trained)", &kjv), ("synthetic (Flash shapes)", &syn)] {
        // A synthetic imatrix for the routed tensors of this source (both sides read the file).
        let mut im = Imatrix::default();
        for (_, _, ts) in classes.iter() {
            for t in ts.iter().filter(|t| t.n_mat > 1) {
                im.entries.entry(t.name.clone()).or_insert_with(|| Entry {
                    ncall: 1,
                    values: synthetic_importance(&mut rng, t.cols * t.n_mat),
                });
            }
        }
        im.chunks = Some(1);
        im.dataset = Some("synthetic".into());
        let im_path = args.work.join(format!(
            "synthetic-{}.dat",
            if source.starts_with("demo") {
                "demo"
            } else {
                "flash"
            }
        ));
        im.write(&im_path)?;
        let mut variants: Vec<(&str, Option<(&Path, &Imatrix)>)> = vec![
            ("none", None),
            ("synthetic", Some((im_path.as_path(), &im))),
        ];
        if source.starts_with("demo") {
            if let Some((p, c)) = &collected {
                variants.push(("collected", Some((p.as_path(), c))));
            }
        }
        for (label, ty, ts) in classes.iter() {
            let routed = ts.iter().any(|t| t.n_mat > 1);
            for (vname, v) in &variants {
                if !routed && v.is_some() {
                    continue; // Q8_0 dense tensors take no importance on either side
                }
                let mut acc = Acc::default();
                for t in ts.iter() {
                    compare(&args, t, *ty, *v, &mut acc)?;
                }
                let r_ours = (acc.sq_ours / acc.n).sqrt();
                let r_ds4 = (acc.sq_ds4 / acc.n).sqrt();
                let pct = 100.0 * (r_ours / r_ds4 - 1.0);
                worst = worst.max(pct);
                let (w_ours, w_ds4) = if acc.wsum > 0.0 {
                    (
                        format!("{:.4e}", (acc.wsq_ours / acc.wsum).sqrt()),
                        format!("{:.4e}", (acc.wsq_ds4 / acc.wsum).sqrt()),
                    )
                } else {
                    ("-".into(), "-".into())
                };
                println!(
                    "| {source} | {label} | {} | {vname} | {} | {:.4e} | {:.4e} | {:+.2} % | {w_ours} | {w_ds4} | {:.1} % |",
                    ty.name(),
                    acc.n as u64,
                    r_ours,
                    r_ds4,
                    pct,
                    100.0 * acc.same_bytes as f64 / acc.bytes.max(1) as f64
                );
            }
        }
    }
    println!(
        "worst: ours {worst:+.2} % against ds4 (limit +{:.1} %)",
        args.max_excess_pct
    );
    if worst > args.max_excess_pct {
        std::process::exit(1);
    }
    Ok(())
}
