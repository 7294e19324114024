// ds4_gemv.h: what the files of the GEMV module share (gemv.cu includes them all): the
// tuning knobs, input loaders, block formats and the row engine for block formats.
// Each file includes this header, so each also compiles alone.
#pragma once
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"

#define DS4_GEMV_THREADS 256
#define DS4_GEMV_WARPS (DS4_GEMV_THREADS / DS4_WARP)

// Tuning constants, per format: rows per warp R (x loaded once for R rows) and the minimum
// resident blocks per multiprocessor (caps registers: 4 -> 64, 2 -> 128 per thread); chosen
// by ds4-gpu-check's sweeps (crates/ds4-gpu/NOTES.md; BENCHMARKS.md, GEMV kernels of 2026-12-02;
// split-layout Q8_0: 2 rows x 2 vectors in flight, the fastest without register spills).
// F16/F32 rows: DS4_GEMV_PLAIN_ROWS (gemv_plain.cu).
#define DS4_ROWS_Q8_0 2
#define DS4_ROWS_Q2_K 2
#define DS4_ROWS_Q4_K 2
#define DS4_ROWS_IQ2_XXS 2
#define DS4_ROWS_MXFP4 2
#define DS4_MINB_PLAIN 4
#define DS4_MINB_Q8_0 4
#define DS4_MINB_Q2_K 2
#define DS4_MINB_Q4_K 2
#define DS4_MINB_IQ2_XXS 2
#define DS4_MINB_MXFP4 2
// Most columns (tokens of different sequences) of the several-column GEMVs (batched decode).
#define DS4_Q8M_COLS 8
#define DS4_GEMV_UNROLL 8
#define DS4_PRAGMA(x) _Pragma(#x)
#define DS4_UNROLL(n) DS4_PRAGMA(unroll n)

#if defined(DS4_HIP)
#define DS4_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads)
#else
#define DS4_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#endif

__device__ __forceinline__ ds4_u16 ds4_ld_u16(const ds4_u8* p) { return *(const ds4_u16*)p; }
__device__ __forceinline__ ds4_u32 ds4_ld_u32(const ds4_u8* p) { return *(const ds4_u32*)p; }

// x is an activation: coherent loads (ds4_ld_act), never the read-only path.
__device__ __forceinline__ float4 ds4_ld_x4(const float* p) {
    return ds4_ld_act((const float4*)p);
}

// A GEMV's input vector where it is not a plain array: SwiGLU of a gate and an up row times a
// route weight, w · ds4_swiglu1(g, u, c) — moe.cu's ds4_moe_act (and, with w = 1, ds4_swiglu:
// 1 · v is v) — computed while the input is quantized, so the activation never makes a
// round trip through memory and its launch disappears (docs/gpu.md §17).
struct Ds4XSwiglu {
    const float* g;
    const float* u;
    float c;
    float w;
};
// RMSNorm of x times the norm weight w, computed by the GEMV's block itself: the scale by
// ds4_rms_scale_as1024 (ds4_quant.h: bit for bit what ds4_rms_norm's one-row decode launch
// of 1024 threads computes) over the n inputs, then each value as ds4_rms_norm_row writes
// it, (x · s) · w (docs/gpu.md §17).
struct Ds4XNorm {
    const float* x;
    const float* w;
    float eps;
    float* h;  // non-null: the normalized vector is written here too (one block does it)
    float s;   // set by ds4_xin_begin
};
// Whatever an input needs from the whole vector before its values can be formed (all
// threads of the block call it; it may synchronize them).
__device__ __forceinline__ const float* ds4_xin_begin(const float* x, int) { return x; }
__device__ __forceinline__ Ds4XSwiglu ds4_xin_begin(const Ds4XSwiglu& x, int) { return x; }
__device__ __forceinline__ Ds4XNorm ds4_xin_begin(const Ds4XNorm& x, int n) {
    __shared__ double red[DS4_WARP + 1];
    Ds4XNorm r = x;
    r.s = ds4_rms_scale_as1024(x.x, n, x.eps, red);
    return r;
}
// Heads of head_dim values whose last rope_dim dims are rotated at position p on the way
// in: norm_rope.cu's ds4_rope expressions (the angle in double from (float)p · freq, the sine
// negated for the inverse rotation), so the values are those the separate launch writes
// (the attention output's de-rotation before out_a, docs/gpu.md §17). head_dim - rope_dim
// a multiple of 4, so a float4 never straddles the rotated part's edge.
struct Ds4XRope {
    const float* x;
    const float* freqs;
    int head_dim;
    int rope_dim;
    float p;
    int inverse;
};
__device__ __forceinline__ Ds4XRope ds4_xin_begin(const Ds4XRope& x, int) { return x; }
__device__ __forceinline__ void ds4_rope_pair(const Ds4XRope& x, int j, float& u, float& v) {
    const double ang = (double)(x.p * x.freqs[j]);
    const float c = (float)cos(ang);
    float s = (float)sin(ang);
    if (x.inverse) s = -s;
    const float a = u, b = v;
    // Rounded products, never contracted: the bits of ds4_rope's rotation (norm_rope.cu) in any
    // kernel that inlines it (a batched row equals the row decoded alone, docs/gpu.md §10).
    u = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}
