#!/usr/bin/env python3
"""Write the codec cross-check vectors in tests/fixtures/codec-vectors/ from PyPI gguf 0.19.0.

    pip install gguf==0.19.0 numpy
    python3 tools/codecs/gen_codec_vectors.py            # deterministic; rewrites the .bin files

Every input block comes from a fixed-seed SplitMix64 stream through a small "recipe" per
(operation, type) that crates/ds4-gguf/tests/codec_crosscheck.rs reimplements; the expected
outputs come from gguf itself (`gguf.quants.dequantize` / `gguf.quants.quantize`; for I32,
which gguf has no codec for, numpy's `astype(float32)`). To keep the fixtures small, a file
stores the seed, an FNV-1a-64 hash of every input record (so the Rust side proves it
regenerated exactly the same inputs), a hash of every expected output record (every element
of every record is therefore checked bit-exactly), and the first N_FULL records in full so a
failure can be shown value by value.

File layout (little-endian):
    0   8  magic b"DS4CVEC1"
    8   4  u32 op          0 = dequantize (bytes -> f32), 1 = quantize (f32 -> bytes)
    12  4  u32 ggml type code
    16  4  u32 n_records
    20  4  u32 elements per record
    24  4  u32 input bytes per record
    28  4  u32 output bytes per record
    32  4  u32 n_full      records stored in full below
    36  4  u32 recipe      recipe version (1)
    40  8  u64 seed
    48  8  u64 input hash  FNV-1a-64 over the concatenated per-record input hashes (u64 LE)
    56     u64[n_records]  FNV-1a-64 of each record's expected output bytes; for f32 outputs
                           every NaN is first replaced by 0x7FC00000 (NaN matches any NaN)
    ...    n_full records of input bytes, then n_full records of expected output bytes

A "record" is one ggml block for the block types, and a run of 256 elements for the plain
types (F32, F16, BF16, I32), whose ggml block is a single element.

Recipes (rng = SplitMix64(seed); u64() = next output; all integer arithmetic):
  dequantize Q8_0/Q2_K/Q4_K/IQ2_XXS, 10240 blocks: block i = first block_bytes bytes of
    ceil(block_bytes/8) u64() in little-endian order; then r = u64(), and for the k-th f16
    scale field (Q8_0 d@0; Q2_K d@80, dmin@82; Q4_K d@0, dmin@2; IQ2_XXS d@0):
    sel = (r >> 8k) & 0xFF, if sel >= 128 the field becomes F16_SPECIALS[sel % 20]. Block 0
    is then set to all 0x00 bytes and block 1 to all 0xFF. Every byte pattern is a valid block
    of these types, and random f16 fields already include NaN/inf/subnormal scales.
  dequantize MXFP4, 10240 blocks: block i = 17 bytes of ceil(17/8) u64() as above, then its
    scale byte (byte 0) is set to i % 256, so every E8M0 value appears 40 times with random
    nibbles; block 0 is then all 0x00 and block 1 all 0xFF. MXFP4 has no NaN encoding (scale
    255 is 2^127); large scales overflow to ±inf.
  dequantize F16 / BF16: all 65536 bit patterns in order (exhaustive), 256 records.
  dequantize F32 / I32: F32_SPECIALS / I32_SPECIALS, then u32 values (see gen_f32_bits /
    gen_i32) up to 16384 elements.
  quantize Q8_0, 10240 blocks of 32 floats: see gen_q8_0_block (random magnitudes over 62
    binades, exact ties at .5 for the round-half-away-from-zero rule, ±0 blocks, constant
    blocks, subnormal blocks).
  quantize MXFP4, 10240 blocks of 32 floats: see gen_mxfp4_qblock (random magnitudes over
    every f32 binade, values on the E2M1 grid and exact ties between its points, ±0 blocks,
    constant blocks, tiny blocks whose scale byte wraps, and blocks whose max |x| is one of
    the top mantissas of its binade, where float32 log2 rounds up to the next integer).
  quantize F16 / BF16, 16384 floats: specials then random finite values with forced
    rounding ties (see gen_f16_input / gen_bf16_input).
"""

