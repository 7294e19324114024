#!/usr/bin/env python3
"""Official-mode reference for the tiny fixtures: DeepSeek V4's forward with its QAT simulations.

Why this exists: `official` mode (the FP8/FP4 round trips the checkpoint was trained with) is what
every user of the real weights runs, but HF transformers computes exact math only. This module is
an independent NumPy float64 implementation of DeepSeek's reference forward (`inference/model.py`
+ `kernel.py` of the V4 release, read for its semantics; see tools/oracle/README.md, "Official
mode") with a switch for the simulations:

* `qat=False` is exact math. It is checked against the committed HF logits (`make_official.py`
  refuses to write anything if the difference exceeds 1e-5), so the only thing left between the
  two modes is the simulation itself.
* `qat=True` adds the FP8-E4M3 round trip of the non-RoPE KV dims (raw and compressed attention
  rows) and Hadamard + FP4-E2M1 of the indexer queries and indexer rows.

The forward is written chunk-wise over a cache (raw KV rows, compressor projections, finished
compressed rows), so a whole-sequence prefill, a token-by-token decode and a chunked prefill are
three genuinely different executions of the same math. Only NumPy is needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

F32 = np.float32


# ---------------------------------------------------------------------------------------------
# QAT simulations (the reference kernels' semantics, written from their description)
# ---------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def pow2_ceil_f32(t: np.ndarray) -> np.ndarray:
    """2^ceil(log2 t) of f32 values, taken from the f32 bits like the reference's scale rounding
    (exponent field, plus one when any mantissa bit is set). Normal positive inputs only."""
    t = np.asarray(t, dtype=F32)
    bits = t.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int64) - 127
    exp += ((bits & 0x7FFFFF) != 0).astype(np.int64)
    return np.ldexp(1.0, exp).astype(np.float64)


def block_scale(amax: np.ndarray, floor: float, qmax: float) -> np.ndarray:
    """Power-of-two block scale: amax is floored, then multiplied in f32 by the f32 constant
    1/qmax, then rounded up to a power of two."""
    a = np.maximum(np.asarray(amax, dtype=np.float64), floor).astype(F32)
    return pow2_ceil_f32(a * F32(1.0 / qmax))


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest E4M3-FN value (|x| <= 448), ties to the even mantissa; subnormal step 2^-9."""
    a = np.abs(x)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    step = np.where(a < 2.0**-6, 2.0**-9, np.ldexp(1.0, e - 1 - 3))
    r = np.round(a / step) * step  # np.round is round-half-even
    return np.copysign(np.minimum(r, E4M3_MAX), x)