__device__ __forceinline__ float4 ds4_xin4(const Ds4XRope& x, int i) {
    float4 v = ds4_ld_x4(x.x + i);
    const int d = i % x.head_dim, r0 = x.head_dim - x.rope_dim;
    if (d >= r0) {
        const int j = (d - r0) / 2;
        ds4_rope_pair(x, j, v.x, v.y);
        ds4_rope_pair(x, j + 1, v.z, v.w);
    }
    return v;
}

// Keeps the formed input values i..i+3 where the input asks for it (Ds4XNorm's h).
__device__ __forceinline__ void ds4_xin_keep(const float*, int, float4) {}
__device__ __forceinline__ void ds4_xin_keep(const Ds4XSwiglu&, int, float4) {}
__device__ __forceinline__ void ds4_xin_keep(const Ds4XRope&, int, float4) {}
__device__ __forceinline__ void ds4_xin_keep(const Ds4XNorm& x, int i, float4 v) {
    if (x.h) *(float4*)(x.h + i) = v;
}
__device__ __forceinline__ float4 ds4_xin4(const float* x, int i) { return ds4_ld_x4(x + i); }
__device__ __forceinline__ float4 ds4_xin4(const Ds4XNorm& x, int i) {
    const float4 v = ds4_ld_x4(x.x + i), g = ds4_ld_x4(x.w + i);
    return make_float4((v.x * x.s) * g.x, (v.y * x.s) * g.y, (v.z * x.s) * g.z, (v.w * x.s) * g.w);
}
__device__ __forceinline__ float4 ds4_xin4(const Ds4XSwiglu& s, int i) {
    const float4 g = ds4_ld_x4(s.g + i), u = ds4_ld_x4(s.u + i);
    return make_float4(s.w * ds4_swiglu1(g.x, u.x, s.c), s.w * ds4_swiglu1(g.y, u.y, s.c),
                       s.w * ds4_swiglu1(g.z, u.z, s.c), s.w * ds4_swiglu1(g.w, u.w, s.c));
}