import argparse
import importlib.metadata
import pathlib
import struct
import sys

import numpy as np

EXPECTED_GGUF = "0.19.0"
REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests/fixtures/codec-vectors"

MASK64 = (1 << 64) - 1
MAGIC = b"DS4CVEC1"
RECIPE = 1
N_FULL = 32
N_BLOCKS = 10240
PLAIN_RUN = 256
BASE_SEED = 0x6473_3463_6F64_6563  # "ds4codec"

F16_SPECIALS = [
    0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00,
    0xBC00, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0x1400, 0x2E66, 0x5BFF,
]
F32_SPECIALS = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x00000001, 0x007FFFFF, 0x00800000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
    0x7FFFFFFF, 0x33800000, 0x477FE000, 0x477FF000, 0x3EAAAAAB, 0x4B000001,
]
I32_SPECIALS = [
    0, 1, -1, 2**31 - 1, -(2**31), 2**24, 2**24 + 1, 2**24 + 3, -(2**24 + 1), 2**31 - 65,
    2**31 - 64, 2**31 - 63, 123456789, -987654321, 16777217 * 2, 255, -256, 65535,
]
# f32 bit patterns for the F16 quantize specials (all representable or rounding to finite).
F16_Q_SPECIALS = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x477FE000, 0xC77FE000, 0x477FEFFF,
    0x33800000, 0x33000000, 0x33400000, 0x38800000, 0x7F800000, 0xFF800000, 0x7FC00000,
    0xFFC00000, 0x2EDBE6FF, 0x3DCCCCCD, 0x3EAAAAAB, 0x3F801000, 0x3F803000, 0x387FC000,
]
# f32 bit patterns for the BF16 quantize specials.
BF16_Q_SPECIALS = [
    0x00000000, 0x80000000, 0x3F800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
    0xFF800001, 0x7FFFFFFF, 0x7F7F7FFF, 0x00000001, 0x00008000, 0x00018000, 0x3F808000,
    0x3F818000, 0x3F817FFF, 0x3DCCCCCD, 0x80008001,
]


class SplitMix64:
    def __init__(self, seed: int):
        self.state = seed & MASK64

    def u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def raw(self, n: int) -> bytearray:
        out = bytearray()
        while len(out) < n:
            out += self.u64().to_bytes(8, "little")
        return out[:n]


