#!/usr/bin/env python3
"""Build tiny random DeepSeek V4 models with HF transformers and record reference outputs.

Why this exists: no real weights can be downloaded in this project, so the Rust engine is proven
correct against an independent implementation. HF transformers 5.23 ships `DeepseekV4ForCausalLM`;
run on CPU in float32 it is the oracle. This script writes, per tiny model,
`tests/fixtures/tiny-<name>/`:

* what `save_pretrained` writes (config.json, generation_config.json, model.safetensors in
  float32, transformers' own "original format" tensor naming, see docs/gguf.md §5.2 (c));
* `reference.safetensors`: token sequences and float32 logits of three execution modes
  (full prefill, token-by-token decode with HF's cache, chunked prefill), plus small debug dumps;
* `reference.json`: seeds, a config summary, token lists, top-k margins, SwiGLU clamp counts,
  HF's own self-consistency numbers and package versions.

Everything is seeded and runs single-threaded, so a rerun with the pinned versions reproduces the
files. See tools/oracle/README.md for the command and what each model covers.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import transformers
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"

# A top-k decision whose k-th and (k+1)-th scores are closer than this (relative to the largest
# |score| of that decision) could flip between two correct float32 implementations; such token
# sequences are redrawn (docs/forward.md §9.5).
MARGIN_THRESHOLD = 3e-5

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One tiny model. Field names follow ds4's GGUF metadata symbols (docs/gguf.md §3.2)."""

    name: str
    description: str
    seed: int
    vocab: int
    embd: int  # E, hidden size
    n_layer: int
    hca_ratio: int
    n_hash: int  # leading hash-routed MoE layers
    n_head: int  # H
    head_dim: int  # D (K = V)
    rope_dim: int  # last rope_dim dims of each head are roped
    q_lora: int  # Q
    o_groups: int  # G
    o_lora: int  # O (per group)
    n_expert: int  # N
    n_expert_used: int  # k
    expert_ffn: int  # F (routed and shared)
    window: int  # sliding window W
    idx_heads: int
    idx_dim: int
    idx_topk: int
    rope_theta: float
    compress_rope_theta: float
    yarn_factor: float
    yarn_orig_ctx: int
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    swiglu_limit: float = 10.0
    routed_scale: float = 1.5
    # Fraction of gate/up rows whose weights are multiplied by `clamp_boost`, so the SwiGLU clamp
    # (|pre-activation| > swiglu_limit) really fires; the matching down-projection columns are
    # divided by it to keep those channels from dominating the output.
    clamp_frac: float = 0.125
    clamp_boost: float = 6.0
    # FP8 block contrast (tiny-wide): per 32-dim slice of the non-RoPE KV dims, a factor on the
    # KV norm and attention-compressor norm weights; the matching output-projection (wo_a)
    # columns are divided by it, so every slice still matters for the logits. Empty: off.
    # Why: with power-of-two scales an E4M3 round trip depends on its block only through
    # values far below the block's max (subnormals), so on rows of uniform magnitude a wrong
    # FP8 block size is invisible; slices whose magnitudes differ by 2^13 make it visible.
    kv_slice_scale: tuple = ()
    # sequence name -> (length, chunk size used for chunked prefill)
    sequences: tuple = (("short", 7, 3), ("medium", 100, 37), ("long", 520, 37))
    debug_seq: str = "short"

    @property
    def layer_types(self) -> list[str]:
        # Flash schedule (docs/forward.md §1): 0,1 sliding, then CSA on even, HCA on odd layers.
        return [SLIDING if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(self.n_layer)]

    @property
    def ratios(self) -> list[int]:
        return [{SLIDING: 0, CSA: 4, HCA: self.hca_ratio}[t] for t in self.layer_types]

    def hf_config(self) -> DeepseekV4Config:
        cfg = DeepseekV4Config(
            vocab_size=self.vocab,
            hidden_size=self.embd,
            moe_intermediate_size=self.expert_ffn,
            num_hidden_layers=self.n_layer,
            num_attention_heads=self.n_head,
            num_key_value_heads=1,
            head_dim=self.head_dim,
            partial_rotary_factor=self.rope_dim / self.head_dim,
            q_lora_rank=self.q_lora,
            num_experts_per_tok=self.n_expert_used,
            n_routed_experts=self.n_expert,
            n_shared_experts=1,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=self.routed_scale,
            layer_types=self.layer_types,
            compress_rates={CSA: 4, HCA: self.hca_ratio},
            mlp_layer_types=["hash_moe"] * self.n_hash + ["moe"] * (self.n_layer - self.n_hash),
            sliding_window=self.window,
            o_groups=self.o_groups,
            o_lora_rank=self.o_lora,
            index_n_heads=self.idx_heads,
            index_head_dim=self.idx_dim,
            index_topk=self.idx_topk,
            rope_theta=self.rope_theta,
            compress_rope_theta=self.compress_rope_theta,
            rope_parameters={
                "rope_type": "yarn",
                "factor": self.yarn_factor,
                "original_max_position_embeddings": self.yarn_orig_ctx,
                "beta_fast": self.yarn_beta_fast,
                "beta_slow": self.yarn_beta_slow,
            },
            swiglu_limit=self.swiglu_limit,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
        return cfg

    def check(self) -> None:
        """Refuse specs that HF would build but that break the ds4 layout rules (docs/gguf.md §5.7)."""
        assert (self.n_head * self.head_dim) % self.o_groups == 0
        assert self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim
        assert self.idx_dim >= self.rope_dim and self.idx_dim % 2 == 0
        assert self.idx_heads >= 16, "fewer indexer heads make exact-zero score ties frequent"
        assert self.hca_ratio not in (0, 4)
        assert 0 < self.n_expert_used < self.n_expert
        # Q8_0 row widths: E, Q, H*D/G, G*O, F.
        for dim in (self.embd, self.q_lora, self.n_head * self.head_dim // self.o_groups,
                    self.o_groups * self.o_lora, self.expert_ffn):
            assert dim % 32 == 0, f"{self.name}: Q8_0 dim {dim} is not a multiple of 32"
        if self.kv_slice_scale:
            assert len(self.kv_slice_scale) * 32 == self.head_dim - self.rope_dim, \
                "kv_slice_scale needs one factor per 32 non-RoPE dims"
        long_len = max(length for _, length, _ in self.sequences)
        assert long_len // self.hca_ratio >= 4, "long sequence needs several HCA rows"
        assert long_len // 4 > self.idx_topk, "indexer top-k must be smaller than the CSA row count"

    @property
    def k_quant_ready(self) -> bool:
        return self.embd % 256 == 0 and self.expert_ffn % 256 == 0


MODELS = [
    ModelSpec(
        name="hca16",
        description="6 layers [S,S,CSA,HCA,CSA,HCA], HCA ratio 16 (32 HCA rows at 520 tokens), "
        "3 hash + 3 top-k MoE layers, window 16, real rope bases/YaRN (theta 1e4 / 1.6e5, factor 16, "
        "original context 65536) on a 16-dim rope slice: lo 3, hi 7.",
        seed=1001,
        vocab=320,
        embd=64,
        n_layer=6,
        hca_ratio=16,
        n_hash=3,
        n_head=4,
        head_dim=32,
        rope_dim=16,
        q_lora=32,
        o_groups=2,
        o_lora=16,
        n_expert=8,
        n_expert_used=2,
        expert_ffn=32,
        window=16,
        idx_heads=16,
        idx_dim=32,
        idx_topk=8,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn_factor=16.0,
        yarn_orig_ctx=65536,
    ),
    ModelSpec(
        name="hca128",
        description="8 layers [S,S,CSA,HCA,CSA,HCA,CSA,HCA], HCA ratio 128 (4 HCA rows at 520 tokens), "
        "3 hash + 5 top-k MoE layers (top-4 of 16), window 32, non-default rope (main theta 20000; "
        "compressed theta 1000 with YaRN factor 4, original context 64: lo 0, hi 6, so pair 0 is kept, "
        "pairs 1-5 are blended and pairs 6-15 are divided by 4).",
        seed=1002,
        vocab=384,
        embd=64,
        n_layer=8,
        hca_ratio=128,
        n_hash=3,
        n_head=8,
        head_dim=64,
        rope_dim=32,
        q_lora=64,
        o_groups=4,
        o_lora=32,
        n_expert=16,
        n_expert_used=4,
        expert_ffn=32,
        window=32,
        idx_heads=16,
        idx_dim=64,
        idx_topk=16,
        rope_theta=20000.0,
        compress_rope_theta=1000.0,
        yarn_factor=4.0,
        yarn_orig_ctx=64,
    ),
    ModelSpec(
        name="quant",
        description="4 layers [S,S,CSA,HCA], E = F = 256 so every q2/q4 recipe type applies "
        "(IQ2_XXS/Q2_K/Q4_K experts, Q8_0 dense), HCA ratio 128, 2 hash + 2 top-k MoE layers "
        "(top-2 of 4), window 24, real rope bases/YaRN.",
        seed=1003,
        vocab=256,
        embd=256,
        n_layer=4,
        hca_ratio=128,
        n_hash=2,
        n_head=4,
        head_dim=64,
        rope_dim=16,
        q_lora=64,
        o_groups=2,
        o_lora=32,
        n_expert=4,
        n_expert_used=2,
        expert_ffn=256,
        window=24,
        idx_heads=16,
        idx_dim=32,
        idx_topk=8,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn_factor=16.0,
        yarn_orig_ctx=65536,
    ),
]

# 2^-13: under a shared block scale a slice this much smaller than its neighbour is quantized
# with the subnormal step (a few grid points per standard deviation); under its own scale it
# keeps E4M3's 3 mantissa bits. Its block max (~5e-4) stays above the 1e-4 amax floor.
KV_SMALL = 2.0**-13

MODELS.append(
    ModelSpec(
        name="wide",
        description="4 layers [S,S,CSA,HCA], HCA ratio 16, 2 hash + 2 top-k MoE layers (top-2 of 4), "
        "window 16, real rope bases/YaRN; head_dim 160 with a 32-dim rope slice, so the FP8 round "
        "trip covers 128 non-RoPE dims (two blocks of 64). Its KV/compressor norm weights scale the "
        "four 32-dim slices by 1, 2^-13, 2^-13, 2^-13 (wo_a compensates): with blocks of 64 the "
        "second slice shares the first one's scale, with blocks of 128 the third and fourth do "
        "too, with blocks of 32 none does, so each block size gives different logits.",
        seed=1004,
        vocab=256,
        embd=64,
        n_layer=4,
        hca_ratio=16,
        n_hash=2,
        n_head=2,
        head_dim=160,
        rope_dim=32,
        q_lora=32,
        o_groups=2,
        o_lora=16,
        n_expert=4,
        n_expert_used=2,
        expert_ffn=32,
        window=16,
        idx_heads=16,
        idx_dim=32,
        idx_topk=8,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn_factor=16.0,
        yarn_orig_ctx=65536,
        kv_slice_scale=(1.0, KV_SMALL, KV_SMALL, KV_SMALL),
        sequences=(("short", 7, 3), ("medium", 100, 37), ("long", 260, 37)),
    )
)

# Initialisation scales (docs/forward.md §11 "All parameters randomized"), recorded in reference.json.
INIT = {
    "embed_tokens": "N(0, 1)",
    "linear weights (incl. lm_head, router, hc fn)": "N(0, 1/fan_in)",
    "rms norm weights": "1 + U(-0.2, 0.2)",
    "attention sinks": "N(0, 1)",
    "compressor/indexer position_bias (ape)": "N(0, 0.7^2)",
    "hc base (attn, ffn, head)": "N(0, 0.5^2)",
    "hc scale (attn, ffn, head)": "1 + U(-0.3, 0.3)",
    "e_score_correction_bias": "N(0, 0.1^2)",
    "tid2eid": "row t = first k entries of a random permutation of the N experts (distinct)",
    "routed and shared experts": "gate/up N(0, 1/E), down N(0, 1/F); per expert a random "
    "clamp_frac of the gate rows and (independently) of the up rows are multiplied by clamp_boost, "
    "and the down columns of the union of those channels divided by it",
}


def _normal(shape, std, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _uniform_pm(shape, half_width, gen):
    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2.0 - 1.0) * half_width


def _boost_rows(n_rows, spec, gen):
    count = max(1, int(round(n_rows * spec.clamp_frac)))
    return torch.randperm(n_rows, generator=gen)[:count]


@torch.no_grad()
def _init_swiglu(gate, up, down, spec, gen):
    """gate/up: [F, E], down: [E, F] views (written in place)."""
    f_dim, e_dim = gate.shape
    gate.copy_(_normal(gate.shape, e_dim**-0.5, gen))
    up.copy_(_normal(up.shape, e_dim**-0.5, gen))
    down.copy_(_normal(down.shape, f_dim**-0.5, gen))
    g_rows = _boost_rows(f_dim, spec, gen)
    u_rows = _boost_rows(f_dim, spec, gen)
    gate[g_rows] *= spec.clamp_boost
    up[u_rows] *= spec.clamp_boost
    channels = torch.unique(torch.cat([g_rows, u_rows]))
    down[:, channels] /= spec.clamp_boost


@torch.no_grad()
def init_weights(model: DeepseekV4ForCausalLM, spec: ModelSpec) -> None:
    """Seeded, non-degenerate init. HF's own init zeroes sinks, hc base, ape and the router bias,
    and leaves tid2eid all zeros, which would hide whole classes of engine bugs."""
    gen = torch.Generator().manual_seed(spec.seed)
    done: set[str] = set()
    cfg = model.config
    n_expert, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    f_dim = cfg.moe_intermediate_size

    for idx, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{idx}.mlp."
        experts = layer.mlp.experts
        for e in range(n_expert):
            _init_swiglu(experts.gate_up_proj[e, :f_dim], experts.gate_up_proj[e, f_dim:],
                         experts.down_proj[e], spec, gen)
        done |= {prefix + "experts.gate_up_proj", prefix + "experts.down_proj"}
        shared = layer.mlp.shared_experts
        _init_swiglu(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, spec, gen)
        done |= {prefix + f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}

    for name, p in model.named_parameters():
        if name in done:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name == "model.embed_tokens.weight":
            p.copy_(_normal(p.shape, 1.0, gen))
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + _uniform_pm(p.shape, 0.2, gen))
        elif leaf == "sinks":
            p.copy_(_normal(p.shape, 1.0, gen))
        elif leaf == "position_bias":
            p.copy_(_normal(p.shape, 0.7, gen))
        elif leaf in ("base", "hc_base"):
            p.copy_(_normal(p.shape, 0.5, gen))
        elif leaf in ("scale", "hc_scale"):
            p.copy_(1.0 + _uniform_pm(p.shape, 0.3, gen))
        elif p.dim() == 2:  # every Linear weight, hc fn, lm_head, router
            p.copy_(_normal(p.shape, p.shape[-1] ** -0.5, gen))
        else:
            raise RuntimeError(f"no init rule for parameter {name} {tuple(p.shape)}")
        done.add(name)

    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(_normal(b.shape, 0.1, gen))
        elif name.endswith("tid2eid"):
            rows = torch.stack([torch.randperm(n_expert, generator=gen)[:top_k] for _ in range(b.shape[0])])
            b.copy_(rows.to(b.dtype))
        elif "inv_freq" in name:
            continue  # derived from the config by HF itself
        else:
            raise RuntimeError(f"no init rule for buffer {name}")

    missing = [n for n, _ in model.named_parameters() if n not in done]
    if missing:
        raise RuntimeError(f"parameters left uninitialised: {missing}")
    if spec.kv_slice_scale:
        _apply_kv_slice_scale(model, spec)