// Lookup tables a format needs in shared memory (IQ2_XXS only).
struct Ds4Tables {
    const ds4_u64* grid;
    const ds4_u8* signs;
    // IQ2_XXS sign patterns as byte masks (0xFF per negated byte), for the int8 unit.
    const ds4_u64* smask;
    // Entry i of the grid is grid[i * gstride]: 1 for one shared table, the number of
    // copies where every lane reads a copy of its own (the int8 unit, below).
    int gstride = 1;
    // False when the launch lacked the dynamic shared memory the tables need: the engine
    // then reads no table and writes NaN rows (a missing size shows, never a wrong sum).
    bool ok = true;
    // IQ2_XXS lattice points and signs as byte-permute selectors (the int8 unit with
    // DS4_IQ2_PRMT, docs/gpu.md §32): entry i at gsel[i * gstride], ssel[i * gstride].
    const ds4_u32* gsel = nullptr;
    const ds4_u32* ssel = nullptr;
    // The levels the selectors pick from (+8, +25, +43, 0 and −8, −25, −43, 0), read from
    // the table like its entries so that they sit in ordinary registers: as constants the
    // compiler moved one into a register before every permute (whose first source must be
    // a register).
    ds4_u32 lv_lo = 0, lv_hi = 0;
};
// The selector tables' entries: 256 lattice points, 128 sign patterns, the two level words.
#define DS4_IQ2_SEL_ENTRIES (256 + 128 + 2)
#define DS4_IQ2_LEVELS_LO 0x002B1908u
#define DS4_IQ2_LEVELS_HI 0x00D5E7F8u
__device__ __forceinline__ ds4_u32 ds4_iq2_sel_entry(int e) {
    return e < 256   ? ds4_iq2xxs_grid_sel[e]
           : e < 384 ? ds4_iq2xxs_sign_sel[e - 256]
           : e == 384 ? DS4_IQ2_LEVELS_LO
                      : DS4_IQ2_LEVELS_HI;
}

// The input vector quantized to int8 blocks (docs: int8 activations): per 32 values a
// scale d (amax / 127) and 32 codes q = round(x / d); s16 holds the code sums of each 16
// values (the K-quants' min terms). All three live in shared memory; `at` advances to an
// element offset (a multiple of 32).
struct Ds4XQ {
    const ds4_i8* q;
    const float* d;
    const int* s16;
};
__device__ __forceinline__ const float* ds4_x_at(const float* x, ds4_size e) { return x + e; }
__device__ __forceinline__ Ds4XQ ds4_x_at(Ds4XQ x, ds4_size e) {
    return Ds4XQ{x.q + e, x.d + e / 32, x.s16 + e / 16};
}

// ---------------------------------------------------------------------------------------
// Block formats. Each describes: BE elements and BB bytes per block, UPB decode units per
// block, cb(R): blocks per staged chunk when a warp computes R rows at once (CB*BB a
// multiple of 16, CB*UPB a multiple of 32), and unit<R, CB>(): for one unit position u
// of the chunk, load x once and add each of the R rows' unit·x to acc[r]. Row r's chunk
// sits in shared memory at s + r*CB*BB; xc is x at the chunk's first element.
// ---------------------------------------------------------------------------------------

// Signed bytes of w (low 16 bits: two values) to floats, through the f32 magic 2^23 (exact,
// no int-to-float unit; it measured no different from a conversion, crates/ds4-gpu/NOTES.md).
__device__ __forceinline__ void ds4_i8x2(ds4_u32 w, float& lo, float& hi) {
    // (b ^ 0x80) is b + 128 as an unsigned byte; 0x4B000000 | v is the float 2^23 + v.
    const ds4_u32 u = w ^ 0x8080u;
    lo = __uint_as_float(0x4B000000u | (u & 0xffu)) - 8388736.0f;
    hi = __uint_as_float(0x4B000000u | ((u >> 8) & 0xffu)) - 8388736.0f;
}

// Q8_0 on the GPU is stored in the *split* layout (docs/gpu.md §7): each row of n_in values
// is its n_in int8 codes, then its n_in / 32 f16 scales (the same 34 bytes per 32 values as
// ggml's interleaved blocks, rearranged in place at load by ds4_q8_0_split in dequant.cu). The
// codes are then 16-byte aligned, so the row engine below loads them straight from global
// memory like F16 rows, with no staging through shared memory.
// Vectors in flight per row (ds4-gpu-check's sweep: crates/ds4-gpu/NOTES.md).
#define DS4_Q8S_DEPTH 2
// Widest x the f32-activation Q8_0 engine stages in shared memory (32 KB; wider inputs are
// read from global memory).
#define DS4_Q8S_XMAX 8192
struct Ds4Q8S {
    static constexpr int ROWS = DS4_ROWS_Q8_0;
    // Vectors (16 codes) per row each lane loads before the first use.
    static constexpr int DEPTH = DS4_Q8S_DEPTH;
};

