//! Shared test inputs: the DeepSeek V4 Flash tensor tables (q2, q4, mxfp4, MTP sidecar) built
//! from the layout spec's formulas, the tiny fixture's table, machine files, requests.
//!
//! The real inventories are rebuilt from shapes and ggml block sizes (docs/gguf.md §4),
//! then checked against the independently computed totals (docs/gguf.md §7), so a wrong
//! formula here fails a test instead of skewing every scenario.
#![allow(dead_code)]

use ds4_placement::{
    MachineFacts, Request, TensorClass as C, TensorInventory, TensorSpec, WeightSet,
};

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ty {
    F32,
    F16,
    I32,
    Q8_0,
    Q2K,
    Q4K,
    Iq2Xxs,
    Mxfp4,
}

fn bytes_of(ty: Ty, elems: u64) -> u64 {
    let (be, bb) = match ty {
        Ty::F32 | Ty::I32 => (1, 4),
        Ty::F16 => (1, 2),
        Ty::Q8_0 => (32, 34),
        Ty::Q2K => (256, 84),
        Ty::Q4K => (256, 144),
        Ty::Iq2Xxs => (256, 66),
        Ty::Mxfp4 => (32, 17),
    };
    assert_eq!(elems % be, 0, "{ty:?} needs whole blocks");
    elems / be * bb
}

/// Model dimensions (docs/gguf.md symbols).
pub struct Dims {
    pub l: u64,
    pub e: u64,
    pub v: u64,
    pub h: u64,
    pub d: u64,
    pub q: u64,
    pub g: u64,
    pub o: u64,
    pub n: u64,
    pub k: u64,
    pub f: u64,
    pub m: u64,
    pub ih: u64,
    pub id: u64,
    pub hash: u64,
    pub ratios: Vec<u64>,
}

pub fn flash_dims() -> Dims {
    Dims {
        l: 43,
        e: 4096,
        v: 129_280,
        h: 64,
        d: 512,
        q: 1024,
        g: 8,
        o: 1024,
        n: 256,
        k: 6,
        f: 2048,
        m: 4,
        ih: 64,
        id: 128,
        hash: 3,
        ratios: (0..43)
            .map(|i| {
                if i < 2 {
                    0
                } else if i % 2 == 0 {
                    4
                } else {
                    128
                }
            })
            .collect(),
    }
}

/// Tensor types: `plain` for everything the real files store as Q8_0/F16 when `all` is
/// None; with `all = Some(t)` every tensor (the tiny F32 fixture).
pub struct Types {
    pub all: Option<Ty>,
    pub gate_up: Ty,
    pub down: Ty,
}

