#!/usr/bin/env python3
"""Write a tiny checkpoint in the official DeepSeek V4 release format, and its exact
dequantization, for `ds4-convert official` (issue 54; docs/gguf.md §5.5).

Why: DeepSeek publishes V4 Flash as FP8 E4M3 dense matrices with one E8M0 scale per 128 × 128
tile and FP4 E2M1 routed experts (two codes per byte in an I8 tensor, low nibble = even column)
with one E8M0 scale per 32 inputs. No such file can be downloaded here, so this script encodes
an existing tiny HF fixture that way. The expected values are computed independently of the
converter: E4M3 and E8M0 decoded by `ml_dtypes` (float8_e4m3fn, float8_e8m0fnu), E2M1 by a
table that is checked against `ml_dtypes.float4_e2m1fn`, products in numpy float32 (exact: the
scales are powers of two). The spec's rule for the E4M3 NaN codes (0x7F, 0xFF → 0, as ds4's
converter does) is applied explicitly on top of ml_dtypes' NaN.

Input: tests/fixtures/tiny-hca16 (F32, transformers-saved naming), plus an MTP block made
from its tensors (`with_mtp`: the official release has one, transformers drops it). Output (default
tests/fixtures/official-tiny/):
  * config.json (the fixture's, plus the official `quantization_config` block, which the
    converter must ignore);
  * model-00001-of-00002.safetensors, model-00002-of-00002.safetensors and
    model.safetensors.index.json, official naming (docs/gguf.md §5.2 (a));
  * expected.json: per checkpoint tensor (official name) its logical shape, the sha256 of its
    exactly dequantized values as little-endian f32, and its first values for diagnosis.
    (Hashes rather than the values themselves keep the fixture small.)

Encodings per tensor (docs/gguf.md §5.5; the per-tensor assignment is unconfirmed in the gathered facts, and the
converter decides per tensor from the dtype, not the name): routed experts FP4; compressor and
indexer-compressor wkv/wgate, the indexer's weights_proj and the router BF16; hc, norms, sinks,
ape and the router bias F32; tid2eid I32; every other matrix FP8.

Edge values are planted so the fixture exercises them: in `layers.0.attn.wq_a.weight` the
codes 0x7F and 0xFF (NaN → 0), 0x80 (−0), 0x01 (smallest subnormal), 0x7E (448); in
`embed.weight` one tile with scale byte 0 (2⁻¹²⁷: the products are f32 subnormals) and one
with byte 200 (2⁷³); in one expert an FP4 scale byte 0 and the codes 8 (−0) and 15 (−6).
The dims of tiny-hca16 (64, 32, 128, 320, 512 wide) give full and partial 128-tiles.

Run: tools/oracle/.venv/bin/python tools/oracle/make_official_ckpt.py [--out DIR]
(needs numpy, safetensors and ml_dtypes; about 2 s). Deterministic: the same input gives the
same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "fixtures" / "tiny-hca16"
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "official-tiny"

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def official_name(saved: str) -> str:
    """transformers-saved naming (c) -> official naming (a), docs/gguf.md §5.2."""
    n = saved[len("model."):] if saved.startswith("model.") else saved
    n = {
        "embed_tokens.weight": "embed.weight",
        "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base",
        "hc_head.hc_scale": "hc_head_scale",
        "mtp.0.hc_head.hc_fn": "mtp.0.hc_head_fn",
        "mtp.0.hc_head.hc_base": "mtp.0.hc_head_base",
        "mtp.0.hc_head.hc_scale": "mtp.0.hc_head_scale",
    }.get(n, n)
    if n.endswith(".attn.norm.weight"):
        n = n[: -len("norm.weight")] + "kv_norm.weight"
    return n


def with_mtp(src: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Adds an MTP block (`mtp.0.*`, which transformers drops, so tiny-hca16 has none). It is
    built from tensors of the right shapes, not trained: layer 0's (window-only) attention,
    HC, norms and experts; the router and its bias from top-k layer 4; e_proj/h_proj from rows
    of the head and the embedding; enorm/hnorm/norm from the final norm; the HC head's copy."""
    out = dict(src)
    for k, v in src.items():
        if k.startswith("model.layers.0.") and ".ffn.gate." not in k:
            out["mtp.0." + k[len("model.layers.0."):]] = v
        if k in ("model.layers.4.ffn.gate.weight", "model.layers.4.ffn.gate.bias"):
            out["mtp.0." + k[len("model.layers.4."):]] = v
    e = src["model.norm.weight"].shape[0]
    out["mtp.0.e_proj.weight"] = src["head.weight"][:e].copy()
    out["mtp.0.h_proj.weight"] = src["model.embed_tokens.weight"][e:2 * e].copy()
    for n in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{n}.weight"] = src["model.norm.weight"] * (1.0 + 0.25 * len(n))
    for n in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head.hc_{n}"] = src[f"model.hc_head.hc_{n}"]
    return out


def encoding(name: str, arr: np.ndarray) -> str:
    if name.endswith("tid2eid"):
        return "I32"
    if arr.ndim != 2 or "hc_" in name or name.endswith(".ape") or "attn_sink" in name:
        return "F32"
    if ".ffn.experts." in name:
        return "FP4"
    if (
        name.endswith("compressor.wkv.weight")
        or name.endswith("compressor.wgate.weight")
        or name.endswith("indexer.weights_proj.weight")
        or name.endswith("ffn.gate.weight")
    ):
        return "BF16"
    return "FP8"