def round_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 value of {0, .5, 1, 1.5, 2, 3, 4, 6} (|x| <= 6), ties to the even code.
    Within each binade the grid is uniform, so half-even rounding of x/step gives the even code."""
    a = np.abs(x)
    step = np.where(a < 2.0, 0.5, np.where(a < 4.0, 1.0, 2.0))
    r = np.round(a / step) * step
    return np.copysign(np.minimum(r, E2M1_MAX), x)


def fp8_roundtrip(v: np.ndarray, block: int = 64) -> np.ndarray:
    """Quantize-dequantize along the last axis in blocks of `block` (a shorter last block when the
    width is not a multiple: the tiny fixtures need it, the real model never does)."""
    out = np.empty_like(v, dtype=np.float64)
    n = v.shape[-1]
    for b0 in range(0, n, block):
        blk = v[..., b0:b0 + block].astype(np.float64)
        s = block_scale(np.abs(blk).max(axis=-1, keepdims=True), 1e-4, E4M3_MAX)
        out[..., b0:b0 + block] = round_e4m3(np.clip(blk / s, -E4M3_MAX, E4M3_MAX)) * s
    return out


def fp4_roundtrip(v: np.ndarray, block: int = 32) -> np.ndarray:
    out = np.empty_like(v, dtype=np.float64)
    n = v.shape[-1]
    for b0 in range(0, n, block):
        blk = v[..., b0:b0 + block].astype(np.float64)
        s = block_scale(np.abs(blk).max(axis=-1, keepdims=True), 6.0 * 2.0**-126, E2M1_MAX)
        out[..., b0:b0 + block] = round_e2m1(np.clip(blk / s, -E2M1_MAX, E2M1_MAX)) * s
    return out


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester (natural order) Walsh-Hadamard matrix scaled by 1/sqrt(n); symmetric."""
    if n & (n - 1) or n == 0:
        raise ValueError(f"Hadamard width {n} is not a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    vocab: int
    embd: int
    n_layer: int
    ratios: list[int]
    n_hash: int
    n_head: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    n_expert: int
    k: int
    routed_scale: float
    swiglu_limit: float
    window: int
    idx_heads: int
    idx_dim: int
    idx_topk: int
    rope_theta: float
    compress_theta: float
    yarn_factor: float
    yarn_orig: int
    beta_fast: float
    beta_slow: float
    hc: int
    sinkhorn_iters: int
    hc_eps: float
    eps: float

    @staticmethod
    def from_hf(cfg: dict) -> "Config":
        rates = cfg["compress_rates"]
        ratios = [0 if t == "sliding_attention" else rates[t] for t in cfg["layer_types"]]
        comp = cfg["rope_parameters"]["compress"]
        head_dim = cfg["head_dim"]
        return Config(
            vocab=cfg["vocab_size"], embd=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"],
            ratios=ratios, n_hash=sum(t == "hash_moe" for t in cfg["mlp_layer_types"]),
            n_head=cfg["num_attention_heads"], head_dim=head_dim,
            rope_dim=int(round(head_dim * cfg["partial_rotary_factor"])),
            q_lora=cfg["q_lora_rank"], o_groups=cfg["o_groups"], o_lora=cfg["o_lora_rank"],
            n_expert=cfg["n_routed_experts"], k=cfg["num_experts_per_tok"],
            routed_scale=cfg["routed_scaling_factor"], swiglu_limit=cfg["swiglu_limit"],
            window=cfg["sliding_window"], idx_heads=cfg["index_n_heads"],
            idx_dim=cfg["index_head_dim"], idx_topk=cfg["index_topk"],
            rope_theta=cfg["rope_parameters"]["main"]["rope_theta"],
            compress_theta=comp["rope_theta"], yarn_factor=comp["factor"],
            yarn_orig=comp["original_max_position_embeddings"], beta_fast=comp["beta_fast"],
            beta_slow=comp["beta_slow"], hc=cfg["hc_mult"], sinkhorn_iters=cfg["hc_sinkhorn_iters"],
            hc_eps=cfg["hc_eps"], eps=cfg["rms_norm_eps"],
        )


def rope_freqs(dim: int, base: float, yarn: tuple | None) -> np.ndarray:
    """Per-pair frequencies as the reference builds them: f32 arithmetic throughout
    (base ** (2j/dim) in f32, YaRN's linear ramp blend in f32), so the table matches its bits."""
    j2 = np.arange(0, dim, 2, dtype=F32)
    freqs = (F32(1.0) / (F32(base) ** (j2 / F32(dim)))).astype(F32)
    if yarn is not None:
        factor, orig, beta_fast, beta_slow = yarn

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr(beta_fast)), 0)
        hi = min(math.ceil(corr(beta_slow)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(lo)) / F32(hi - lo), 0, 1).astype(F32)
        smooth = F32(1) - ramp
        freqs = (freqs / F32(factor) * (F32(1) - smooth) + freqs * smooth).astype(F32)
    return freqs


