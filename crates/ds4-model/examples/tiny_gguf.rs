//! Writes a small, valid ds4-layout GGUF (tiny dims, F32, deterministic pseudo-random
//! payload) for `ds4 inspect` demos and as a fuzzing seed:
//! `cargo run -p ds4-model --example tiny_gguf -- OUT.gguf`.

use std::io::BufWriter;

use ds4_gguf::GgufWriter;
use ds4_model::layout::{model_header, placeholder_tokenizer, TypeRecipe};
use ds4_model::HParams;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).ok_or("usage: tiny_gguf OUT.gguf")?;
    let n_layer = 4;
    let hp = HParams {
        n_layer,
        n_embd: 64,
        n_head: 4,
        head_dim: 32,
        rope_dim: 8,
        q_lora_rank: 32,
        o_lora_rank: 32,
        o_groups: 2,
        n_vocab: 300,
        n_expert: 4,
        n_expert_used: 2,
        expert_ff: 32,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; n_layer],
        sliding_window: 16,
        compress_ratios: vec![0, 0, 4, 16],
        indexer_heads: 16,
        indexer_head_dim: 16,
        indexer_top_k: 4,
        context_length: Some(4096),
        ..HParams::flash()
    };
    let header = model_header(
        &hp,
        &TypeRecipe::F32,
        "ds4-rs tiny layout demo",
        &placeholder_tokenizer(hp.n_vocab),
    );
    let file = std::fs::File::create(&out)?;
    let mut w = GgufWriter::new(BufWriter::new(file), header)?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    while let Some((name, n)) = w.next_tensor() {
        let is_index = name.ends_with("tid2eid.weight");
        let mut bytes = Vec::with_capacity(n as usize);
        for i in 0..n / 4 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if is_index {
                // Hash-routing table: any valid expert ids will do for a layout demo.
                let e = (i + (state % 3)) % hp.n_expert as u64;
                bytes.extend_from_slice(&(e as i32).to_le_bytes());
            } else {
                let v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2;
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        w.write_tensor(&bytes)?;
    }
    let (_, total) = w.finish()?;
    println!("wrote {out}: {total} bytes");
    Ok(())
}