def e8m0_for(amax: np.ndarray, top: float) -> np.ndarray:
    """Smallest power of two s with amax / s <= top, as E8M0 bytes (DeepSeek's ue8m0 rounding)."""
    amax = np.maximum(amax.astype(np.float64), 1e-30)
    e = np.ceil(np.log2(amax / top))
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def scale_values(sbytes: np.ndarray) -> np.ndarray:
    return sbytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def fp8_encode(w: np.ndarray):
    rows, cols = w.shape
    tr, tc = -(-rows // 128), -(-cols // 128)
    sb = np.zeros((tr, tc), dtype=np.uint8)
    for i in range(tr):
        for j in range(tc):
            sb[i, j] = e8m0_for(np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max(), 448.0)
    s = np.repeat(np.repeat(scale_values(sb), 128, 0), 128, 1)[:rows, :cols]
    codes = (w / s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, sb


def fp8_decode(codes: np.ndarray, sb: np.ndarray) -> np.ndarray:
    rows, cols = codes.shape
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v[np.isnan(v)] = 0.0  # docs/gguf.md §5.5: 0x7F / 0xFF -> 0, as ds4's converter does
    s = np.repeat(np.repeat(scale_values(sb), 128, 0), 128, 1)[:rows, :cols]
    return v * s


def fp4_encode(w: np.ndarray):
    rows, cols = w.shape
    assert cols % 2 == 0
    nb = -(-cols // 32)
    sb = np.zeros((rows, nb), dtype=np.uint8)
    for j in range(nb):
        sb[:, j] = e8m0_for(np.abs(w[:, j * 32:(j + 1) * 32]).max(axis=1), 6.0)
    s = np.repeat(scale_values(sb), 32, 1)[:, :cols]
    nib = (w / s).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    return nib, sb


def fp4_pack(nib: np.ndarray) -> np.ndarray:
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)


def fp4_decode(packed: np.ndarray, sb: np.ndarray) -> np.ndarray:
    rows, half = packed.shape
    nib = np.empty((rows, 2 * half), dtype=np.uint8)
    nib[:, 0::2] = packed & 0x0F
    nib[:, 1::2] = packed >> 4
    s = np.repeat(scale_values(sb), 32, 1)[:, : 2 * half]
    return E2M1[nib] * s


def check_e2m1_table():
    via_ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(via_ml.view(np.uint32), E2M1.view(np.uint32)), via_ml


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]]):
    header = {}
    off = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for *_, data in tensors:
            f.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    check_e2m1_table()
    src = with_mtp(load_file(str(SOURCE / "model.safetensors")))
    out: dict[str, tuple[str, list[int], bytes]] = {}
    expected = {}
    for saved in sorted(src):
        name = official_name(saved)
        w = src[saved]
        enc = encoding(name, w)
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if enc == "I32":
            out[name] = ("I32", list(w.shape), w.astype("<i4").tobytes())
            continue
        if enc == "F32":
            vals = w.astype(np.float32)
            out[name] = ("F32", list(w.shape), vals.astype("<f4").tobytes())
        elif enc == "BF16":
            bits = w.astype(ml_dtypes.bfloat16).view("<u2")
            vals = (bits.astype(np.uint32) << 16).view(np.float32)
            out[name] = ("BF16", list(w.shape), bits.tobytes())
        elif enc == "FP8":
            codes, sb = fp8_encode(w)
            if name == "layers.0.attn.wq_a.weight":
                codes[0, :5] = [0x7F, 0xFF, 0x80, 0x01, 0x7E]
            if name == "embed.weight":
                sb[1, 0] = 0
                sb[2, 0] = 200
            vals = fp8_decode(codes, sb)
            out[name] = ("F8_E4M3", list(w.shape), codes.tobytes())
            out[base + ".scale"] = ("F8_E8M0", list(sb.shape), sb.tobytes())
        else:
            nib, sb = fp4_encode(w)
            if name == "layers.3.ffn.experts.5.w2.weight":
                sb[3, 0] = 0
                nib[0, :2] = [8, 15]
            packed = fp4_pack(nib)
            vals = fp4_decode(packed, sb)
            out[name] = ("I8", list(packed.shape), packed.tobytes())
            out[base + ".scale"] = ("F8_E8M0", list(sb.shape), sb.tobytes())
        assert vals.dtype == np.float32 and np.isfinite(vals).all(), name
        expected[name] = {
            "shape": list(vals.shape),
            "sha256_f32": hashlib.sha256(vals.astype("<f4").tobytes()).hexdigest(),
            "first": [float(x) for x in vals.reshape(-1)[:4]],
        }
    args.out.mkdir(parents=True, exist_ok=True)
    names = sorted(out)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    total = 0
    for fname, keys in shards.items():
        write_safetensors(args.out / fname, [(k, *out[k]) for k in keys])
        for k in keys:
            weight_map[k] = fname
            total += len(out[k][2])
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    cfg = json.loads((SOURCE / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    meta = {
        "source": "tests/fixtures/tiny-hca16/model.safetensors",
        "source_sha256": hashlib.sha256((SOURCE / "model.safetensors").read_bytes()).hexdigest(),
        "versions": {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__},
        "tensors": expected,
    }
    (args.out / "expected.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    size = sum((args.out / f).stat().st_size for f in shards)
    print(f"{args.out}: {len(out)} stored tensors in 2 shards, {size} bytes; {len(expected)} expected")


if __name__ == "__main__":
    main()