def rope(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Interleaved-pair rotation of the last 2*len(freqs) dims of x[..., D] at positions pos
    (broadcast over the leading axis of x). The angle is the f32 product position * frequency,
    as the reference forms it; cos/sin are taken in f64."""
    r = 2 * len(freqs)
    out = x.astype(np.float64, copy=True)
    ang = (np.asarray(pos, dtype=F32)[:, None] * freqs[None, :]).astype(np.float64)  # [T, r/2]
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (r // 2,)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    if inverse:
        s = -s
    a, b = out[..., -r::2].copy(), out[..., -r + 1::2].copy()
    out[..., -r::2] = a * c - b * s
    out[..., -r + 1::2] = a * s + b * c
    return out


def rms(x: np.ndarray, g: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if g is None else y * g


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def topk_lowest_index(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores; on exact ties the lower index wins (docs/forward.md §2.6)."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    return np.sort(order[:k])


def decision_margin(scores: np.ndarray, k: int) -> float:
    """(k-th largest - (k+1)-th largest) / max|score|, the oracle's near-tie measure."""
    s = np.sort(scores)[::-1]
    return float((s[k - 1] - s[k]) / max(np.abs(s).max(), 1e-30))


@dataclass
class LayerCache:
    kv: list = field(default_factory=list)  # raw rows (after QAT), one per position
    cu: list = field(default_factory=list)  # attention compressor projections u, z (+ape)
    cz: list = field(default_factory=list)
    crows: list = field(default_factory=list)  # finished compressed attention rows
    iu: list = field(default_factory=list)  # indexer compressor projections
    iz: list = field(default_factory=list)
    irows: list = field(default_factory=list)  # finished indexer rows


class Reference:
    """DeepSeek V4 forward over HF-named float weights (`model.safetensors` of a fixture, or the
    dequantized tensors of a q2/q4 GGUF mapped back to those names)."""

    def __init__(self, cfg: Config, weights: dict[str, np.ndarray], qat: bool):
        self.c = cfg
        self.w = {k: (v if v.dtype.kind == "i" else v.astype(np.float64)) for k, v in weights.items()}
        # The two simulations can be switched separately (sensitivity runs); `qat` sets both.
        self.qat_fp8 = self.qat_fp4 = qat
        # FP8 block size: 64 is the reference's (`act_quant(kv[..., :-rd], 64, ...)`); other
        # values only serve make_official.py's check that a fixture tells block sizes apart.
        self.fp8_block = 64
        rd = cfg.rope_dim
        self.freq_main = rope_freqs(rd, cfg.rope_theta, None)
        self.freq_comp = rope_freqs(rd, cfg.compress_theta,
                                    (cfg.yarn_factor, cfg.yarn_orig, cfg.beta_fast, cfg.beta_slow))
        if any(r == 4 for r in cfg.ratios):
            self.had = hadamard_matrix(cfg.idx_dim)
        self.reset()

    def reset(self):
        self.pos = 0
        self.tokens: list[int] = []
        self.cache = [LayerCache() for _ in range(self.c.n_layer)]
        self.margins: list[dict] = []  # per processed position: {"router": m, "indexer": m}

    # -- mHC ----------------------------------------------------------------------------------
    def hc_pre(self, x, fn, scale, base):
        c, n = self.c, self.c.hc
        flat = x.reshape(x.shape[0], -1)
        mix = (flat @ fn.T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + c.eps)
        pre = sigmoid(mix[:, :n] * scale[0] + base[:n]) + c.hc_eps
        post = 2.0 * sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        z = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True) + c.hc_eps
        p = p / (p.sum(axis=-2, keepdims=True) + c.hc_eps)
        for _ in range(c.sinkhorn_iters - 1):
            p = p / (p.sum(axis=-1, keepdims=True) + c.hc_eps)
            p = p / (p.sum(axis=-2, keepdims=True) + c.hc_eps)
        y = np.einsum("ti,tid->td", pre, x)
        return y, post, p

    @staticmethod
    def hc_post(f, x, post, comb):
        # new stream j = post_j * f + sum_i comb[i][j] * x_i
        return post[:, :, None] * f[:, None, :] + np.einsum("tij,tid->tjd", comb, x)

    # -- compressor ----------------------------------------------------------------------------
    def _compress_rows(self, us, zs, ratio, width, w_from, w_to, pre):
        """Finished rows w_from..w_to-1 from the cached per-token projections (docs/forward.md §5.3)."""
        c = self.c
        rows = []
        for w in range(w_from, w_to):
            cur = slice(w * ratio, (w + 1) * ratio)
            u_cur, z_cur = np.array(us[cur]), np.array(zs[cur])
            if ratio == 4:  # overlap: previous window's first half, this window's second half
                u_c, z_c = u_cur[:, width:], z_cur[:, width:]
                if w > 0:
                    prev = slice((w - 1) * ratio, w * ratio)
                    u_c = np.concatenate([np.array(us[prev])[:, :width], u_c])
                    z_c = np.concatenate([np.array(zs[prev])[:, :width], z_c])
            else:
                u_c, z_c = u_cur, z_cur
            a = np.exp(z_c - z_c.max(axis=0, keepdims=True))
            rows.append((u_c * a).sum(axis=0) / a.sum(axis=0))
        rows = rms(np.array(rows), self.w[pre + "norm.weight"], c.eps)
        rows = rope(rows, np.arange(w_from, w_to) * ratio, self.freq_comp)
        return rows

    def _compressor(self, a, pos, ratio, width, pre, us, zs, out_rows, finish):
        w = self.w
        u = a @ w[pre + "wkv.weight"].T
        z = a @ w[pre + "wgate.weight"].T + w[pre + "ape"][pos % ratio]
        us.extend(u)
        zs.extend(z)
        w_from, w_to = len(out_rows), (pos[-1] + 1) // ratio
        if w_to > w_from:
            out_rows.extend(finish(self._compress_rows(us, zs, ratio, width, w_from, w_to, pre)))

    # -- one chunk -----------------------------------------------------------------------------
    def forward(self, toks: list[int], x_in: np.ndarray | None = None) -> np.ndarray:
        """Processes toks at positions pos..pos+T-1 and returns their logits [T, V]. `x_in`
        ([T, hc, E]) replaces the embedded streams (the MTP block, `make_mtp.py`); the final
        streams, before the head, are left in `self.streams`."""
        c, w = self.c, self.w
        t = len(toks)
        pos = np.arange(self.pos, self.pos + t)
        self.tokens.extend(toks)
        ids = np.asarray(toks)
        nh, hd, rd = c.n_head, c.head_dim, c.rope_dim
        nope = hd - rd
        if x_in is None:
            x = np.repeat(w["model.embed_tokens.weight"][ids][:, None, :], c.hc, axis=1)
        else:
            x = np.asarray(x_in, dtype=np.float64)
        margins = [{"router": math.inf, "indexer": math.inf} for _ in range(t)]
        qat8 = (lambda v: np.concatenate([fp8_roundtrip(v[..., :nope], self.fp8_block), v[..., nope:]], axis=-1)) \
            if self.qat_fp8 else (lambda v: v)
        qat4 = (lambda v: fp4_roundtrip(v @ self.had)) if self.qat_fp4 else (lambda v: v)

        for il in range(c.n_layer):
            L = f"model.layers.{il}."
            A = L + "attn."
            ratio = c.ratios[il]
            freq = self.freq_main if ratio == 0 else self.freq_comp
            lc = self.cache[il]

            y, post, comb = self.hc_pre(x, w[L + "hc_attn_fn"], w[L + "hc_attn_scale"], w[L + "hc_attn_base"])
            a = rms(y, w[L + "attn_norm.weight"], c.eps)
            cq = rms(a @ w[A + "wq_a.weight"].T, w[A + "q_norm.weight"], c.eps)
            q = rms((cq @ w[A + "wq_b.weight"].T).reshape(t, nh, hd), None, c.eps)
            q = rope(q, pos, freq)
            kv = rms(a @ w[A + "wkv.weight"].T, w[A + "norm.weight"], c.eps)
            kv = qat8(rope(kv, pos, freq))
            lc.kv.extend(kv)

            sel = [None] * t  # per query: the compressed rows it attends to
            if ratio:
                self._compressor(a, pos, ratio, hd, A + "compressor.", lc.cu, lc.cz, lc.crows, qat8)
            if ratio == 4:
                I = A + "indexer."
                self._compressor(a, pos, 4, c.idx_dim, I + "compressor.", lc.iu, lc.iz, lc.irows, qat4)
                iq = (cq @ w[I + "wq_b.weight"].T).reshape(t, c.idx_heads, c.idx_dim)
                iq = qat4(rope(iq, pos, freq))
                iw = (a @ w[I + "weights_proj.weight"].T) * (c.idx_dim ** -0.5 * c.idx_heads ** -0.5)
                irows = np.array(lc.irows) if lc.irows else np.zeros((0, c.idx_dim))
                for i, p in enumerate(pos):
                    n_vis = (p + 1) // 4
                    if n_vis <= c.idx_topk:
                        sel[i] = np.arange(n_vis)
                        continue
                    dots = np.maximum(iq[i] @ irows[:n_vis].T, 0.0)  # [heads, rows]
                    score = iw[i] @ dots
                    sel[i] = topk_lowest_index(score, c.idx_topk)
                    margins[i]["indexer"] = min(margins[i]["indexer"], decision_margin(score, c.idx_topk))
            elif ratio:
                for i, p in enumerate(pos):
                    sel[i] = np.arange((p + 1) // ratio)

            kv_all = np.array(lc.kv)
            crows = np.array(lc.crows) if lc.crows else np.zeros((0, hd))
            o = np.empty((t, nh, hd))
            scale = hd ** -0.5
            sinks = w[A + "attn_sink"]
            for i, p in enumerate(pos):
                keys = kv_all[max(0, p - c.window + 1):p + 1]
                if sel[i] is not None and len(sel[i]):
                    keys = np.concatenate([keys, crows[sel[i]]])
                lg = (q[i] @ keys.T) * scale  # [heads, keys]
                m = np.maximum(lg.max(axis=-1), sinks)
                e = np.exp(lg - m[:, None])
                den = e.sum(axis=-1) + np.exp(sinks - m)
                o[i] = (e / den[:, None]) @ keys
            o = rope(o, pos, freq, inverse=True)
            og = o.reshape(t, c.o_groups, -1)
            wo_a = w[A + "wo_a.weight"].reshape(c.o_groups, c.o_lora, -1)
            low = np.einsum("tgd,grd->tgr", og, wo_a).reshape(t, -1)
            f = low @ w[A + "wo_b.weight"].T
            x = self.hc_post(f, x, post, comb)

            # ---- MoE ----
            F_ = L + "ffn."
            y, post, comb = self.hc_pre(x, w[L + "hc_ffn_fn"], w[L + "hc_ffn_scale"], w[L + "hc_ffn_base"])
            xf = rms(y, w[L + "ffn_norm.weight"], c.eps)
            pi = np.sqrt(softplus(xf @ w[F_ + "gate.weight"].T))  # [t, N]
            lim = c.swiglu_limit

            def expert(prefix, v):
                g = np.minimum(v @ w[prefix + "w1.weight"].T, lim)
                u = np.clip(v @ w[prefix + "w3.weight"].T, -lim, lim)
                return g * sigmoid(g) * u

            out = np.zeros((t, c.embd))
            for i in range(t):
                if il < c.n_hash:
                    chosen = np.asarray(w[F_ + "gate.tid2eid"][ids[i]])
                else:
                    s = pi[i] + w[F_ + "gate.bias"]
                    chosen = topk_lowest_index(s, c.k)
                    margins[i]["router"] = min(margins[i]["router"], decision_margin(s, c.k))
                gw = pi[i, chosen] / pi[i, chosen].sum() * c.routed_scale
                for e, g in zip(chosen, gw):
                    P = f"{F_}experts.{int(e)}."
                    out[i] += (g * expert(P, xf[i])) @ w[P + "w2.weight"].T
            out += expert(F_ + "shared_experts.", xf) @ w[F_ + "shared_experts.w2.weight"].T
            x = self.hc_post(out, x, post, comb)

        # ---- head ----
        self.streams = x
        flat = x.reshape(t, -1)
        mix = (flat @ w["model.hc_head.hc_fn"].T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + c.eps)
        wts = sigmoid(mix * w["model.hc_head.hc_scale"][0] + w["model.hc_head.hc_base"]) + c.hc_eps
        h = rms(np.einsum("ti,tid->td", wts, x), w["model.norm.weight"], c.eps)
        self.pos += t
        self.margins.extend(margins)
        return h @ w["head.weight"].T

    def run(self, tokens, chunk: int) -> np.ndarray:
        """Fresh state, then the whole sequence in chunks of `chunk` tokens."""
        self.reset()
        out = [self.forward(list(tokens[i:i + chunk])) for i in range(0, len(tokens), chunk)]
        return np.concatenate(out)


def load_fixture(fixture_dir: Path) -> tuple[Config, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    cfg = Config.from_hf(json.loads((fixture_dir / "config.json").read_text()))
    return cfg, load_file(str(fixture_dir / "model.safetensors"))