// x[0..16) as four vectors (x is 16-byte aligned: the host checks).
struct Ds4X16 {
    float4 v[4];
};
__device__ __forceinline__ Ds4X16 ds4_ld_x16(const float* x) {
    return Ds4X16{{ds4_ld_x4(x), ds4_ld_x4(x + 4), ds4_ld_x4(x + 8), ds4_ld_x4(x + 12)}};
}

// Sum of the 16 codes of q times x[0..16) (the codes as exact floats through 2^23).
__device__ __forceinline__ float ds4_q8s_dot16(uint4 q, const Ds4X16& x) {
    const float4(&xv)[4] = x.v;
    const ds4_u32 w[4] = {q.x, q.y, q.z, q.w};
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float a, b, c, d;
        ds4_i8x2(w[k], a, b);
        ds4_i8x2(w[k] >> 16, c, d);
        s += a * xv[k].x;
        s += b * xv[k].y;
        s += c * xv[k].z;
        s += d * xv[k].w;
    }
    return s;
}

// Sum of code(k)·x[k] over four values whose 2- or 4-bit codes sit in the low bits of
// the four bytes of q (already shifted), masked with `mask`.
__device__ __forceinline__ float ds4_codes4(ds4_u32 q, ds4_u32 mask, float4 xv) {
    float s = (float)(q & mask) * xv.x;
    s += (float)((q >> 8) & mask) * xv.y;
    s += (float)((q >> 16) & mask) * xv.z;
    s += (float)((q >> 24) & mask) * xv.w;
    return s;
}

__device__ __forceinline__ float ds4_sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }

// Q2_K: 84-byte blocks of 256: scales u8[16] @0 (low nibble scale, high nibble min),
// qs u8[64] @16, d f16 @80, dmin f16 @82. Unit = sub-block sb of 16 values: value
// 16·sb + m has its code in bits 2j..2j+1 of qs[32h + 16·half + m], sb = 8h + 2j + half.
struct Ds4Q2K {
    static constexpr int BE = 256, BB = 84, UPB = 16;
    static constexpr int ROWS = DS4_ROWS_Q2_K;
    __host__ __device__ static constexpr int cb(int R) { return R == 1 ? 24 : R == 2 ? 12 : 4; }
    __device__ static Ds4Tables prologue() { return Ds4Tables{nullptr, nullptr}; }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const float* xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 4, sb = u & 15;
        const int h = sb >> 3, j = (sb >> 1) & 3, half = sb & 1;
        const float* xs = xc + b * BE + 16 * sb;
        const float4 x0 = ds4_ld_x4(xs), x1 = ds4_ld_x4(xs + 4);
        const float4 x2 = ds4_ld_x4(xs + 8), x3 = ds4_ld_x4(xs + 12);
        const float sx = (ds4_sum4(x0) + ds4_sum4(x1)) + (ds4_sum4(x2) + ds4_sum4(x3));
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk + 80);
            const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
            const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
            const ds4_u32 sc = blk[sb];
            const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
            float sqx = ds4_codes4(ds4_ld_u32(qs) >> (2 * j), 3u, x0);
            sqx += ds4_codes4(ds4_ld_u32(qs + 4) >> (2 * j), 3u, x1);
            sqx += ds4_codes4(ds4_ld_u32(qs + 8) >> (2 * j), 3u, x2);
            sqx += ds4_codes4(ds4_ld_u32(qs + 12) >> (2 * j), 3u, x3);
            acc[r] += d * (float)(sc & 15) * sqx - dmin * (float)(sc >> 4) * sx;
        }
    }
};