def fnv1a64_rows(rows: np.ndarray) -> np.ndarray:
    """FNV-1a-64 of each row of a 2-D uint8 array (vectorised over rows)."""
    h = np.full(rows.shape[0], 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    for col in range(rows.shape[1]):
        h ^= rows[:, col].astype(np.uint64)
        h *= prime
    return h


def canon_f32(out: np.ndarray) -> np.ndarray:
    bits = out.astype(np.float32).view(np.uint32).copy()
    bits[np.isnan(out)] = 0x7FC00000
    return bits


def seed_for(op: int, code: int) -> int:
    return (BASE_SEED ^ (op << 40) ^ (code << 48)) & MASK64


# ------------------------------------------------------------------------------------------
# Recipes. Each returns the input as bytes (np.uint8, n_records x in_bytes).

def gen_blocks(rng: SplitMix64, block_bytes: int, f16_offsets: list[int]) -> np.ndarray:
    blocks = []
    for i in range(N_BLOCKS):
        b = rng.raw(block_bytes)
        r = rng.u64()
        for k, off in enumerate(f16_offsets):
            sel = (r >> (8 * k)) & 0xFF
            if sel >= 128:
                b[off : off + 2] = F16_SPECIALS[sel % len(F16_SPECIALS)].to_bytes(2, "little")
        if i == 0:
            b = bytearray(block_bytes)
        elif i == 1:
            b = bytearray(b"\xff" * block_bytes)
        blocks.append(bytes(b))
    return np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(N_BLOCKS, block_bytes)


def gen_f32_bits(rng: SplitMix64, n: int) -> list[int]:
    vals = list(F32_SPECIALS)
    while len(vals) < n:
        vals.append(rng.u64() & 0xFFFFFFFF)
    return vals


def gen_i32(rng: SplitMix64, n: int) -> list[int]:
    vals = [v & 0xFFFFFFFF for v in I32_SPECIALS]
    while len(vals) < n:
        v = rng.u64()
        shift = (v >> 32) % 32
        mag = (v & 0xFFFFFFFF) >> shift
        vals.append(((-mag) & 0xFFFFFFFF) if (v >> 63) else mag)
    return vals


def f32_bits(sign: int, exp: int, mant: int) -> int:
    return (sign << 31) | (exp << 23) | mant


def gen_q8_0_block(rng: SplitMix64) -> list[int]:
    """32 f32 bit patterns. r = u64(); mode = r & 7; block exponent eb = 87 + (r >> 8) % 62."""
    r = rng.u64()
    mode = r & 7
    eb = 87 + ((r >> 8) % 62)
    out = []
    if mode <= 3:  # random magnitudes spread over 16 binades below eb
        for _ in range(32):
            v = rng.u64()
            exp = max(eb - ((v >> 32) % 16), 0)
            out.append(f32_bits(v >> 63, exp, v & 0x7FFFFF))
    elif mode == 4:  # exact ties: (k - 254)/2 · 2^s with element 0 = ±127 · 2^s
        s = ((r >> 20) % 17) - 8
        scale = np.float32(2.0**s)
        for i in range(32):
            k = rng.u64() % 509
            val = np.float32((k - 254) * 0.5) * scale
            if i == 0:
                val = np.float32(127.0 if (r >> 16) & 1 else -127.0) * scale
            out.append(int(np.float32(val).view(np.uint32)))
    elif mode == 5:  # signed zeros
        for _ in range(32):
            out.append(f32_bits(rng.u64() >> 63, 0, 0))
    elif mode == 6:  # constant block
        v = rng.u64()
        c = f32_bits(v >> 63, max(eb - ((v >> 32) % 16), 0), v & 0x7FFFFF)
        out = [c] * 32
    else:  # tiny: subnormal and smallest normal binades (1/d overflows to inf here)
        for _ in range(32):
            v = rng.u64()
            out.append(f32_bits(v >> 63, (v >> 32) % 9, v & 0x7FFFFF))
    return out


def gen_mxfp4_blocks(rng: SplitMix64) -> np.ndarray:
    blocks = []
    for i in range(N_BLOCKS):
        b = rng.raw(17)
        b[0] = i % 256
        if i == 0:
            b = bytearray(17)
        elif i == 1:
            b = bytearray(b"\xff" * 17)
        blocks.append(bytes(b))
    return np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(N_BLOCKS, 17)


def gen_mxfp4_qblock(rng: SplitMix64) -> list[int]:
    """32 f32 bit patterns. r = u64(); mode = r & 7; block exponent eb = (r >> 8) % 255."""
    r = rng.u64()
    mode = r & 7
    eb = (r >> 8) % 255
    out = []
    if mode <= 1:  # random magnitudes over 8 binades below eb
        for _ in range(32):
            v = rng.u64()
            out.append(f32_bits(v >> 63, max(eb - ((v >> 32) % 8), 0), v & 0x7FFFFF))
    elif mode == 2:  # quarter steps t/4 · 2^s, t in [-48, 48], element 0 = ±12 · 2^s
        s = ((r >> 20) % 231) - 120
        scale = np.float32(2.0**s)
        for i in range(32):
            t = rng.u64() % 97
            val = np.float32((t - 48) * 0.25) * scale
            if i == 0:
                val = np.float32(12.0 if (r >> 16) & 1 else -12.0) * scale
            out.append(int(np.float32(val).view(np.uint32)))
    elif mode == 3:  # signed zeros
        for _ in range(32):
            out.append(f32_bits(rng.u64() >> 63, 0, 0))
    elif mode == 4:  # constant block
        v = rng.u64()
        out = [f32_bits(v >> 63, eb, v & 0x7FFFFF)] * 32
    elif mode == 5:  # tiny: subnormals and the smallest normal binades (scale byte wraps)
        for _ in range(32):
            v = rng.u64()
            out.append(f32_bits(v >> 63, (v >> 32) % 5, v & 0x7FFFFF))
    elif mode == 6:  # max |x| at one of the top 48 mantissas of binade max(eb, 1)
        top = max(eb, 1)
        for _ in range(32):
            v = rng.u64()
            out.append(f32_bits(v >> 63, max(top - 1 - ((v >> 32) % 8), 0), v & 0x7FFFFF))
        out[(r >> 32) % 32] = f32_bits((r >> 63) & 1, top, 0x7FFFFF - ((r >> 40) % 48))
    else:  # every element in its own random binade
        for _ in range(32):
            v = rng.u64()
            out.append(f32_bits(v >> 63, (v >> 32) % 255, v & 0x7FFFFF))
    return out


def gen_f16_input(rng: SplitMix64, n: int) -> list[int]:
    vals = list(F16_Q_SPECIALS)
    while len(vals) < n:
        v = rng.u64()
        exp = 101 + ((v >> 32) % 41)  # up to 2^14 magnitude: never rounds to f16 inf
        mant = v & 0x7FFFFF
        if (v >> 40) & 3 == 0:
            mant = (mant & ~0x1FFF) | 0x1000  # exact tie at f16 normal precision
        vals.append(f32_bits(v >> 63, exp, mant))
    return vals


def gen_bf16_input(rng: SplitMix64, n: int) -> list[int]:
    vals = list(BF16_Q_SPECIALS)
    while len(vals) < n:
        v = rng.u64()
        exp = (v >> 32) % 254  # finite and below 2^127: never rounds to inf
        mant = v & 0x7FFFFF
        if (v >> 48) & 3 == 0:
            mant = (mant & ~0xFFFF) | 0x8000  # exact tie
        vals.append(f32_bits(v >> 63, exp, mant))
    return vals


# ------------------------------------------------------------------------------------------

def write_file(path, op, code, elems, inp: np.ndarray, out: np.ndarray, out_hash_src: np.ndarray, seed):
    n = inp.shape[0]
    in_hashes = fnv1a64_rows(inp)
    input_hash = int(fnv1a64_rows(in_hashes.astype("<u8").view(np.uint8).reshape(1, -1))[0])
    out_hashes = fnv1a64_rows(out_hash_src)
    header = MAGIC + struct.pack(
        "<IIIIIIIIQQ", op, code, n, elems, inp.shape[1], out.shape[1], N_FULL, RECIPE, seed, input_hash
    )
    body = out_hashes.astype("<u8").tobytes() + inp[:N_FULL].tobytes() + out[:N_FULL].tobytes()
    path.write_bytes(header + body)
    return len(header) + len(body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    version = importlib.metadata.version("gguf")
    if version != EXPECTED_GGUF:
        print(f"need gguf=={EXPECTED_GGUF}, found {version}", file=sys.stderr)
        return 1
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    args.out.mkdir(parents=True, exist_ok=True)
    total = 0

    def emit_dequant(name, qt, elems, inp_u8, expected_f32):
        nonlocal total
        exp = expected_f32.reshape(inp_u8.shape[0], elems).astype(np.float32)
        canon = canon_f32(exp).astype("<u4").view(np.uint8).reshape(inp_u8.shape[0], -1)
        raw = exp.astype("<f4").view(np.uint8).reshape(inp_u8.shape[0], -1)
        size = write_file(args.out / f"dequant-{name}.bin", 0, int(qt), elems, inp_u8, raw, canon,
                          seed_for(0, int(qt)))
        total += size
        print(f"dequant-{name}.bin: {inp_u8.shape[0]} records x {elems} elements, {size} bytes")

    def emit_quant(name, qt, elems, inp_bits, expected_u8):
        nonlocal total
        inp = np.asarray(inp_bits, dtype="<u4").view(np.uint8).reshape(-1, elems * 4)
        out = expected_u8.reshape(inp.shape[0], -1)
        size = write_file(args.out / f"quant-{name}.bin", 1, int(qt), elems, inp, out, out,
                          seed_for(1, int(qt)))
        total += size
        print(f"quant-{name}.bin: {inp.shape[0]} records x {elems} elements, {size} bytes")

    # Block types.
    for name, qt, bb, offs in [
        ("q8_0", T.Q8_0, 34, [0]),
        ("q2_k", T.Q2_K, 84, [80, 82]),
        ("q4_k", T.Q4_K, 144, [0, 2]),
        ("iq2_xxs", T.IQ2_XXS, 66, [0]),
    ]:
        rng = SplitMix64(seed_for(0, int(qt)))
        blocks = gen_blocks(rng, bb, offs)
        with np.errstate(all="ignore"):
            deq = dequantize(blocks.copy(), qt)
        emit_dequant(name, qt, deq.shape[-1], blocks, deq)

    rng = SplitMix64(seed_for(0, int(T.MXFP4)))
    blocks = gen_mxfp4_blocks(rng)
    with np.errstate(all="ignore"):
        deq = dequantize(blocks.copy(), T.MXFP4)
    emit_dequant("mxfp4", T.MXFP4, 32, blocks, deq)

    # Exhaustive F16 / BF16.
    for name, qt in [("f16", T.F16), ("bf16", T.BF16)]:
        pats = np.arange(65536, dtype="<u2").view(np.uint8).reshape(-1, 2 * PLAIN_RUN)
        with np.errstate(all="ignore"):
            deq = dequantize(pats.copy(), qt)
        emit_dequant(name, qt, PLAIN_RUN, pats, np.asarray(deq, dtype=np.float32))

    # F32 (gguf returns the same bits) and I32 (numpy cast; gguf has no I32 codec).
    rng = SplitMix64(seed_for(0, int(T.F32)))
    f32 = np.asarray(gen_f32_bits(rng, 64 * PLAIN_RUN), dtype="<u4")
    inp = f32.view(np.uint8).reshape(-1, 4 * PLAIN_RUN)
    emit_dequant("f32", T.F32, PLAIN_RUN, inp, dequantize(inp.copy().reshape(-1), T.F32))
    rng = SplitMix64(seed_for(0, int(T.I32)))
    i32 = np.asarray(gen_i32(rng, 64 * PLAIN_RUN), dtype="<u4")
    inp = i32.view(np.uint8).reshape(-1, 4 * PLAIN_RUN)
    emit_dequant("i32", T.I32, PLAIN_RUN, inp, i32.view("<i4").astype(np.float32))

    # Quantizers gguf has: Q8_0 and MXFP4 (bit-exact with ggml's reference), F16, BF16.
    rng = SplitMix64(seed_for(1, int(T.Q8_0)))
    bits = [v for _ in range(N_BLOCKS) for v in gen_q8_0_block(rng)]
    x = np.asarray(bits, dtype="<u4").view(np.float32).reshape(N_BLOCKS, 32)
    with np.errstate(all="ignore"):
        q = quantize(x, T.Q8_0)
    emit_quant("q8_0", T.Q8_0, 32, bits, q.view(np.uint8))
    rng = SplitMix64(seed_for(1, int(T.MXFP4)))
    bits = [v for _ in range(N_BLOCKS) for v in gen_mxfp4_qblock(rng)]
    x = np.asarray(bits, dtype="<u4").view(np.float32).reshape(N_BLOCKS, 32)
    with np.errstate(all="ignore"):
        q = quantize(x, T.MXFP4)
    emit_quant("mxfp4", T.MXFP4, 32, bits, q.view(np.uint8))
    for name, qt, gen in [("f16", T.F16, gen_f16_input), ("bf16", T.BF16, gen_bf16_input)]:
        rng = SplitMix64(seed_for(1, int(qt)))
        bits = gen(rng, 64 * PLAIN_RUN)
        x = np.asarray(bits, dtype="<u4").view(np.float32).reshape(-1, PLAIN_RUN)
        with np.errstate(all="ignore"):
            q = quantize(x, qt)
        emit_quant(name, qt, PLAIN_RUN, bits, np.ascontiguousarray(q).view(np.uint8))

    print(f"total {total} bytes in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
