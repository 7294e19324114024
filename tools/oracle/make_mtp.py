#!/usr/bin/env python3
"""An MTP block for tiny-hca16 and a float64 reference of its draft logits.

Why: the engine's MTP drafter (docs/forward.md §10) must compute what DeepSeek's reference
inference code (`inference/model.py` of the V4 release, read for its semantics; nothing
copied) computes. HF transformers has no MTP block, so the reference is `official_reference.py`
(the NumPy float64 forward that `make_official.py` first checks against HF's logits, within
1e-5, before anything is written) run twice: the main model over the sequence, keeping its
final streams, then the block as a one-layer model (window-only attention at the plain RoPE
base, biased top-k MoE, the block's HC head and norm, the main output matrix) over the input
streams `W_h·RMS(H_i; hnorm) + W_e·RMS(Emb[t_{i+1}]; enorm)` at position `i`. The shared parts
(attention, MoE, HC) are thus the code HF validates; this script also re-checks the main
model's exact-mode logits against the committed HF logits before writing.

Output (`tests/fixtures/mtp-hca16/`, ~0.6 MB):
* `mtp.safetensors`: the block's tensors, F32, named as transformers-style checkpoints name a
  layer (`mtp.0.attn.wq_a.weight`, ...; docs/gguf.md §5.3), random with the fixtures' init.
* `model.safetensors.index.json`: a weight map over tiny-hca16's `model.safetensors` and
  `mtp.safetensors`, so `ds4-convert hf` reads both (and writes the block as the sidecar).
* `reference.safetensors`: `tokens` (I32 [T]); per mode (`exact`, `official`):
  `<mode>.depth1` (F32 [T-1, V]: row i from the main streams of position i and token i+1)
  and `<mode>.depth2` (F32 [len(CHAIN), V]: at position p, the block's own output streams of
  row p-1 and token p+1, after rows 0..p-1).

Run: tools/oracle/.venv/bin/python tools/oracle/make_mtp.py   (numpy and safetensors only)
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from official_reference import Reference, load_fixture, rms

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests/fixtures/tiny-hca16"
DEFAULT_OUT = ROOT / "tests/fixtures/mtp-hca16"
SEED = 5301
T = 40
CHAIN = [3, 9, 17, 18, 25, 38]


def mtp_weights(src: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random tensors of the block's shapes: a window-only layer's (those of layer 0) with a
    biased router (layer 4's gate and bias) instead of hash routing, and the block's own."""
    out = {}
    for k, v in src.items():
        if k.startswith("model.layers.0.") and "tid2eid" not in k:
            out["mtp.0." + k[len("model.layers.0."):]] = v.shape
        if k == "model.layers.4.ffn.gate.bias":
            out["mtp.0.ffn.gate.bias"] = v.shape
    e = src["model.norm.weight"].shape[0]
    out["mtp.0.e_proj.weight"] = (e, e)
    out["mtp.0.h_proj.weight"] = (e, e)
    for n in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{n}.weight"] = (e,)
    for n in ("fn", "base", "scale"):  # spelled as the official checkpoint does
        out[f"mtp.0.hc_head_{n}"] = src[f"model.hc_head.hc_{n}"].shape
    w = {}
    for k in sorted(out):
        shape = out[k]
        if k.endswith("norm.weight"):
            v = 1.0 + rng.uniform(-0.2, 0.2, shape)
        elif k.endswith("attn_sink"):
            v = rng.normal(0.0, 1.0, shape)
        elif k.endswith("_base"):
            v = rng.normal(0.0, 0.5, shape)
        elif k.endswith("_scale"):
            v = 1.0 + rng.uniform(-0.3, 0.3, shape)
        elif k.endswith("gate.bias"):
            v = rng.normal(0.0, 0.1, shape)
        else:  # linear weights and mixers: N(0, 1/fan_in)
            v = rng.normal(0.0, shape[-1] ** -0.5, shape)
        w[k] = v.astype(np.float32)
    return w