// Q4_K: 144-byte blocks of 256: d f16 @0, dmin f16 @2, 12 bytes of packed 6-bit scales and
// mins @4, qs u8[128] @16. Sub-block j (32 values) uses qs[32·(j/2) ..] shifted by
// 4·(j%2). Unit t = 2j + half = 16 values starting at element 16t.
struct Ds4Q4K {
    static constexpr int BE = 256, BB = 144, UPB = 16;
    static constexpr int ROWS = DS4_ROWS_Q4_K;
    __host__ __device__ static constexpr int cb(int R) { return R == 1 ? 14 : R == 2 ? 6 : 2; }
    __device__ static Ds4Tables prologue() { return Ds4Tables{nullptr, nullptr}; }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const float* xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 4, t = u & 15, j = t >> 1, half = t & 1;
        const float* xs = xc + b * BE + 16 * t;
        const float4 x0 = ds4_ld_x4(xs), x1 = ds4_ld_x4(xs + 4);
        const float4 x2 = ds4_ld_x4(xs + 8), x3 = ds4_ld_x4(xs + 12);
        const float sx = (ds4_sum4(x0) + ds4_sum4(x1)) + (ds4_sum4(x2) + ds4_sum4(x3));
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk);
            const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
            const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
            const ds4_u8* sp = blk + 4;
            int sci, mni;
            ds4_q4k_scale_min(sp, j, &sci, &mni);
            const ds4_u32 sc = (ds4_u32)sci, mn = (ds4_u32)mni;
            const uint4 qv = *(const uint4*)(blk + 16 + 32 * (j >> 1) + 16 * half);
            float sqx = ds4_codes4(qv.x >> shift, 15u, x0);
            sqx += ds4_codes4(qv.y >> shift, 15u, x1);
            sqx += ds4_codes4(qv.z >> shift, 15u, x2);
            sqx += ds4_codes4(qv.w >> shift, 15u, x3);
            acc[r] += d * (float)sc * sqx - dmin * (float)mn * sx;
        }
    }
};

// IQ2_XXS: 66-byte blocks of 256: d f16 @0, then per group g (32 values) two u32 at 2+8g:
// w0 = four 8-bit grid indices, w1 = four 7-bit sign indices (bits 7k..) and a 4-bit scale
// (bits 28..31). Unit t = 4g + k = 8 values starting at element 8t.
struct Ds4Iq2Xxs {
    static constexpr int BE = 256, BB = 66, UPB = 32;
    static constexpr int ROWS = DS4_ROWS_IQ2_XXS;
    __host__ __device__ static constexpr int cb(int R) { return R == 1 ? 32 : R == 2 ? 16 : 8; }
    __device__ static Ds4Tables prologue() {
        __shared__ ds4_u64 grid[256];
        __shared__ ds4_u8 signs[128];
        for (int i = threadIdx.x; i < 256; i += DS4_GEMV_THREADS) grid[i] = ds4_iq2xxs_grid[i];
        for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS) signs[i] = ds4_iq2xxs_ksigns[i];
        __syncthreads();
        return Ds4Tables{grid, signs};
    }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const float* xc, Ds4Tables tb,
                                float (&acc)[R]) {
        const int b = u >> 5, t = u & 31, g = t >> 2, k = t & 3;
        const float* xs = xc + b * BE + 8 * t;
        const float4 xa = ds4_ld_x4(xs);
        const float4 xb = ds4_ld_x4(xs + 4);
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const float d = ds4_h2f(ds4_ld_u16(blk));
            const ds4_u8* gp = blk + 2 + 8 * g;
            const ds4_u32 idx = gp[k];
            const ds4_u32 w1 =
                (ds4_u32)ds4_ld_u16(gp + 4) | ((ds4_u32)ds4_ld_u16(gp + 6) << 16);
            const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
            const ds4_u64 grid = tb.grid[idx];
            const ds4_u32 sg = tb.signs[(w1 >> (7 * k)) & 127];
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                // Grid bytes are 8, 25 or 43: below 2^8, so the magic-number conversion
                // is exact; the sign goes straight into the float's sign bit.
                const ds4_u32 gb = (ds4_u32)(grid >> (8 * e)) & 0xff;
                const float gv = __uint_as_float(0x4B000000u | gb) - 8388608.0f;
                const ds4_u32 neg = ((sg >> e) & 1u) << 31;
                sum += __uint_as_float(__float_as_uint(gv) ^ neg) * xv[e];
            }
            acc[r] += db * sum;
        }
    }
};

