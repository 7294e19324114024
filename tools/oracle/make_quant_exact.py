#!/usr/bin/env python3
"""Write exact-mode reference logits for the q2 and q4 conversions of `tiny-quant`.

Why: HF transformers only ever ran the f32 checkpoint, so the engine's logits on a q2/q4 GGUF
had no reference of their own (a test could only check that they were finite, or agree with the
engine's own run on the dequantized file). Here `official_reference.py` with its simulations off
(exact math) runs on the GGUF's own dequantized tensors, which is what the engine computes with.

Steps:

1. the reference is proven on the f32 checkpoint first: its exact-mode logits must agree with
   the mean of HF's prefill, decode and chunked logits within 1e-5 * max(1, |logit|) on every
   sequence, or nothing is written;
2. the fixture is converted with the ds4-convert binary (`--types q2` and `--types q4`, as
   make_official.py does), dequantized with gguf-py and mapped back to HF names;
3. per variant and sequence: prefill, token-by-token decode and chunked prefill (the fixture's
   chunk size) in float64; the three must agree to 1e-9, and the prefill logits are stored with
   per-position decision margins (router/indexer top-k and the logit top-1/top-2 gap).

To stay under 1 MB, `long` keeps every second position (1, 3, ..., 519); `short` and `medium`
keep all. `<variant>.<seq>.positions` says which rows are stored.

Output: `tests/fixtures/tiny-quant/quant_exact.safetensors` and `quant_exact.json`.
Needs numpy, safetensors and gguf (no PyTorch); about 2 minutes on one core.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_official import EXACT_TOL, MODE_TOL, gguf_weights, rel_err, sha256  # noqa: E402
from official_reference import Reference, load_fixture  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "tiny-quant"
VARIANTS = ("q2", "q4")


def stored_positions(seq: str, n: int) -> np.ndarray:
    """All positions, except for `long`, where odd ones are kept (the last one, 519, included)."""
    return np.arange(1, n, 2) if seq == "long" else np.arange(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--ds4-convert", type=Path, default=REPO_ROOT / "target" / "release" / "ds4-convert",
                    help="build it with cargo build --release -p ds4-convert")
    args = ap.parse_args(argv)
    t_all = time.time()
    d = args.fixture
    cfg, weights = load_fixture(d)
    ref = load_file(str(d / "reference.safetensors"))
    meta = json.loads((d / "reference.json").read_text())
    seqs = sorted(meta["sequences"], key=lambda s: meta["sequences"][s]["length"])

    # 1. exact mode against HF on the f32 checkpoint.
    exact_vs_hf = {}
    r = Reference(cfg, weights, qat=False)
    for seq in seqs:
        toks = ref[f"tokens.{seq}"]
        got = r.run(toks, len(toks))
        want = sum(ref[f"{m}.{seq}.logits"].astype(np.float64) for m in ("prefill", "decode", "chunked")) / 3
        e = rel_err(got, want)
        exact_vs_hf[seq] = e
        print(f"f32 exact vs HF {seq:6s}: max rel {e:.2e}", flush=True)
        if e > EXACT_TOL:
            raise RuntimeError(f"f32/{seq}: exact mode differs from HF by {e:e} > {EXACT_TOL:e}")

    tensors, variants = {}, {}
    full = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "hf"
        src.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copy(d / f, src / f)
        for types in VARIANTS:
            out = Path(tmp) / f"{types}.gguf"
            subprocess.run([str(args.ds4_convert), "--quiet", "hf", str(src), str(out), "--types", types],
                           check=True, stdout=subprocess.DEVNULL)
            qw = gguf_weights(out, weights)
            worst = float(qw.pop("__worst_rel__"))
            info = {"gguf_sha256": sha256(out), "dequantized_max_rel_norm_error": worst, "sequences": {}}
            r = Reference(cfg, qw, qat=False)
            for seq in seqs:
                toks = ref[f"tokens.{seq}"]
                chunk = meta["sequences"][seq]["chunk_size"]
                p = r.run(toks, len(toks))
                margins = r.margins
                dd = float(np.abs(p - r.run(toks, 1)).max())
                dc = float(np.abs(p - r.run(toks, chunk)).max())
                if max(dd, dc) > MODE_TOL:
                    raise RuntimeError(f"{types}/{seq}: prefill vs decode/chunked differ by {dd:e}/{dc:e}")
                full[(types, seq)] = p
                pos = stored_positions(seq, len(toks))
                topk = np.minimum(np.array([min(m["router"], m["indexer"]) for m in margins]), 1.0)
                srt = np.sort(p, axis=-1)
                gap = srt[:, -1] - srt[:, -2]
                tensors[f"{types}.{seq}.positions"] = pos.astype(np.int32)
                tensors[f"{types}.{seq}.logits"] = p[pos].astype(np.float32)
                tensors[f"{types}.{seq}.topk_margin"] = topk[pos].astype(np.float32)
                tensors[f"{types}.{seq}.top1_gap"] = gap[pos].astype(np.float32)
                hf = ref[f"prefill.{seq}.logits"].astype(np.float64)
                info["sequences"][seq] = {
                    "chunk_size": chunk,
                    "stored_positions": int(len(pos)),
                    "max_abs_prefill_minus_decode": dd,
                    "max_abs_prefill_minus_chunked": dc,
                    "min_topk_margin": float(topk.min()),
                    "min_top1_gap": float(gap.min()),
                    "max_abs_logit": float(np.abs(p).max()),
                    "max_rel_vs_hf_f32_prefill": rel_err(p, hf),
                }
                print(f"{types} exact {seq:6s}: |prefill-decode| {dd:.1e} |prefill-chunked| {dc:.1e} "
                      f"min top-k margin {topk.min():.2e} min top-1 gap {gap.min():.2e} "
                      f"vs HF f32 {info['sequences'][seq]['max_rel_vs_hf_f32_prefill']:.2e}", flush=True)
            variants[types] = info
    # How far apart the two references are: a test that swaps them must fail by this much.
    q2_vs_q4 = {seq: rel_err(full[("q2", seq)], full[("q4", seq)]) for seq in seqs}
    print("q2 vs q4 reference: " + ", ".join(f"{s} {e:.2e}" for s, e in q2_vs_q4.items()))

    path = d / "quant_exact.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    doc = {
        "generator": "tools/oracle/make_quant_exact.py (reference forward: tools/oracle/official_reference.py, "
                     "simulations off)",
        "what": "exact-mode logits of the q2 and q4 ds4-convert conversions of this fixture, computed in float64 "
                "from the GGUF's dequantized tensors",
        "reference_checked_against_hf": {
            "tolerance": f"|d| <= {EXACT_TOL} * max(1, |hf|), hf = mean of HF's prefill, decode and chunked "
                         "logits of the f32 checkpoint",
            "max_rel_per_sequence": exact_vs_hf,
        },
        "mode_tolerance": f"prefill, token-by-token decode and chunked prefill agree within {MODE_TOL}",
        "tensors": {
            "<variant>.<seq>.positions": "I32 [P], the positions whose rows are stored",
            "<variant>.<seq>.logits": "F32 [P, V], prefill logits at those positions",
            "<variant>.<seq>.topk_margin": "F32 [P], smallest (k-th - (k+1)-th) / max|score| over the router "
                                           "and indexer top-k decisions of every layer (1.0 where none)",
            "<variant>.<seq>.top1_gap": "F32 [P], largest minus second largest logit",
        },
        "variants": variants,
        "max_rel_q2_vs_q4": q2_vs_q4,
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "safetensors": importlib.metadata.version("safetensors"),
                     "gguf": importlib.metadata.version("gguf")},
        "quant_exact_safetensors_sha256": sha256(path),
    }
    (d / "quant_exact.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{path.stat().st_size / 1e6:.2f} MB, {time.time() - t_all:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