def block_model(cfg, main_w, mw, qat):
    """The block as a one-layer model for `Reference`, named like a main layer 0."""
    w = {"model.layers.0." + k[len("mtp.0."):]: v for k, v in mw.items()
         if not k.split(".", 2)[2].startswith(("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head"))}
    for n in ("fn", "base", "scale"):
        w[f"model.hc_head.hc_{n}"] = mw[f"mtp.0.hc_head_{n}"]
    w["model.norm.weight"] = mw["mtp.0.norm.weight"]
    w["head.weight"] = main_w["head.weight"]
    w["model.embed_tokens.weight"] = main_w["model.embed_tokens.weight"]
    bcfg = replace(cfg, n_layer=1, ratios=[0], n_hash=0)
    return Reference(bcfg, w, qat)


def block_input(cfg, main_w, mw, streams, toks):
    """Each stream W_h·RMS(h; hnorm) plus W_e·RMS(Emb[t]; enorm) (docs/forward.md §10)."""
    f64 = lambda k: mw[k].astype(np.float64)
    e = rms(main_w["model.embed_tokens.weight"][np.asarray(toks)].astype(np.float64),
            f64("mtp.0.enorm.weight"), cfg.eps) @ f64("mtp.0.e_proj.weight").T
    h = rms(streams, f64("mtp.0.hnorm.weight"), cfg.eps) @ f64("mtp.0.h_proj.weight").T
    return h + e[:, None, :]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    cfg, main_w = load_fixture(SOURCE)
    rng = np.random.default_rng(SEED)
    mw = mtp_weights(main_w, rng)
    toks = [int(t) for t in rng.integers(2, cfg.vocab, T)]

    # The shared code against HF first: the committed `medium` sequence's exact logits.
    hf = load_file(str(SOURCE / "reference.safetensors"))
    ref_toks = [int(t) for t in hf["tokens.short"]]
    want = hf["prefill.short.logits"].astype(np.float64)
    got = Reference(cfg, main_w, qat=False).run(ref_toks, chunk=len(ref_toks))
    err = float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))))
    assert err < 1e-5, f"the reference disagrees with HF by {err}"

    out = {"tokens": np.asarray(toks, dtype=np.int32)}
    for mode, qat in (("exact", False), ("official", True)):
        m = Reference(cfg, main_w, qat)
        m.reset()
        m.forward(toks)
        streams = m.streams  # [T, hc, E], before the head
        blk = block_model(cfg, main_w, mw, qat)
        blk.reset()
        x = block_input(cfg, main_w, mw, streams[:-1], toks[1:])
        out[f"{mode}.depth1"] = blk.forward(toks[1:], x_in=x).astype(np.float32)
        rows = []
        for p in CHAIN:
            blk.reset()
            blk.forward(toks[1:p + 1], x_in=x[:p])  # rows 0..p-1
            own = blk.streams[-1:]
            b2 = copy.deepcopy(blk)
            x2 = block_input(cfg, main_w, mw, own, [toks[p + 1]])
            rows.append(b2.forward([toks[p + 1]], x_in=x2)[0])
        out[f"{mode}.depth2"] = np.asarray(rows, dtype=np.float32)
        print(f"{mode}: depth1 {out[f'{mode}.depth1'].shape}, depth2 {out[f'{mode}.depth2'].shape}, "
              f"|logits| max {np.abs(out[f'{mode}.depth1']).max():.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(mw, str(args.out / "mtp.safetensors"))
    weight_map = {k: "model.safetensors" for k in sorted(main_w)}
    weight_map.update({k: "mtp.safetensors" for k in sorted(mw)})
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1, sort_keys=True) + "\n")
    save_file(out, str(args.out / "reference.safetensors"),
              metadata={"seed": str(SEED), "chain": ",".join(map(str, CHAIN))})
    for f in sorted(args.out.iterdir()):
        print(f"{f.relative_to(ROOT)}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