// MXFP4 (docs/gguf.md §6): 17-byte blocks of 32: an E8M0 scale byte e @0, then 16 bytes of
// E2M1 codes, value j < 16 the low nibble of byte 1 + j and value j + 16 its high nibble.
// ggml's values are the E2M1 values doubled (integers: 0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives for codes 8..15, code 8 being +0), the scale halved: y = 2^(e-128) · kv. One
// unit is one block. Blocks are 17 bytes, so the staged bytes are read one at a time (no
// alignment to lean on); a chunk of 32 blocks is 544 bytes, whole 16-byte vectors, and
// n_in a multiple of 512 keeps every row 16-byte aligned (the host checks it).
//
// ds4_e8m0_half and ds4_mxfp4_kv (the scale and the doubled E2M1 values): ds4_quant.h.
struct Ds4Mxfp4 {
    static constexpr int BE = 32, BB = 17, UPB = 1;
    static constexpr int ROWS = DS4_ROWS_MXFP4;
    // A full chunk must give every lane a unit: 32 blocks (544 bytes) at any R.
    __host__ __device__ static constexpr int cb(int) { return 32; }
    __device__ static Ds4Tables prologue() { return Ds4Tables{nullptr, nullptr}; }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const float* xc, Ds4Tables,
                                float (&acc)[R]) {
        const float* xs = xc + u * BE;
        float xv[32];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float4 v = ds4_ld_x4(xs + 4 * k);
            xv[4 * k] = v.x;
            xv[4 * k + 1] = v.y;
            xv[4 * k + 2] = v.z;
            xv[4 * k + 3] = v.w;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + u * BB;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const ds4_u32 q = blk[1 + j];
                sum += (float)ds4_mxfp4_kv(q & 15u) * xv[j] + (float)ds4_mxfp4_kv(q >> 4) * xv[j + 16];
            }
            acc[r] += ds4_e8m0_half(blk[0]) * sum;
        }
    }
};

// ---------------------------------------------------------------------------------------
// Row engine for block formats: one warp computes R consecutive rows (x is loaded once
// for all R), chunk by chunk.
// ---------------------------------------------------------------------------------------

template <class T, int CB, int V>
__device__ __forceinline__ void ds4_load_chunk(const ds4_u8* __restrict__ row, int c,
                                               int nblocks, int lane, uint4 (&r)[V]) {
    const int b0 = c * CB;
    const int nb = min(CB, nblocks - b0);
    const int nvec = nb * T::BB / 16;
    const uint4* src = (const uint4*)(row + (ds4_size)b0 * T::BB);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int i = lane + DS4_WARP * v;
        if (i < nvec) r[v] = ds4_ldg(src + i);
    }
}

// The chunk of R rows held in registers into the warp's shared stage (vectors past the
// chunk's nvec are not stored).
template <int R, int V, int VEC>
__device__ __forceinline__ void ds4_stage_chunk(uint4* stage, const uint4 (&regs)[R][V], int nvec,
                                                int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int i = lane + DS4_WARP * v;
            if (i < nvec) stage[r * VEC + i] = regs[r][v];
        }
    }
}

// This lane's units of a staged chunk of nb blocks (CB when full) times x at the chunk.
template <class T, int R, int CB, class XT>
__device__ __forceinline__ void ds4_chunk_units(const ds4_u8* sbytes, int nb, int lane, const XT xc,
                                                Ds4Tables tb, float (&acc)[R]) {
    constexpr int UPL = CB * T::UPB / DS4_WARP;  // units per lane in a full chunk
    if (nb == CB) {
        DS4_UNROLL(DS4_GEMV_UNROLL)
        for (int k = 0; k < UPL; ++k) T::template unit<R, CB>(sbytes, lane + DS4_WARP * k, xc, tb, acc);
    } else {
        const int nu = nb * T::UPB;
        for (int u = lane; u < nu; u += DS4_WARP) T::template unit<R, CB>(sbytes, u, xc, tb, acc);
    }
}

