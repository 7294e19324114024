#!/usr/bin/env python3
"""Reorder control for the official-mode bound: the reference forward run in float32.

Why: the committed official-mode logits come from a float64 forward. Any float32 engine (the CPU
engine, the GPU backend) rounds differently, and the FP8/FP4 simulations turn a last-bit
difference next to a rounding boundary into a whole grid step. To tell that legitimate effect
from a bug, this runs the *same* reference semantics with every float64 array replaced by
float32 (NumPy/BLAS then choose their own f32 summation order, unrelated to the engine's) and
reports how far such a correct-but-reordered implementation lands from the float64 logits, with
the statistics the engine checks use (see tools/oracle/README.md, "Reorder and negative
controls").

Only the f32 checkpoints are run (the q2/q4 variants need ds4-convert and gguf-py; the engine-side
controls of `ds4-engine-check reference --control` cover them). Prefill over the whole sequence.

    tools/oracle/.venv/bin/python tools/oracle/reorder_control.py [--only tiny-hca128] [--seq long]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent.parent / "tests" / "fixtures"


def load_reference(dtype: str):
    """official_reference.py with every `np.float64` replaced by `dtype` (a source rewrite, so
    the float64 module itself is untouched and stays the one the fixtures were made with)."""
    src = (HERE / "official_reference.py").read_text()
    src = src.replace("np.float64", f"np.{dtype}")
    spec = importlib.util.spec_from_loader(f"official_reference_{dtype}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    exec(compile(src, f"official_reference[{dtype}]", "exec"), mod.__dict__)
    return mod


def position_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per position max_v |got - want| / max(1, |want|), as the engine checks compute it."""
    return (np.abs(got.astype(np.float64) - want) / np.maximum(1.0, np.abs(want))).max(axis=-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--only", action="append", help="fixture directory name (repeatable)")
    ap.add_argument("--seq", action="append", help="sequence name (repeatable; default all)")
    ap.add_argument("--dtype", default="float32", help="NumPy dtype replacing float64")
    ap.add_argument("--json", type=Path, help="write the per-position errors here")
    args = ap.parse_args(argv)

    ref_mod = load_reference(args.dtype)
    dirs = sorted(p for p in args.fixtures.iterdir() if (p / "official.json").exists())
    if args.only:
        dirs = [p for p in dirs if p.name in args.only]
    out = {}
    for d in dirs:
        cfg, weights = ref_mod.load_fixture(d)
        inputs = load_file(str(d / "reference.safetensors"))
        official = load_file(str(d / "official.safetensors"))
        meta = json.loads((d / "official.json").read_text())
        seqs = sorted(meta["variants"]["f32"]["sequences"])
        model = ref_mod.Reference(cfg, weights, qat=True)
        for seq in seqs:
            if args.seq and seq not in args.seq:
                continue
            toks = inputs[f"tokens.{seq}"]
            want = official[f"f32.{seq}.logits"].astype(np.float64)
            gaps = official[f"f32.{seq}.top1_gap"]
            t0 = time.time()
            got = model.run(toks, len(toks))
            e = position_errors(got, want)
            top1 = int(((got.argmax(-1) != want.argmax(-1)) & (gaps > 1e-2)).sum())
            over = np.nonzero(e > 1e-4)[0]
            print(f"{d.name} f32 {seq:6s} ({len(toks)} tokens, {time.time() - t0:.0f} s): "
                  f"{100 * (e <= 1e-4).mean():5.1f}% <= 1e-4, median {np.median(e):.1e}, "
                  f"p90 {np.quantile(e, 0.9):.1e}, max {e.max():.1e}, top-1 mismatches {top1}, "
                  f"first > 1e-4 at {over[0] if len(over) else '-'}", flush=True)
            out[f"{d.name}/f32/{seq}"] = e.tolist()
    if args.json:
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
