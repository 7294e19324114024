//! KV-state sizes (docs/forward.md §8): what grows per token and what is fixed, as ds4 stores it
//! (f32 buffers). The placement planner budgets with these before anything is allocated.

use crate::hparams::{AttnKind, HParams};

/// Bytes per stored element (ds4 keeps every cache in f32).
pub const KV_ELEM_BYTES: u64 = 4;

/// KV bytes that each additional token of context adds: compressed attention rows
/// (one per `ratio` tokens, `head_dim` wide) and, on CSA layers, indexer rows.
pub fn kv_bytes_per_token_x(h: &HParams, ctx: u64) -> u64 {
    // Capacity per compressed layer is floor(ctx/ratio) + 2 rows; expressed per token it is
    // a rational number, so compute the total at `ctx` and let callers divide if needed.
    let mut elems = 0u64;
    for il in 0..h.n_layer {
        match h.attn_kind(il) {
            AttnKind::Sliding => {}
            AttnKind::Csa => elems += (ctx / 4 + 2) * (h.head_dim + h.indexer_head_dim) as u64,
            AttnKind::Hca(r) => elems += (ctx / u64::from(r.max(1)) + 2) * h.head_dim as u64,
        }
    }
    elems * KV_ELEM_BYTES
}

/// Average growth per token (bytes), for planners that budget `ctx × per_token + fixed`.
/// Rounded up so the budget is never short.
pub fn kv_growth_per_token(h: &HParams) -> u64 {
    const SPAN: u64 = 1 << 20;
    (kv_bytes_per_token_x(h, SPAN) - kv_bytes_per_token_x(h, 0)).div_ceil(SPAN)
}

/// Context-independent KV bytes: raw sliding-window rings of every layer, the compressors'
/// accumulators, and the +2 spare rows per compressed layer.
pub fn kv_fixed_bytes(h: &HParams) -> u64 {
    let ring = (h.n_layer * h.sliding_window * h.head_dim) as u64;
    let mut acc = 0u64;
    for il in 0..h.n_layer {
        match h.attn_kind(il) {
            AttnKind::Sliding => {}
            // (u, z) pairs of the previous and the current window, 2·D and 2·ID wide.
            AttnKind::Csa => {
                acc += (2 * 8 * 2 * h.head_dim + 2 * 8 * 2 * h.indexer_head_dim) as u64
            }
            AttnKind::Hca(r) => acc += 2 * u64::from(r) * h.head_dim as u64,
        }
    }
    (ring + acc) * KV_ELEM_BYTES + kv_bytes_per_token_x(h, 0)
}

/// A documented estimate of one session's working memory for prefill in chunks of `chunk`
/// tokens at context `ctx`: activations of a chunk (hc streams, q heads, expert hidden,
/// norms), the indexer score matrix (2 × (ctx/4 + 2) × chunk f32, as ds4 sizes it) and one
/// row of logits. The GPU backend replaces this with its measured allocations.
pub fn scratch_estimate(h: &HParams, ctx: u64, chunk: u64) -> u64 {
    let per_tok = (3 * h.hc_mult * h.n_embd
        + 2 * h.n_head * h.head_dim
        + 3 * (h.n_expert_used + 1) * h.expert_ff
        + 8 * h.n_embd
        + h.indexer_heads * h.indexer_head_dim) as u64;
    let has_csa = (0..h.n_layer).any(|il| h.attn_kind(il) == AttnKind::Csa);
    let indexer = if has_csa {
        2 * (ctx / 4 + 2) * chunk
    } else {
        0
    };
    (chunk * per_tok + indexer + h.n_vocab as u64) * 4
}

/// How [`scratch_estimate`] grows with the context: bytes per 4 tokens of `ctx` (the
/// indexer's score rows of a CSA model; 0 without CSA layers). The planner re-sizes scratch
/// with it when it looks for the largest context that fits.
pub fn scratch_bytes_per_4_ctx(h: &HParams, chunk: u64) -> u64 {
    let has_csa = (0..h.n_layer).any(|il| h.attn_kind(il) == AttnKind::Csa);
    if has_csa {
        8 * chunk
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_grows_by_its_stated_rate() {
        let h = HParams::flash();
        let per4 = scratch_bytes_per_4_ctx(&h, 2048);
        assert!(per4 > 0);
        for (a, b) in [(824u64, 32768u64), (8151, 8192), (4, 393_216)] {
            assert_eq!(
                scratch_estimate(&h, b, 2048) - scratch_estimate(&h, a, 2048),
                per4 * (b / 4 - a / 4)
            );
        }
    }

    #[test]
    fn flash_sizes_match_spec_section_8() {
        let h = HParams::flash();
        // 3440 elements per token in f32.
        assert_eq!(kv_growth_per_token(&h), 13_760);
        // Rings 2,818,048 elements + accumulators 3,051,520 f32 (+ spare rows).
        let spare = kv_bytes_per_token_x(&h, 0);
        assert_eq!(kv_fixed_bytes(&h) - spare, (2_818_048 + 3_051_520) * 4);
        // Logical totals at 64k: 913.0 MB in f32 (rings + compressed rows).
        let total = kv_bytes_per_token_x(&h, 65_536) - spare + 2_818_048 * 4;
        assert_eq!(format!("{:.1}", total as f64 / 1e6), "913.0");
    }
}