// This lane's shares of rows[r]·x (r < R) over the chunks owned by warp `part` of `wpr`.
// rows r >= nvalid repeat the last valid row (their sums are discarded by the caller).
template <class T, int R, class XT>
__device__ __forceinline__ void ds4_rows_partial(const ds4_u8* __restrict__ row0,
                                                 ds4_size row_bytes, int nvalid,
                                                 const XT x, int n_in,
                                                 int part, int wpr, uint4* stage,
                                                 Ds4Tables tb, float (&acc)[R]) {
    constexpr int CB = T::cb(R);
    constexpr int VEC = CB * T::BB / 16;
    constexpr int V = (VEC + DS4_WARP - 1) / DS4_WARP;
    static_assert((CB * T::BB) % 16 == 0, "chunk must be whole 16-byte vectors");
    static_assert((CB * T::UPB) % DS4_WARP == 0, "full chunk must split evenly");
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int nblocks = n_in / T::BE;
    const int nchunks = (nblocks + CB - 1) / CB;
    const ds4_u8* sbytes = (const ds4_u8*)stage;
    const ds4_u8* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = row0 + (ds4_size)max(min(r, nvalid - 1), 0) * row_bytes;
    uint4 regs[R][V];
    int c = part;
    if (c < nchunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) ds4_load_chunk<T, CB, V>(rows[r], c, nblocks, lane, regs[r]);
    }
    // Only weights (never written by a kernel) are read before this point.
    ds4_grid_wait();
    for (; c < nchunks; c += wpr) {
        const int b0 = c * CB;
        const int nb = min(CB, nblocks - b0);
        ds4_stage_chunk<R, V, VEC>(stage, regs, nb * T::BB / 16, lane);
        ds4_syncwarp();
        if (c + wpr < nchunks) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                ds4_load_chunk<T, CB, V>(rows[r], c + wpr, nblocks, lane, regs[r]);
        }
        ds4_chunk_units<T, R, CB>(sbytes, nb, lane, ds4_x_at(x, (ds4_size)b0 * T::BE), tb, acc);
        ds4_syncwarp();
    }
}

// Reduce the lanes' partial sums of R rows and write y[row0 + r] for r < R and
// row0 + r < n_out: NaN when !ok (bad expert id).
template <int R>
__device__ __forceinline__ void ds4_finish_rows(float (&acc)[R], float* __restrict__ y,
                                                int row0, int n_out, int wpr, bool ok) {
    __shared__ float part_sums[DS4_GEMV_WARPS][R];
    ds4_grid_wait();  // a no-op when the row engine waited already
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = ds4_warp_sum(acc[r]);
    if (wpr == 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (row0 + r < n_out) y[row0 + r] = ok ? acc[r] : __int_as_float(0x7fc00000);
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) part_sums[warp][r] = acc[r];
    }
    __syncthreads();
    if (part == 0 && lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float total = 0.f;
            for (int p = 0; p < wpr; ++p) total += part_sums[warp + p][r];
            if (row0 + r < n_out) y[row0 + r] = ok ? total : __int_as_float(0x7fc00000);
        }
    }
}

// ds4_finish_rows for columns c < n_cols of acc at once (the several-column GEMVs of a
// batched decode step): each column's lane sums go through the same shuffle tree and its
// warps' parts are added in the same order (so each column gets ds4_finish_rows's bits), with
// one block barrier for all columns instead of one per column — at 8 columns the per-column
// barriers had made the Q8_0 several-column kernel 4x the one-token kernel's time for 8x its
// work (profile: BENCHMARKS.md). The caller synchronises before the next step rewrites
// the parts.
//
// The lanes' sums of all MC·R values go through one spreading reduction (measured against a
// ds4_warp_sum per value: BENCHMARKS.md, "Spreading reduction in the several-column GEMVs"):
// at each of the first
// log2(MC·R) masks of the butterfly a lane keeps half of its values and hands the other half
// to its partner, which adds them to its own — the same two partial sums the butterfly adds at
// that mask (own + partner's; float addition commutes exactly) — so every value ends with
// ds4_warp_sum's bits, in the lanes lane >> S == its index, after MC·R − 1 + S shuffles
// instead of 5·MC·R (16 values: 16 instead of 80). At eight columns and one unit per lane and
// row (most matrices of a batched step, docs/gpu.md §30) the per-value butterflies were as
// many instructions as the dot products they finish.
__host__ __device__ constexpr int ds4_ilog2(int v) { return v <= 1 ? 0 : 1 + ds4_ilog2(v / 2); }

