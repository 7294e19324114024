//! Byte accounting: file size and weight bytes read per decoded token (docs/gguf.md §7).
//!
//! Per-token traffic is what bounds batch-1 decode speed, so `ds4 inspect` and `ds4-bench`
//! report it; it is computed from the bound tensors, never from hardcoded totals.

use ds4_gguf::GgmlType;
use serde::Serialize;

use crate::catalogue::TensorClass;
use crate::names::{GlobalTensor, LayerTensor};
use crate::spec::ModelSpec;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ByteAccounting {
    /// Sum of all catalogue tensor payloads (unpadded).
    pub tensor_bytes: u64,
    /// (type, bytes, tensor count), for every type present.
    pub by_type: Vec<(String, u64, usize)>,
    /// Weight bytes read per decoded token while no CSA layer needs its indexer query
    /// (ds4 skips indexer q_b/proj until a ratio-4 layer holds more than top_k rows).
    pub per_token_short: u64,
    /// Weight bytes per token once the indexer query runs (long context).
    pub per_token_long: u64,
    /// Components of `per_token_short`, plus the long-context extra, by name.
    pub per_token_parts: Vec<(String, u64)>,
    /// Routed experts per layer and used per token: what [`Self::per_step_short`] needs to
    /// count the experts a batch of tokens reads.
    pub n_expert: u32,
    pub n_expert_used: u32,
}

impl ByteAccounting {
    pub fn of(spec: &ModelSpec) -> ByteAccounting {
        let h = &spec.hparams;
        let bytes = |name: &str| spec.tensor(name).map(|t| t.n_bytes).unwrap_or(0);
        let mut by_type: Vec<(GgmlType, u64, usize)> = Vec::new();
        for t in &spec.tensors {
            match by_type.iter_mut().find(|(ty, _, _)| *ty == t.ty) {
                Some(slot) => {
                    slot.1 += t.n_bytes;
                    slot.2 += 1;
                }
                None => by_type.push((t.ty, t.n_bytes, 1)),
            }
        }
        by_type.sort();
        let (
            mut routed,
            mut shared,
            mut attn,
            mut comp,
            mut icomp,
            mut router,
            mut hc,
            mut norms,
            mut idx_q,
        ) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        let n_exp = h.n_expert.max(1) as u64;
        for il in 0..h.n_layer {
            use LayerTensor as L;
            let l = |t: LayerTensor| bytes(&t.name(il));
            for t in [L::GateExps, L::UpExps, L::DownExps] {
                routed += l(t) / n_exp * h.n_expert_used as u64;
            }
            shared += l(L::GateShexp) + l(L::UpShexp) + l(L::DownShexp);
            for t in [
                L::AttnQA,
                L::AttnQB,
                L::AttnKv,
                L::AttnOutputA,
                L::AttnOutputB,
            ] {
                attn += l(t);
            }
            for (a, i) in L::compressor(false).into_iter().zip(L::compressor(true)) {
                comp += l(a);
                icomp += l(i);
            }
            router += l(L::RouterGate) + l(L::RouterBias);
            if h.is_hash_layer(il) {
                router += 4 * h.n_expert_used as u64; // one tid2eid row of i32
            }
            for t in L::hc(false).into_iter().chain(L::hc(true)) {
                hc += l(t);
            }
            for t in [
                L::AttnNorm,
                L::FfnNorm,
                L::AttnQANorm,
                L::AttnKvNorm,
                L::AttnSinks,
            ] {
                norms += l(t);
            }
            idx_q += l(L::IndexerQB) + l(L::IndexerProj);
        }
        let embd_row = spec
            .tensor(GlobalTensor::TokenEmbd.name())
            .and_then(|t| t.ty.row_bytes(h.n_embd as u64))
            .unwrap_or(0);
        let head = [
            GlobalTensor::OutputHcFn,
            GlobalTensor::OutputHcBase,
            GlobalTensor::OutputHcScale,
            GlobalTensor::OutputNorm,
            GlobalTensor::Output,
        ]
        .into_iter()
        .map(|g| bytes(g.name()))
        .sum::<u64>();
        let parts = vec![
            ("routed experts".to_string(), routed),
            ("shared expert".to_string(), shared),
            ("attention projections".to_string(), attn),
            ("attention compressor".to_string(), comp),
            ("indexer compressor".to_string(), icomp),
            ("router".to_string(), router),
            ("hc".to_string(), hc),
            ("norms + sinks".to_string(), norms),
            ("embedding row".to_string(), embd_row),
            ("output head".to_string(), head),
        ];
        let short: u64 = parts.iter().map(|p| p.1).sum();
        let mut per_token_parts = parts;
        per_token_parts.push(("indexer query (long context only)".to_string(), idx_q));
        ByteAccounting {
            tensor_bytes: spec.tensors.iter().map(|t| t.n_bytes).sum(),
            by_type: by_type
                .into_iter()
                .map(|(t, b, n)| (t.name(), b, n))
                .collect(),
            per_token_short: short,
            per_token_long: short + idx_q,
            per_token_parts,
            n_expert: h.n_expert as u32,
            n_expert_used: h.n_expert_used as u32,
        }
    }

    /// Expected weight bytes of one batched decode step of `batch` sequences (short
    /// context) when the router spreads tokens evenly over the experts, as a synthetic
    /// model's random router does and a trained one's load balancing aims at
    /// (docs/gguf.md §7.3): every weight but the routed experts is read once for the whole
    /// step, and each layer reads the distinct experts the step's tokens picked, on average
    /// `E·(1 − (1 − k/E)^batch)` of E when each token picks k distinct ones. So the batch's
    /// bandwidth limit on aggregate tok/s is `batch · bandwidth / per_step_short(batch)`,
    /// below `batch ×` the one-token limit as soon as the tokens' experts stop overlapping.
    pub fn per_step_short(&self, batch: usize) -> f64 {
        let routed = self
            .per_token_parts
            .iter()
            .find(|p| p.0 == "routed experts")
            .map_or(0, |p| p.1) as f64;
        let (e, k) = (f64::from(self.n_expert), f64::from(self.n_expert_used));
        if batch == 0 || e == 0.0 || k == 0.0 {
            return 0.0;
        }
        let distinct = e * (1.0 - (1.0 - k / e).powi(batch.min(i32::MAX as usize) as i32));
        self.per_token_short as f64 - routed + routed / k * distinct
    }

    /// Bytes of one class (for summaries).
    pub fn class_bytes(spec: &ModelSpec, class: TensorClass) -> u64 {
        spec.tensors
            .iter()
            .filter(|t| t.expected.class == class)
            .map(|t| t.n_bytes)
            .sum()
    }
}