@torch.no_grad()
def _apply_kv_slice_scale(model: DeepseekV4ForCausalLM, spec: ModelSpec) -> None:
    """Scales the non-RoPE KV dims slice by slice (spec.kv_slice_scale) in the raw KV norm and
    the attention compressor's norm, and divides the wo_a columns that read those dims of each
    head's attention output by the same factor (the attention output is a convex combination of
    KV rows, so its per-dim scale follows the rows')."""
    f = torch.ones(spec.head_dim)
    for i, k in enumerate(spec.kv_slice_scale):
        f[32 * i:32 * (i + 1)] = k
    heads_per_group = spec.n_head // spec.o_groups
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.kv_norm.weight.mul_(f)
        if getattr(attn, "compressor", None) is not None:
            attn.compressor.kv_norm.weight.mul_(f)
        attn.o_a_proj.weight.div_(f.repeat(heads_per_group))


class Recorder:
    """Forward hooks that capture what HF decides internally during a *prefill* run:
    router scores (for top-k margins), indexer scores, selected experts, SwiGLU pre-activations
    over the clamp limit, and (optionally) per-layer activations for the debug dump."""

    def __init__(self, model: DeepseekV4ForCausalLM, spec: ModelSpec):
        self.spec = spec
        self.enabled = False
        self.debug = False
        self.reset()
        limit = spec.swiglu_limit
        for idx, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            mlp.gate.register_forward_hook(self._router_hook(idx, mlp.is_hash))
            mlp.experts.register_forward_hook(self._experts_hook(idx, limit), with_kwargs=True)
            mlp.shared_experts.register_forward_hook(self._shared_hook(idx, limit))
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                comp.indexer.scorer.register_forward_hook(self._indexer_hook(idx))
            for key, mod in (("attn_in", layer.input_layernorm), ("attn_out", layer.self_attn),
                             ("ffn_in", layer.post_attention_layernorm), ("ffn_out", mlp),
                             ("out", layer)):
                mod.register_forward_hook(self._debug_hook(f"layer.{idx}.{key}"))
        model.model.hc_head.register_forward_hook(self._debug_hook("hc_head_out"))
        model.model.norm.register_forward_hook(self._debug_hook("final_norm_out"))

    def reset(self):
        self.router_scores: dict[int, torch.Tensor] = {}
        self.experts: dict[int, torch.Tensor] = {}
        self.index_scores: dict[int, torch.Tensor] = {}
        self.clamp: dict[int, dict[str, int]] = {}
        self.dump: dict[str, torch.Tensor] = {}

    def _router_hook(self, idx, is_hash):
        def hook(mod, args, out):
            if not self.enabled:
                return
            logits, _, indices = out
            self.experts[idx] = indices.detach().clone()
            if not is_hash:
                self.router_scores[idx] = (mod.score_fn(logits) + mod.e_score_correction_bias).detach().clone()
        return hook

    def _count(self, idx, prefix, gate, up, limit):
        c = self.clamp.setdefault(idx, {})
        c[prefix + "_gate_over"] = c.get(prefix + "_gate_over", 0) + int((gate > limit).sum())
        c[prefix + "_up_over"] = c.get(prefix + "_up_over", 0) + int((up.abs() > limit).sum())
        c[prefix + "_elems"] = c.get(prefix + "_elems", 0) + gate.numel()

    def _experts_hook(self, idx, limit):
        def hook(mod, args, kwargs, out):
            if not self.enabled:
                return
            hidden, top_k_index = args[0], args[1]
            f_dim = mod.intermediate_dim
            for e in range(mod.num_experts):
                tok = (top_k_index == e).any(dim=-1).nonzero().flatten()
                if tok.numel() == 0:
                    continue
                gate_up = F.linear(hidden[tok], mod.gate_up_proj[e])
                self._count(idx, "routed", gate_up[:, :f_dim], gate_up[:, f_dim:], limit)
        return hook

    def _shared_hook(self, idx, limit):
        def hook(mod, args, out):
            if not self.enabled:
                return
            x = args[0]
            self._count(idx, "shared", mod.gate_proj(x), mod.up_proj(x), limit)
        return hook

    def _indexer_hook(self, idx):
        def hook(mod, args, out):
            if self.enabled:
                self.index_scores[idx] = out[0].detach().clone()  # [S, rows]
        return hook

    def _debug_hook(self, key):
        def hook(mod, args, out):
            if self.enabled and self.debug:
                t = out[0] if isinstance(out, tuple) else out
                self.dump[key] = t[0].detach().float().contiguous().clone()
        return hook


