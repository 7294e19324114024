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
    /// Per layer, the bytes of one routed expert (its gate, up and down rows): what a step
    /// reads for each distinct expert its tokens chose there ([`Self::step_bytes`]).
    pub expert_unit_bytes: Vec<u64>,
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
        let mut expert_unit_bytes = Vec::with_capacity(h.n_layer);
        for il in 0..h.n_layer {
            use LayerTensor as L;
            let l = |t: LayerTensor| bytes(&t.name(il));
            let mut unit = 0;
            for t in [L::GateExps, L::UpExps, L::DownExps] {
                routed += l(t) / n_exp * h.n_expert_used as u64;
                unit += l(t) / n_exp;
            }
            expert_unit_bytes.push(unit);
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
            expert_unit_bytes,
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
        if batch == 0 || self.n_expert == 0 || self.n_expert_used == 0 {
            return 0.0;
        }
        let d = self.uniform_distinct(batch);
        self.step_bytes(&vec![d; self.expert_unit_bytes.len()], batch)
    }

    /// The distinct experts `batch` tokens choose in one layer, on average, when each picks
    /// k distinct ones of E evenly: `E·(1 − (1 − k/E)^batch)`.
    pub fn uniform_distinct(&self, batch: usize) -> f64 {
        let (e, k) = (f64::from(self.n_expert), f64::from(self.n_expert_used));
        if e == 0.0 {
            return 0.0;
        }
        e * (1.0 - (1.0 - k / e).powi(batch.min(i32::MAX as usize) as i32))
    }

    /// Weight bytes of one batched decode step of `batch` sequences (short context) whose
    /// tokens chose `distinct[l]` distinct routed experts in layer `l` (a measured count,
    /// or [`Self::uniform_distinct`]): every weight but the routed experts and the
    /// embedding rows once for the step, one embedding row per sequence, and each distinct
    /// expert once (docs/gguf.md §7.3). A layer missing from `distinct` counts none. This is
    /// the step's bandwidth bound's numerator: nothing a batched step does can read less.
    pub fn step_bytes(&self, distinct: &[f64], batch: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let part = |name: &str| {
            self.per_token_parts
                .iter()
                .find(|p| p.0 == name)
                .map_or(0, |p| p.1) as f64
        };
        let (routed, embd) = (part("routed experts"), part("embedding row"));
        let once = self.per_token_short as f64 - routed - embd;
        let experts: f64 = self
            .expert_unit_bytes
            .iter()
            .zip(distinct)
            .map(|(&u, &d)| u as f64 * d)
            .sum();
        once + embd * batch as f64 + experts
    }

    /// The aggregate tokens per second a step of `batch` sequences reading `step_bytes`
    /// ([`Self::step_bytes`]) cannot exceed at `bandwidth` bytes per second (0 when either
    /// is not positive).
    pub fn bound_tok_s(step_bytes: f64, bandwidth: f64, batch: usize) -> f64 {
        if step_bytes <= 0.0 || bandwidth <= 0.0 {
            return 0.0;
        }
        batch as f64 * bandwidth / step_bytes
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two layers, 8 experts of which 2 per token; units of 100 and 200 bytes.
    fn acct() -> ByteAccounting {
        ByteAccounting {
            tensor_bytes: 0,
            by_type: Vec::new(),
            per_token_short: 1000,
            per_token_long: 1000,
            per_token_parts: vec![
                ("routed experts".into(), 600),
                ("shared expert".into(), 390),
                ("embedding row".into(), 10),
            ],
            n_expert: 8,
            n_expert_used: 2,
            expert_unit_bytes: vec![100, 200],
        }
    }

    #[test]
    fn a_steps_bytes_are_the_dense_weights_once_and_each_distinct_expert_once() {
        let a = acct();
        // One token, k experts per layer: exactly the per-token bytes.
        assert_eq!(a.step_bytes(&[2.0, 2.0], 1), 1000.0);
        assert_eq!(a.uniform_distinct(1), 2.0);
        assert_eq!(a.per_step_short(1), 1000.0);
        // Four tokens that share nothing in layer 0 and all of it in layer 1: the dense 390
        // once, four embedding rows, 8 units of 100 and 2 of 200.
        assert_eq!(a.step_bytes(&[8.0, 2.0], 4), 390.0 + 40.0 + 800.0 + 400.0);
        // The uniform router's expectation: 8·(1 − (3/4)^4) distinct per layer.
        let d = 8.0 * (1.0 - 0.75f64.powi(4));
        assert!((a.per_step_short(4) - (390.0 + 40.0 + d * 300.0)).abs() < 1e-9);
        // The bound: 4 tokens per step at 2830 bytes a step and 2830 kB/s.
        assert_eq!(ByteAccounting::bound_tok_s(2830.0, 2830e3, 4), 4000.0);
        assert_eq!(ByteAccounting::bound_tok_s(0.0, 1.0, 4), 0.0);
        assert_eq!(a.step_bytes(&[], 0), 0.0);
        assert_eq!(a.per_step_short(0), 0.0);
        // Layers without a count read no experts.
        assert_eq!(a.step_bytes(&[], 1), 400.0);
    }
}