fn build(d: &Dims, t: &Types) -> TensorInventory {
    let ty = |x: Ty| t.all.unwrap_or(x);
    let mut inv = TensorInventory::default();
    let mut add = |name: String, elems: u64, tt: Ty, class: C, layer: Option<u32>| {
        inv.push(TensorSpec::new(name, bytes_of(tt, elems), class, layer).with_elements(elems));
    };
    let hc_dim = d.m * d.e;
    let hc_mix = 2 * d.m + d.m * d.m;
    for il in 0..d.l {
        let p = |s: &str| format!("blk.{il}.{s}");
        let lay = Some(il as u32);
        let r = d.ratios[il as usize];
        if il < d.hash {
            add(
                p("ffn_gate_tid2eid.weight"),
                d.k * d.v,
                ty(Ty::I32),
                C::Router,
                lay,
            );
        }
        add(
            p("ffn_gate_exps.weight"),
            d.e * d.f * d.n,
            ty(t.gate_up),
            C::RoutedExperts,
            lay,
        );
        add(
            p("ffn_down_exps.weight"),
            d.f * d.e * d.n,
            ty(t.down),
            C::RoutedExperts,
            lay,
        );
        add(
            p("ffn_up_exps.weight"),
            d.e * d.f * d.n,
            ty(t.gate_up),
            C::RoutedExperts,
            lay,
        );
        add(p("attn_sinks.weight"), d.h, ty(Ty::F32), C::Attention, lay);
        if r != 0 {
            let cw = if r == 4 { 2 * d.d } else { d.d };
            add(
                p("attn_compressor_ape.weight"),
                cw * r,
                ty(Ty::F16),
                C::Compressor,
                lay,
            );
            add(
                p("attn_compressor_norm.weight"),
                d.d,
                ty(Ty::F32),
                C::Compressor,
                lay,
            );
            add(
                p("attn_compressor_gate.weight"),
                d.e * cw,
                ty(Ty::F16),
                C::Compressor,
                lay,
            );
            add(
                p("attn_compressor_kv.weight"),
                d.e * cw,
                ty(Ty::F16),
                C::Compressor,
                lay,
            );
        }
        if r == 4 {
            add(
                p("indexer_compressor_ape.weight"),
                2 * d.id * 4,
                ty(Ty::F16),
                C::Indexer,
                lay,
            );
            add(
                p("indexer_compressor_norm.weight"),
                d.id,
                ty(Ty::F32),
                C::Indexer,
                lay,
            );
            add(
                p("indexer_compressor_gate.weight"),
                d.e * 2 * d.id,
                ty(Ty::F16),
                C::Indexer,
                lay,
            );
            add(
                p("indexer_compressor_kv.weight"),
                d.e * 2 * d.id,
                ty(Ty::F16),
                C::Indexer,
                lay,
            );
            add(
                p("indexer.proj.weight"),
                d.e * d.ih,
                ty(Ty::F16),
                C::Indexer,
                lay,
            );
            add(
                p("indexer.attn_q_b.weight"),
                d.q * d.ih * d.id,
                ty(Ty::F16),
                C::Indexer,
                lay,
            );
        }
        add(p("attn_kv_a_norm.weight"), d.d, ty(Ty::F32), C::Norms, lay);
        add(p("attn_q_a_norm.weight"), d.q, ty(Ty::F32), C::Norms, lay);
        add(
            p("attn_kv.weight"),
            d.e * d.d,
            ty(Ty::Q8_0),
            C::Attention,
            lay,
        );
        add(
            p("attn_output_a.weight"),
            (d.h * d.d / d.g) * d.g * d.o,
            ty(Ty::Q8_0),
            C::Attention,
            lay,
        );
        add(
            p("attn_output_b.weight"),
            d.g * d.o * d.e,
            ty(Ty::Q8_0),
            C::Attention,
            lay,
        );
        add(
            p("attn_q_a.weight"),
            d.e * d.q,
            ty(Ty::Q8_0),
            C::Attention,
            lay,
        );
        add(
            p("attn_q_b.weight"),
            d.q * d.h * d.d,
            ty(Ty::Q8_0),
            C::Attention,
            lay,
        );
        add(p("attn_norm.weight"), d.e, ty(Ty::F32), C::Norms, lay);
        if il >= d.hash {
            add(p("exp_probs_b.bias"), d.n, ty(Ty::F32), C::Router, lay);
        }
        add(
            p("ffn_gate_inp.weight"),
            d.e * d.n,
            ty(Ty::F16),
            C::Router,
            lay,
        );
        add(
            p("ffn_gate_shexp.weight"),
            d.e * d.f,
            ty(Ty::Q8_0),
            C::SharedExpert,
            lay,
        );
        add(
            p("ffn_down_shexp.weight"),
            d.f * d.e,
            ty(Ty::Q8_0),
            C::SharedExpert,
            lay,
        );
        add(
            p("ffn_up_shexp.weight"),
            d.e * d.f,
            ty(Ty::Q8_0),
            C::SharedExpert,
            lay,
        );
        add(p("ffn_norm.weight"), d.e, ty(Ty::F32), C::Norms, lay);
        add(
            p("hc_attn_base.weight"),
            hc_mix,
            ty(Ty::F32),
            C::HyperConnection,
            lay,
        );
        add(
            p("hc_attn_fn.weight"),
            hc_dim * hc_mix,
            ty(Ty::F16),
            C::HyperConnection,
            lay,
        );
        add(
            p("hc_attn_scale.weight"),
            3,
            ty(Ty::F32),
            C::HyperConnection,
            lay,
        );
        add(
            p("hc_ffn_base.weight"),
            hc_mix,
            ty(Ty::F32),
            C::HyperConnection,
            lay,
        );
        add(
            p("hc_ffn_fn.weight"),
            hc_dim * hc_mix,
            ty(Ty::F16),
            C::HyperConnection,
            lay,
        );
        add(
            p("hc_ffn_scale.weight"),
            3,
            ty(Ty::F32),
            C::HyperConnection,
            lay,
        );
    }
    add(
        "token_embd.weight".into(),
        d.e * d.v,
        ty(Ty::F16),
        C::Embedding,
        None,
    );
    add(
        "output_hc_fn.weight".into(),
        hc_dim * d.m,
        ty(Ty::F16),
        C::HyperConnection,
        None,
    );
    add(
        "output_hc_base.weight".into(),
        d.m,
        ty(Ty::F32),
        C::HyperConnection,
        None,
    );
    add(
        "output_hc_scale.weight".into(),
        1,
        ty(Ty::F32),
        C::HyperConnection,
        None,
    );
    add(
        "output_norm.weight".into(),
        d.e,
        ty(Ty::F32),
        C::Norms,
        None,
    );
    add(
        "output.weight".into(),
        d.e * d.v,
        ty(Ty::Q8_0),
        C::OutputHead,
        None,
    );
    inv
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Quant {
    Q2,
    Q4,
    /// Native MXFP4 routed experts (docs/gguf.md §2), the rest as q2/q4.
    Mxfp4,
}

/// The 1328-tensor main model.
pub fn flash(q: Quant) -> TensorInventory {
    let t = match q {
        Quant::Q2 => Types {
            all: None,
            gate_up: Ty::Iq2Xxs,
            down: Ty::Q2K,
        },
        Quant::Q4 => Types {
            all: None,
            gate_up: Ty::Q4K,
            down: Ty::Q4K,
        },
        Quant::Mxfp4 => Types {
            all: None,
            gate_up: Ty::Mxfp4,
            down: Ty::Mxfp4,
        },
    };
    build(&flash_dims(), &t)
}

/// The 32-tensor MTP sidecar, sizes from its data offsets (docs/gguf.md §4.7).
pub fn mtp_tensors() -> Vec<TensorSpec> {
    let table: [(&str, u64, C); 32] = [
        ("hc_head_base.weight", 0, C::HyperConnection),
        ("hc_head_fn.weight", 32, C::HyperConnection),
        ("hc_head_scale.weight", 262_176, C::HyperConnection),
        ("hc_attn_base.weight", 262_208, C::HyperConnection),
        ("hc_ffn_base.weight", 262_304, C::HyperConnection),
        ("hc_attn_fn.weight", 262_400, C::HyperConnection),
        ("hc_attn_scale.weight", 1_835_264, C::HyperConnection),
        ("hc_ffn_fn.weight", 1_835_296, C::HyperConnection),
        ("hc_ffn_scale.weight", 3_408_160, C::HyperConnection),
        ("attn_sinks.weight", 3_408_192, C::Attention),
        ("attn_q_a.weight", 3_408_448, C::Attention),
        ("attn_q_b.weight", 7_864_896, C::Attention),
        ("attn_q_a_norm.weight", 43_516_480, C::Norms),
        ("attn_output_a.weight", 43_520_576, C::Attention),
        ("attn_kv.weight", 79_172_160, C::Attention),
        ("attn_kv_a_norm.weight", 81_400_384, C::Norms),
        ("attn_output_b.weight", 81_402_432, C::Attention),
        ("attn_norm.weight", 117_054_016, C::Norms),
        ("ffn_norm.weight", 117_070_400, C::Norms),
        ("ffn_gate_shexp.weight", 117_086_784, C::SharedExpert),
        ("ffn_up_shexp.weight", 125_999_680, C::SharedExpert),
        ("ffn_down_shexp.weight", 134_912_576, C::SharedExpert),
        ("ffn_gate_exps.weight", 143_825_472, C::RoutedExperts),
        ("ffn_up_exps.weight", 1_351_785_024, C::RoutedExperts),
        ("ffn_down_exps.weight", 2_559_744_576, C::RoutedExperts),
        ("ffn_gate_inp.weight", 3_767_704_128, C::Router),
        ("exp_probs_b.bias", 3_771_898_432, C::Router),
        // The class ds4_model::names gives the MTP projections.
        ("e_proj.weight", 3_771_899_456, C::Attention),
        ("h_proj.weight", 3_789_725_248, C::Attention),
        ("enorm.weight", 3_807_551_040, C::Norms),
        ("hnorm.weight", 3_807_567_424, C::Norms),
        ("norm.weight", 3_807_583_808, C::Norms),
    ];
    let end = 3_807_600_192u64;
    (0..table.len())
        .map(|i| {
            let next = table.get(i + 1).map_or(end, |t| t.1);
            let t = TensorSpec::new(
                format!("mtp.0.{}", table[i].0),
                next - table[i].1,
                table[i].2,
                Some(43),
            )
            .in_set(WeightSet::Mtp);
            if table[i].2 == C::RoutedExperts {
                t.with_elements(4096 * 2048 * 256)
            } else {
                t
            }
        })
        .collect()
}

pub fn flash_with_mtp(q: Quant) -> TensorInventory {
    let mut inv = flash(q);
    inv.tensors.extend(mtp_tensors());
    inv
}

/// The tensor table of tests/fixtures/inspect/tiny-layout.gguf (ds4-model's tiny_gguf
/// example: 4 layers, E=64, all F32).
pub fn tiny() -> TensorInventory {
    let d = Dims {
        l: 4,
        e: 64,
        v: 300,
        h: 4,
        d: 32,
        q: 32,
        g: 2,
        o: 32,
        n: 4,
        k: 2,
        f: 32,
        m: 4,
        ih: 16,
        id: 16,
        hash: 1,
        ratios: vec![0, 0, 4, 16],
    };
    build(
        &d,
        &Types {
            all: Some(Ty::F32),
            gate_up: Ty::F32,
            down: Ty::F32,
        },
    )
}

pub fn machine(name: &str) -> MachineFacts {
    let path = format!("{}/machines/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    MachineFacts::from_json(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

pub const ALL_MACHINES: [&str; 9] = [
    "strix-halo-stock",
    "strix-halo-gtt124",
    "strix-halo-carveout96",
    "dgx-spark-gb10",
    "discrete-24g-64g",
    "discrete-16g-32g",
    "h200-128g",
    "container-cgroup64",
    "strix-halo-memlock64k",
];

/// Flash KV: linear fit of ds4-bench's kvcache_bytes (475.0 MB @32K, 926.0 MB @64K).
pub const KV_PER_TOKEN: u64 = 13_763;
pub const KV_FIXED: u64 = 24_000_000;

/// A request at `ctx` with `scratch` bytes of graph scratch.
pub fn request(ctx: u64, scratch: u64) -> Request {
    let mut r = Request::new(ctx, KV_PER_TOKEN, scratch);
    r.kv_fixed_bytes = KV_FIXED;
    r.prefill_chunk = 2048;
    r
}

/// Scratch the tests assume per context (ds4's context buffers minus KV, roughly).
pub fn scratch_for(ctx: u64) -> u64 {
    match ctx {
        c if c <= 8192 => 3 * GIB / 2,
        c if c <= 65_536 => 7 * GIB / 4,
        _ => 3 * GIB,
    }
}