def router_margins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per token: (k-th largest - (k+1)-th largest) / max |score|."""
    s = scores.sort(dim=-1, descending=True).values
    scale = scores.abs().max(dim=-1).values.clamp_min(1e-30)
    return (s[:, k - 1] - s[:, k]) / scale


def indexer_decisions(scores: torch.Tensor, ratio: int, topk: int):
    """Per query p: margin of the top-k cut among the n_p = (p+1)//ratio visible rows (inf where
    n_p <= topk, i.e. no selection), and the selected row set (ascending, -1 padded)."""
    seq = scores.shape[0]
    margins = torch.full((seq,), math.inf)
    selected = torch.full((seq, topk), -1, dtype=torch.int32)
    for p in range(seq):
        n_p = (p + 1) // ratio
        if n_p == 0:
            continue
        if n_p <= topk:
            selected[p, :n_p] = torch.arange(n_p, dtype=torch.int32)
            continue
        s = scores[p, :n_p]
        order = s.sort(descending=True)
        margins[p] = (order.values[topk - 1] - order.values[topk]) / s.abs().max().clamp_min(1e-30)
        selected[p] = order.indices[:topk].sort().values.to(torch.int32)
    return margins, selected


@torch.no_grad()
def prefill(model, tokens: np.ndarray) -> torch.Tensor:
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    return model(input_ids=ids, use_cache=False).logits[0].float()


@torch.no_grad()
def chunked(model, tokens: np.ndarray, chunk: int) -> torch.Tensor:
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    cache = DynamicCache(config=model.config)
    outs = []
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True)
        outs.append(out.logits[0].float())
    return torch.cat(outs, dim=0)


def analyse(rec: Recorder, spec: ModelSpec, seq_len: int):
    """Margins per layer and the per-position minimum over all layers."""
    pos_min = torch.full((seq_len,), math.inf)
    per_layer = {}
    selections = {}
    for idx, scores in sorted(rec.router_scores.items()):
        m = router_margins(scores.float(), spec.n_expert_used)
        pos_min = torch.minimum(pos_min, m)
        per_layer.setdefault(idx, {})["router"] = {"min": float(m.min()), "decisions": int(m.numel())}
    for idx, scores in sorted(rec.index_scores.items()):
        m, sel = indexer_decisions(scores.float(), 4, spec.idx_topk)
        selections[idx] = sel
        pos_min = torch.minimum(pos_min, m)
        finite = m[torch.isfinite(m)]
        per_layer.setdefault(idx, {})["indexer"] = {
            "min": float(finite.min()) if finite.numel() else None,
            "decisions": int(finite.numel()),
        }
    return pos_min, per_layer, selections


def draw_tokens(model, rec, spec, seq_name, length, token_seed, log):
    """Draw uniform random tokens; while some top-k decision has a relative margin below the
    threshold, redraw the tokens from the first offending position on (causality: decisions at
    position p depend only on tokens <= p, so earlier decisions are untouched)."""
    rng = np.random.default_rng(token_seed)
    tokens = rng.integers(0, spec.vocab, size=length, dtype=np.int64)
    redrawn_at = []
    for _ in range(500):
        rec.reset()
        rec.enabled = True
        prefill(model, tokens)
        rec.enabled = False
        pos_min, _, _ = analyse(rec, spec, length)
        bad = torch.nonzero(pos_min < MARGIN_THRESHOLD).flatten()
        if bad.numel() == 0:
            if redrawn_at:
                log(f"    {seq_name}: redrew from positions {redrawn_at}")
            return tokens, redrawn_at
        p = int(bad[0])
        redrawn_at.append(p)
        tokens[p:] = rng.integers(0, spec.vocab, size=length - p, dtype=np.int64)
    raise RuntimeError(f"{spec.name}/{seq_name}: could not find tokens with top-k margins >= {MARGIN_THRESHOLD}")


@torch.no_grad()
def sensitivity(model, tokens: np.ndarray, base: torch.Tensor) -> dict:
    """How much the logits move when a feature is switched off: shows that the fixture really
    exercises it (an engine that skips the clamp or the indexer selection must fail)."""
    out = {}
    saved = []
    for layer in model.model.layers:
        for mod in (layer.mlp.experts, layer.mlp.shared_experts):
            saved.append((mod, mod.limit))
            mod.limit = math.inf
    out["no_swiglu_clamp"] = float((prefill(model, tokens) - base).abs().max())
    for mod, limit in saved:
        mod.limit = limit
    saved = []
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            saved.append((comp.indexer, comp.indexer.index_topk))
            comp.indexer.index_topk = 1 << 30
    out["indexer_selects_all_visible_rows"] = float((prefill(model, tokens) - base).abs().max())
    for mod, topk in saved:
        mod.index_topk = topk
    return out


def config_summary(spec: ModelSpec) -> dict:
    return {
        "vocab_size": spec.vocab,
        "embedding_length": spec.embd,
        "block_count": spec.n_layer,
        "layer_types": spec.layer_types,
        "compress_ratios": spec.ratios,
        "hash_layer_count": spec.n_hash,
        "head_count": spec.n_head,
        "head_count_kv": 1,
        "key_length": spec.head_dim,
        "rope_dimension_count": spec.rope_dim,
        "q_lora_rank": spec.q_lora,
        "output_group_count": spec.o_groups,
        "output_lora_rank": spec.o_lora,
        "expert_count": spec.n_expert,
        "expert_used_count": spec.n_expert_used,
        "expert_shared_count": 1,
        "expert_feed_forward_length": spec.expert_ffn,
        "expert_weights_scale": spec.routed_scale,
        "expert_gating_func": "sqrtsoftplus",
        "swiglu_limit": spec.swiglu_limit,
        "sliding_window": spec.window,
        "indexer_head_count": spec.idx_heads,
        "indexer_key_length": spec.idx_dim,
        "indexer_top_k": spec.idx_topk,
        "rope_freq_base": spec.rope_theta,
        "compress_rope_freq_base": spec.compress_rope_theta,
        "rope_scaling": {
            "type": "yarn",
            "factor": spec.yarn_factor,
            "original_context_length": spec.yarn_orig_ctx,
            "beta_fast": spec.yarn_beta_fast,
            "beta_slow": spec.yarn_beta_slow,
            "attention_factor": 1.0,
        },
        "hyper_connection_count": 4,
        "sinkhorn_iterations": 20,
        "hyper_connection_epsilon": 1e-6,
        "rms_norm_epsilon": 1e-6,
        "q8_0_dims_ok": True,
        "k_quant_dims_ok": spec.k_quant_ready,
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_fixture(spec: ModelSpec, out_root: Path, log) -> dict:
    spec.check()
    t0 = time.time()
    cfg = spec.hf_config()
    torch.manual_seed(spec.seed)  # HF's own init runs first; everything is overwritten below
    model = DeepseekV4ForCausalLM(cfg).eval()
    init_weights(model, spec)
    rec = Recorder(model, spec)

    ref: dict[str, torch.Tensor] = {
        "rope.main_inv_freq": model.model.rotary_emb.main_inv_freq.float().clone(),
        "rope.compress_inv_freq": model.model.rotary_emb.compress_inv_freq.float().clone(),
    }
    meta_seqs, meta_margins, meta_clamp, meta_consistency = {}, {}, {}, {}
    total_clamp = {"routed_gate_over": 0, "routed_up_over": 0, "shared_gate_over": 0, "shared_up_over": 0}

    for s_idx, (seq_name, length, chunk) in enumerate(spec.sequences):
        token_seed = spec.seed * 100 + s_idx
        tokens, redrawn = draw_tokens(model, rec, spec, seq_name, length, token_seed, log)

        # Reference prefill with all hooks on (debug dump only for the debug sequence).
        rec.reset()
        rec.enabled = True
        rec.debug = seq_name == spec.debug_seq
        logits_prefill = prefill(model, tokens)
        rec.enabled = rec.debug = False
        _, per_layer, selections = analyse(rec, spec, length)

        t1 = time.time()
        logits_decode = chunked(model, tokens, 1)
        t_decode = time.time() - t1
        logits_chunked = chunked(model, tokens, chunk)

        ref[f"tokens.{seq_name}"] = torch.from_numpy(tokens.astype(np.int32))
        ref[f"prefill.{seq_name}.logits"] = logits_prefill.contiguous()
        ref[f"decode.{seq_name}.logits"] = logits_decode.contiguous()
        ref[f"chunked.{seq_name}.logits"] = logits_chunked.contiguous()
        for idx, ids in sorted(rec.experts.items()):
            ref[f"debug.{seq_name}.layer.{idx}.experts"] = ids.sort(dim=-1).values.to(torch.int32).contiguous()
        for idx, sel in sorted(selections.items()):
            ref[f"debug.{seq_name}.layer.{idx}.indexer_topk"] = sel.contiguous()
        for key, t in sorted(rec.dump.items()):
            ref[f"debug.{seq_name}.{key}"] = t

        d_dec = float((logits_prefill - logits_decode).abs().max())
        d_chk = float((logits_prefill - logits_chunked).abs().max())
        if max(d_dec, d_chk) > 1e-3:
            raise RuntimeError(f"{spec.name}/{seq_name}: HF prefill vs decode/chunked differ by {d_dec}/{d_chk}")
        meta_consistency[seq_name] = {
            "max_abs_prefill_minus_decode": d_dec,
            "max_abs_prefill_minus_chunked": d_chk,
            "max_abs_logit": float(logits_prefill.abs().max()),
            "argmax_agreement_decode": float((logits_prefill.argmax(-1) == logits_decode.argmax(-1)).float().mean()),
        }
        rows = {str(i): length // r for i, r in enumerate(spec.ratios) if r}
        sel_from = [int(torch.nonzero(torch.isfinite(indexer_decisions(s.float(), 4, spec.idx_topk)[0]))[0])
                    for s in rec.index_scores.values() if (length // 4) > spec.idx_topk]
        meta_seqs[seq_name] = {
            "length": length,
            "token_seed": token_seed,
            "chunk_size": chunk,
            "redrawn_from_positions": redrawn,
            "compressed_rows_per_layer": rows,
            "indexer_selection_first_position": sel_from[0] if sel_from else None,
            "tokens": [int(t) for t in tokens],
        }
        meta_margins[seq_name] = {str(k): v for k, v in sorted(per_layer.items())}
        meta_clamp[seq_name] = {str(k): v for k, v in sorted(rec.clamp.items())}
        for v in rec.clamp.values():
            for key in total_clamp:
                total_clamp[key] += v[key]
        log(f"    {seq_name:6s} T={length:3d}: |prefill-decode| {d_dec:.2e}  |prefill-chunked| {d_chk:.2e}  "
            f"decode {t_decode:.1f}s")

    long_name = spec.sequences[-1][0]
    sens = sensitivity(model, ref[f"tokens.{long_name}"].numpy(), ref[f"prefill.{long_name}.logits"])
    if min(sens.values()) < 1e-2:
        raise RuntimeError(f"{spec.name}: a feature barely changes the logits: {sens}")
    log(f"    max |delta logit| ({long_name}) without clamp {sens['no_swiglu_clamp']:.3f}, "
        f"indexer selecting all rows {sens['indexer_selects_all_visible_rows']:.3f}")

    if min(total_clamp.values()) == 0:
        raise RuntimeError(f"{spec.name}: the SwiGLU clamp did not fire in every category: {total_clamp}")

    fixture_dir = out_root / f"tiny-{spec.name}"
    if fixture_dir.exists():
        shutil.rmtree(fixture_dir)
    model.save_pretrained(fixture_dir)
    save_file(ref, str(fixture_dir / "reference.safetensors"), metadata={"format": "pt"})

    # The saved checkpoint must reproduce the references exactly (catches buffers that are not
    # persisted, e.g. tid2eid or the router bias).
    reloaded = DeepseekV4ForCausalLM.from_pretrained(fixture_dir, dtype=torch.float32)
    reloaded.config._attn_implementation = "eager"
    reloaded.config._experts_implementation = "eager"
    reloaded.eval()
    reload_diff = 0.0
    for seq_name, _, _ in spec.sequences:
        tokens = ref[f"tokens.{seq_name}"].numpy()
        reload_diff = max(reload_diff, float((prefill(reloaded, tokens) - ref[f"prefill.{seq_name}.logits"]).abs().max()))
    if reload_diff != 0.0:
        raise RuntimeError(f"{spec.name}: reloaded checkpoint differs from the in-memory model by {reload_diff}")

    n_params = sum(p.numel() for p in model.parameters())
    files = {}
    for path in sorted(fixture_dir.iterdir()):
        files[path.name] = {"bytes": path.stat().st_size}
        if path.suffix == ".safetensors":
            files[path.name]["sha256"] = sha256(path)
    meta = {
        "name": f"tiny-{spec.name}",
        "description": spec.description,
        "generator": "tools/oracle/make_fixtures.py",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": importlib.metadata.version("safetensors"),
            "numpy": np.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
        "execution": "CPU, float32, torch.set_num_threads(1), attn_implementation=eager, experts_implementation=eager",
        "weight_seed": spec.seed,
        "init": INIT,
        "clamp_frac": spec.clamp_frac,
        "clamp_boost": spec.clamp_boost,
        **({"kv_slice_scale": {
            "factors": list(spec.kv_slice_scale),
            "rule": "per 32-dim slice of the non-RoPE dims: KV norm and attention-compressor norm "
                    "weights times the factor, the wo_a columns reading those dims divided by it",
        }} if spec.kv_slice_scale else {}),
        "parameter_count": n_params,
        "config": config_summary(spec),
        "sequences": meta_seqs,
        "modes": {
            "prefill": "one forward over the whole sequence, use_cache=False",
            "decode": "one token per forward with a DynamicCache (HF's cached path)",
            "chunked": "chunk_size tokens per forward with a DynamicCache",
        },
        "margin_threshold": MARGIN_THRESHOLD,
        "margin_definition": "per top-k decision: (k-th largest score - (k+1)-th largest) / max |score| of that "
        "decision. Router: scores = sqrtsoftplus(logits) + e_score_correction_bias over all experts, k = "
        "expert_used_count (top-k layers only; hash layers do not choose). Indexer: scores of the "
        "(p+1)//4 visible rows, k = indexer_top_k, only where more than k rows are visible. Measured "
        "in the prefill run; min per layer recorded",
        "margins": meta_margins,
        "clamp_fire_counts": meta_clamp,
        "clamp_fire_totals": total_clamp,
        "hf_self_consistency": meta_consistency,
        "sensitivity": {
            "sequence": long_name,
            "definition": "max |logit - reference| over the prefill of this sequence when the SwiGLU clamp is "
            "removed, or when the indexer keeps every visible row instead of its top-k",
            **sens,
        },
        "reload_max_abs_diff": reload_diff,
        "reference_tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                              for k, v in sorted(ref.items())},
        "files": files,
    }
    with open(fixture_dir / "reference.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    total = sum(p.stat().st_size for p in fixture_dir.iterdir())
    log(f"  tiny-{spec.name}: {n_params} params, {total / 1e6:.2f} MB, {time.time() - t0:.1f}s")
    return {"name": spec.name, "bytes": total, "seconds": time.time() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default: tests/fixtures)")
    ap.add_argument("--only", action="append", help="build only this model (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the model specs and parameter counts")
    ap.add_argument("--check", action="store_true",
                    help="build into a temporary directory and compare byte-for-byte with --out (exit 1 on a difference)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # determinism (and speed on a shared 2-core box)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    specs = [s for s in MODELS if not args.only or s.name in args.only]
    if args.only and len(specs) != len(args.only):
        print(f"unknown model in {args.only}; known: {[s.name for s in MODELS]}", file=sys.stderr)
        return 2
    if args.list:
        for s in specs:
            s.check()
            with torch.device("meta"):
                n = sum(p.numel() for p in DeepseekV4ForCausalLM(s.hf_config()).parameters())
            print(f"tiny-{s.name}: {n} params ({n * 4 / 1e6:.1f} MB f32); {s.description}")
        return 0

    def log(msg):
        print(msg, flush=True)

    t0 = time.time()
    if args.check:
        import filecmp
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for s in specs:
                build_fixture(s, Path(tmp), log)
            bad = []
            for s in specs:
                new, old = Path(tmp) / f"tiny-{s.name}", args.out / f"tiny-{s.name}"
                # Only what this script writes: official.* and quant_exact.* come from
                # make_official.py / make_quant_exact.py and would always "differ".
                names = sorted(p.name for p in new.iterdir())
                for name in names:
                    if not ((new / name).is_file() and (old / name).is_file() and filecmp.cmp(new / name, old / name, shallow=False)):
                        bad.append(f"tiny-{s.name}/{name}")
        log(f"check: {'differs: ' + ', '.join(bad) if bad else 'identical'} ({time.time() - t0:.1f}s)")
        return 1 if bad else 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = [build_fixture(s, args.out, log) for s in specs]
    total = sum(r["bytes"] for r in results)
    log(f"done: {len(results)} fixtures, {total / 1e6:.2f} MB, {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