// v[0] afterwards: the warp sum of value lane >> (log2(DS4_WARP) − log2 V) (see above).
template <int V>
__device__ __forceinline__ float ds4_warp_sum_spread(float (&v)[V]) {
    static_assert(V >= 1 && V <= DS4_WARP && (V & (V - 1)) == 0, "a power of two, one per lane");
    const int lane = threadIdx.x & (DS4_WARP - 1);
#pragma unroll
    for (int m = DS4_WARP / 2, count = V; m > 0; m >>= 1) {
        if (count > 1) {
            const int half = count / 2;
            const bool hi = (lane & m) != 0;
#pragma unroll
            for (int i = 0; i < V / 2; ++i) {
                if (i < half) {
                    const float send = hi ? v[i] : v[i + half];
                    const float keep = hi ? v[i + half] : v[i];
                    v[i] = keep + ds4_shfl_xor(send, m);
                }
            }
            count = half;
        } else {
            v[0] += ds4_shfl_xor(v[0], m);
        }
    }
    return v[0];
}

template <int R, int MC>
__device__ __forceinline__ void ds4_finish_cols(float (&acc)[MC][R], float* __restrict__ y,
                                                ds4_size y_stride, int row0, int n_out, int wpr,
                                                int n_cols) {
    static_assert(MC * R <= DS4_WARP, "one lane per (column, row) adds the parts");
    __shared__ float part_c[DS4_GEMV_WARPS][MC][R];
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    constexpr int V = MC * R;
    constexpr int S = ds4_ilog2(DS4_WARP) - ds4_ilog2(V);
    float v[V];
#pragma unroll
    for (int c = 0; c < MC; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r) v[c * R + r] = acc[c][r];
    const float sum = ds4_warp_sum_spread<V>(v);
    const int idx = lane >> S, c_of = idx / R, r_of = idx % R;
    const bool writes = (lane & ((1 << S) - 1)) == 0 && c_of < n_cols;
    if (wpr == 1) {
        if (writes && row0 + r_of < n_out) y[(ds4_size)c_of * y_stride + row0 + r_of] = sum;
        return;
    }
    if (writes) part_c[warp][c_of][r_of] = sum;
    __syncthreads();
    if (part == 0 && lane < n_cols * R) {
        const int c = lane / R, r = lane % R;
        float total = 0.f;
        for (int p = 0; p < wpr; ++p) total += part_c[warp + p][c][r];
        if (row0 + r < n_out) y[(ds4_size)c * y_stride + row0 + r] = total;
    }
}

template <class T>
__device__ __forceinline__ void ds4_gemv_quant(const ds4_u8* __restrict__ W,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int n_in, int n_out,
                                               int wpr, bool ok) {
    constexpr int R = T::ROWS;
    constexpr int VEC = T::cb(R) * T::BB / 16;
    __shared__ uint4 stage[DS4_GEMV_WARPS][R * VEC];
    const Ds4Tables tb = T::prologue();
    const int warp = threadIdx.x / DS4_WARP;
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const ds4_size row_bytes = (ds4_size)(n_in / T::BE) * T::BB;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    if (ok && row0 < n_out) {
        ds4_rows_partial<T, R>(W + (ds4_size)row0 * row_bytes, row_bytes, min(R, n_out - row0),
                               x, n_in, warp % wpr, wpr, stage[warp], tb, acc);
    }
    ds4_finish_rows<R>(acc, y, row0, n_out, wpr, ok);
}
