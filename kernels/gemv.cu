// gemv.cu: batch-1 matrix-vector products y = W x for every ds4 weight type.
//
// W is a row-major [n_out][n_in] matrix in ggml layout: one row of n_in elements is n_in/BE
// consecutive blocks of the row's type. x and y are f32. Accumulation is f32 throughout.
//
// Work split. A block of 256 threads holds 8 logical warps. One warp computes R
// consecutive rows (R = T::ROWS per block format, DS4_GEMV_PLAIN_ROWS for F16/F32),
// so each x value it loads serves R rows. `wpr` warps (1, 2, 4 or 8, chosen by the host so
// that small-n_out matrices still fill the GPU) share one group of R rows: the rows are cut
// into chunks and warp `part` takes chunks part, part+wpr, ... . Partial sums are reduced
// with warp shuffles, then across the group's warps through shared memory, and exactly one
// thread writes each y[row]. Every row < n_out is written on every launch, also when its
// inputs are invalid (then with NaN), so a poisoned output buffer shows any row missed.
//
// Memory access. Rows of the block formats are streamed in chunks of CB blocks whose byte
// size is a multiple of 16: each lane issues 16-byte loads (consecutive lanes, consecutive
// addresses), the chunk is staged in the warp's slice of shared memory, and lanes decode
// "units" (8 or 16 consecutive elements of one block) from there. The next chunk's loads
// are issued before the current chunk is decoded, so a warp keeps ~2 KB in flight. F16
// and F32 rows need no staging: a 16-byte vector holds whole elements.
//
// Host contract (checked in Rust before every launch): n_in is a multiple of the type's
// block size and the row size in bytes is a multiple of 16; W, x and y are 16-byte aligned
// and hold n_out rows, n_in and n_out floats.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"

#define DS4_GEMV_THREADS 256
#define DS4_GEMV_WARPS (DS4_GEMV_THREADS / DS4_WARP)

// Tuning knobs. The defaults are per format, from the H200 sweeps in
// crates/ds4-gpu/NOTES.md (split-layout Q8_0: 2 rows x 2 vectors in flight, the fastest
// variant without register spills, 2026-12-04): rows per warp R (x loaded once for R rows) and the minimum
// resident blocks per multiprocessor (caps registers: 4 -> 64, 2 -> 128 per thread).
// -DDS4_GEMV_ROWS=n / -DDS4_GEMV_MIN_BLOCKS=n override every block format at once (the
// check tool's sweeps); -DDS4_GEMV_PLAIN_ROWS=n sets F16/F32.
#ifdef DS4_GEMV_ROWS
#define DS4_ROWS_Q8_0 DS4_GEMV_ROWS
#define DS4_ROWS_Q2_K DS4_GEMV_ROWS
#define DS4_ROWS_Q4_K DS4_GEMV_ROWS
#define DS4_ROWS_IQ2_XXS DS4_GEMV_ROWS
#else
#define DS4_ROWS_Q8_0 2
#define DS4_ROWS_Q2_K 2
#define DS4_ROWS_Q4_K 2
// -DDS4_IQ2_ROWS=n: IQ2_XXS alone (an A/B of the routed gate/up GEMV, docs/gpu.md §20).
#ifdef DS4_IQ2_ROWS
#define DS4_ROWS_IQ2_XXS DS4_IQ2_ROWS
#else
#define DS4_ROWS_IQ2_XXS 2
#endif
#endif
#ifdef DS4_GEMV_MIN_BLOCKS
#define DS4_MINB_PLAIN DS4_GEMV_MIN_BLOCKS
#define DS4_MINB_Q8_0 DS4_GEMV_MIN_BLOCKS
#define DS4_MINB_Q2_K DS4_GEMV_MIN_BLOCKS
#define DS4_MINB_Q4_K DS4_GEMV_MIN_BLOCKS
#define DS4_MINB_IQ2_XXS DS4_GEMV_MIN_BLOCKS
#else
#define DS4_MINB_PLAIN 4
#define DS4_MINB_Q8_0 4
#define DS4_MINB_Q2_K 2
#define DS4_MINB_Q4_K 2
#define DS4_MINB_IQ2_XXS 2
#endif
// Most columns (tokens of different sequences) of the several-column GEMVs (batched decode).
#ifndef DS4_Q8M_COLS
#define DS4_Q8M_COLS 8
#endif
#ifndef DS4_GEMV_UNROLL
#define DS4_GEMV_UNROLL 8
#endif
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
// route weight, w · ds4_swiglu1(g, u, c) — ops.cu's ds4_moe_act (and, with w = 1, ds4_swiglu:
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
// in: ops.cu's ds4_rope expressions (the angle in double from (float)p · freq, the sine
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
    // Rounded products, never contracted: the bits of ds4_rope's rotation (ops.cu) in any
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

// Byte b of w as a float: through the f32 magic 2^23 (exact, no int-to-float unit) or
// through a conversion, selectable for measurements with -DDS4_Q8_MAGIC=0/1.
#ifndef DS4_Q8_MAGIC
#define DS4_Q8_MAGIC 1
#endif

// Signed bytes of w (low 16 bits: two values) to floats.
__device__ __forceinline__ void ds4_i8x2(ds4_u32 w, float& lo, float& hi) {
#if DS4_Q8_MAGIC
    // (b ^ 0x80) is b + 128 as an unsigned byte; 0x4B000000 | v is the float 2^23 + v.
    const ds4_u32 u = w ^ 0x8080u;
    lo = __uint_as_float(0x4B000000u | (u & 0xffu)) - 8388736.0f;
    hi = __uint_as_float(0x4B000000u | ((u >> 8) & 0xffu)) - 8388736.0f;
#else
    lo = (float)(ds4_i8)(w & 0xff);
    hi = (float)(ds4_i8)((w >> 8) & 0xff);
#endif
}

// Q8_0 on the GPU is stored in the *split* layout (docs/gpu.md §7): each row of n_in values
// is its n_in int8 codes, then its n_in / 32 f16 scales (the same 34 bytes per 32 values as
// ggml's interleaved blocks, rearranged in place at load by ds4_q8_0_split in ops.cu). The
// codes are then 16-byte aligned, so the row engine below loads them straight from global
// memory like F16 rows, with no staging through shared memory.
#ifndef DS4_Q8S_DEPTH
#define DS4_Q8S_DEPTH 2
#endif
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
// work (H100 profile, BENCHMARKS.md). The caller synchronises before the next step rewrites
// the parts.
//
// The lanes' sums of all MC·R values go through one spreading reduction (default;
// -DDS4_FINISH_SPREAD=0 reduces each value with ds4_warp_sum, A/B): at each of the first
// log2(MC·R) masks of the butterfly a lane keeps half of its values and hands the other half
// to its partner, which adds them to its own — the same two partial sums the butterfly adds at
// that mask (own + partner's; float addition commutes exactly) — so every value ends with
// ds4_warp_sum's bits, in the lanes lane >> S == its index, after MC·R − 1 + S shuffles
// instead of 5·MC·R (16 values: 16 instead of 80). At eight columns and one unit per lane and
// row (most matrices of a batched step, docs/gpu.md §30) the per-value butterflies were as
// many instructions as the dot products they finish.
#ifndef DS4_FINISH_SPREAD
#define DS4_FINISH_SPREAD 1
#endif
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
#if DS4_FINISH_SPREAD
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
#else
#pragma unroll
    for (int c = 0; c < MC; ++c)
        if (c < n_cols) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[c][r] = ds4_warp_sum(acc[c][r]);
        }
    if (wpr == 1) {
        if (lane == 0) {
#pragma unroll
            for (int c = 0; c < MC; ++c)
                if (c < n_cols) {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        if (row0 + r < n_out) y[(ds4_size)c * y_stride + row0 + r] = acc[c][r];
                }
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < MC; ++c)
            if (c < n_cols) {
#pragma unroll
                for (int r = 0; r < R; ++r) part_c[warp][c][r] = acc[c][r];
            }
    }
#endif
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

// ---------------------------------------------------------------------------------------
// Plain formats (F32, F16): a 16-byte vector is 4 or 8 whole elements. A warp computes
// DS4_GEMV_PLAIN_ROWS rows, loading each x vector once for all of them.
// ---------------------------------------------------------------------------------------

#ifndef DS4_GEMV_PLAIN_ROWS
#define DS4_GEMV_PLAIN_ROWS 2
#endif

struct Ds4F32 {
    static constexpr int EPV = 4;
    struct X {
        float4 a;
    };
    __device__ static X ldx(const float* x) { return X{ds4_ld_x4(x)}; }
    __device__ static float vdot(uint4 a, const X& x) {
        return __uint_as_float(a.x) * x.a.x + __uint_as_float(a.y) * x.a.y +
               __uint_as_float(a.z) * x.a.z + __uint_as_float(a.w) * x.a.w;
    }
};

struct Ds4F16 {
    static constexpr int EPV = 8;
    struct X {
        float4 a, b;
    };
    __device__ static X ldx(const float* x) { return X{ds4_ld_x4(x), ds4_ld_x4(x + 4)}; }
    __device__ static float vdot(uint4 a, const X& x) {
        float s = ds4_h2f((ds4_u16)(a.x & 0xffff)) * x.a.x;
        s += ds4_h2f((ds4_u16)(a.x >> 16)) * x.a.y;
        s += ds4_h2f((ds4_u16)(a.y & 0xffff)) * x.a.z;
        s += ds4_h2f((ds4_u16)(a.y >> 16)) * x.a.w;
        s += ds4_h2f((ds4_u16)(a.z & 0xffff)) * x.b.x;
        s += ds4_h2f((ds4_u16)(a.z >> 16)) * x.b.y;
        s += ds4_h2f((ds4_u16)(a.w & 0xffff)) * x.b.z;
        s += ds4_h2f((ds4_u16)(a.w >> 16)) * x.b.w;
        return s;
    }
};

template <class T>
__device__ __forceinline__ void ds4_gemv_plain(const ds4_u8* __restrict__ W,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int n_in, int n_out,
                                               int wpr, bool ok) {
    constexpr int R = DS4_GEMV_PLAIN_ROWS;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const int nvec = n_in / T::EPV;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    if (ok && row0 < n_out) {
        const uint4* w[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            w[r] = (const uint4*)(W + (ds4_size)min(row0 + r, n_out - 1) * (ds4_size)nvec * 16);
        const int stride = DS4_WARP * wpr;
        int i = (warp % wpr) * DS4_WARP + lane;
        // Four vectors per row in flight per lane before the first use; the first ones
        // are issued before the wait for the previous kernel (weights only).
        bool waited = false;
        for (; i + 3 * stride < nvec; i += 4 * stride) {
            uint4 a[R][4];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int k = 0; k < 4; ++k) a[r][k] = ds4_ldg(w[r] + i + k * stride);
            if (!waited) {
                ds4_grid_wait();
                waited = true;
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const typename T::X xv = T::ldx(x + (ds4_size)(i + k * stride) * T::EPV);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += T::vdot(a[r][k], xv);
            }
        }
        ds4_grid_wait();
        for (; i < nvec; i += stride) {
            const typename T::X xv = T::ldx(x + (ds4_size)i * T::EPV);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += T::vdot(ds4_ldg(w[r] + i), xv);
        }
    }
    ds4_finish_rows<R>(acc, y, row0, n_out, wpr, ok);
}

// The plain engine for a few independent columns (batched decode of F16/F32 matrices):
// each weight vector is loaded once and multiplied with every column's x; per column the
// per-lane order (vectors i, i + stride, ... in turn) and the reduction are ds4_gemv_plain's,
// so with the same warps per row each column's rows are bit-for-bit the one-token kernel's.
//
// Rows per warp (docs/gpu.md §35): x is read through L2 (ds4_ld_act), once per warp and
// column, so at MC columns and R rows a warp reads 4·MC / (R·sizeof(w)) bytes of x per byte
// of weights — 8 for F16 at the one-token kernel's two rows, which made the F16 matrices of
// an 8-sequence step run at a tenth of the bandwidth. A row's sum does not depend on which
// rows its warp takes with it, so this kernel takes DS4_PLAIN_COLS_ROWS rows per warp (the
// host sizes the grid from ds4_gemv_cols_rows); the next step's weight vectors are loaded
// right after this step's use (the order of the sums is unchanged).
#ifndef DS4_PLAIN_COLS_ROWS
#define DS4_PLAIN_COLS_ROWS 8
#endif
// {rows per warp of ds4_gemv_cols_<t>, 0}: read by the host (a pair, as its other globals).
extern "C" __device__ const int ds4_gemv_cols_rows[2] = {DS4_PLAIN_COLS_ROWS, 0};
template <class T>
__device__ __forceinline__ void ds4_gemv_plain_cols(const ds4_u8* __restrict__ W,
                                                    const float* __restrict__ x,
                                                    ds4_size x_stride, float* __restrict__ y,
                                                    ds4_size y_stride, int n_in, int n_out,
                                                    int n_cols, int wpr) {
    constexpr int R = DS4_PLAIN_COLS_ROWS, MC = DS4_Q8M_COLS;
    static_assert(R >= 1, "rows per warp");
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const int nvec = n_in / T::EPV;
    const bool ok = n_cols >= 1 && n_cols <= MC;
    float acc[MC][R];
#pragma unroll
    for (int c = 0; c < MC; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[c][r] = 0.f;
    if (ok && row0 < n_out) {
        const uint4* const w0 = (const uint4*)(W + (ds4_size)row0 * (ds4_size)nvec * 16);
        // Row r's vectors (rows past the end read the last row; their sums are not written).
        auto wv = [&](int r, int i) { return ds4_ldg(w0 + min(r, n_out - 1 - row0) * nvec + i); };
        const int stride = DS4_WARP * wpr;
        const int i0 = (warp % wpr) * DS4_WARP + lane;
        uint4 a[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (i0 < nvec) a[r] = wv(r, i0);
        ds4_grid_wait();  // only weights were read so far (docs/gpu.md §6)
        for (int i = i0; i < nvec; i += stride) {
#pragma unroll
            for (int c = 0; c < MC; ++c) {
                if (c < n_cols) {
                    const typename T::X xv =
                        T::ldx(x + (ds4_size)c * x_stride + (ds4_size)i * T::EPV);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[c][r] += T::vdot(a[r], xv);
                }
            }
            if (i + stride < nvec) {
#pragma unroll
                for (int r = 0; r < R; ++r) a[r] = wv(r, i + stride);
            }
        }
    }
    ds4_grid_wait();  // a no-op where the loads above waited already
    // -DDS4_PLAIN_COLS_FINISH1=0: a barrier per column (A/B).
#ifndef DS4_PLAIN_COLS_FINISH1
#define DS4_PLAIN_COLS_FINISH1 1
#endif
    if (ok && DS4_PLAIN_COLS_FINISH1) {
        // Every column's rows as ds4_finish_rows writes them (docs/gpu.md §26), FR rows at a
        // time (one lane per column and row adds the warps' parts).
        constexpr int FR = R < DS4_WARP / MC ? R : DS4_WARP / MC;
        static_assert(R % FR == 0, "rows per warp: a multiple of the rows finished at once");
#pragma unroll
        for (int h = 0; h < R; h += FR) {
            float part[MC][FR];
#pragma unroll
            for (int c = 0; c < MC; ++c)
#pragma unroll
                for (int r = 0; r < FR; ++r) part[c][r] = acc[c][h + r];
            if (h > 0) __syncthreads();  // the parts of the previous rows have been added
            ds4_finish_cols<FR, MC>(part, y, y_stride, row0 + h, n_out, wpr, n_cols);
        }
        return;
    }
    // Unrolled, so that acc stays in registers (a column index known only at run time
    // would put it in local memory); n_cols is the same for the whole block.
#pragma unroll
    for (int c = 0; c < MC; ++c) {
        if (c < max(1, min(n_cols, MC))) {
            ds4_finish_rows<R>(acc[c], y + (ds4_size)c * y_stride, row0, n_out, wpr, ok);
            __syncthreads();  // part_sums are rewritten by the next column
        }
    }
}

// Split-layout Q8_0 rows (Ds4Q8S): a warp computes R rows; each lane takes 16-code vectors
// i, i + stride, ... with DEPTH of them per row loaded before the first use, the vector's
// scale (shared by two lanes) beside it, and x (16 floats) once for all R rows.
template <class T>
__device__ __forceinline__ void ds4_gemv_q8s(const ds4_u8* __restrict__ W,
                                             const float* __restrict__ x,
                                             float* __restrict__ y, int n_in, int n_out,
                                             int wpr, bool ok) {
    constexpr int R = T::ROWS, D = T::DEPTH;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nvec = n_in / 16;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    // x staged once per block in shared memory: read from global memory per warp it cost
    // 4 bytes of x per byte of weights, from L1 before the coherent loads of docs/gpu.md §6
    // (the L1 pipe 93 % busy, ncu) and from L2 after them (decode 56.6 tok/s with Q8_0 on
    // f32 activations). The int8 default does not use this engine at decode (§8).
    __shared__ __align__(16) float xsh[DS4_Q8S_XMAX];
    const bool staged = n_in <= DS4_Q8S_XMAX;
    ds4_grid_wait();
    if (staged) {
        for (int e = 4 * (int)threadIdx.x; e < n_in; e += 4 * (int)blockDim.x)
            *(float4*)(xsh + e) = ds4_ld_act((const float4*)(x + e));
        __syncthreads();
    }
    auto ldx = [&](int v) -> Ds4X16 {
        if (staged) {
            const float4* p = (const float4*)(xsh + 16 * v);
            return Ds4X16{{p[0], p[1], p[2], p[3]}};
        }
        return ds4_ld_x16(x + (ds4_size)v * 16);
    };
    if (ok && row0 < n_out) {
        const ds4_u8* rows[R];
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = W + (ds4_size)min(row0 + r, n_out - 1) * row_bytes;
        const int stride = DS4_WARP * wpr;
        int i = (warp % wpr) * DS4_WARP + lane;
        bool waited = false;
        for (; i + (D - 1) * stride < nvec; i += D * stride) {
            uint4 q[R][D];
            ds4_u16 sc[R][D];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int k = 0; k < D; ++k) {
                    const int v = i + k * stride;
                    q[r][k] = ds4_ldg((const uint4*)rows[r] + v);
                    sc[r][k] = ds4_ldg((const ds4_u16*)(rows[r] + n_in) + (v >> 1));
                }
            // Only weights were read so far (overlapped launches, docs/gpu.md §6).
            if (!waited) {
                ds4_grid_wait();
                waited = true;
            }
#pragma unroll
            for (int k = 0; k < D; ++k) {
                const Ds4X16 xv = ldx(i + k * stride);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += ds4_h2f(sc[r][k]) * ds4_q8s_dot16(q[r][k], xv);
            }
        }
        ds4_grid_wait();
        for (; i < nvec; i += stride) {
            const Ds4X16 xv = ldx(i);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 q = ds4_ldg((const uint4*)rows[r] + i);
                const ds4_u16 sc = ds4_ldg((const ds4_u16*)(rows[r] + n_in) + (i >> 1));
                acc[r] += ds4_h2f(sc) * ds4_q8s_dot16(q, xv);
            }
        }
    }
    ds4_finish_rows<R>(acc, y, row0, n_out, wpr, ok);
}

// The split-layout Q8_0 row engine with an asynchronous-copy ring (an alternative, see
// DS4_Q8S_REGS below): each
// warp streams its rows' 16-code vectors (and the matching scales) into its own slice of
// shared memory S stages ahead with cp.async, so the bytes in flight are bounded by shared
// memory, not by registers (the register version, ds4_gemv_q8s, could keep only two vectors
// per row in flight at 64 registers and read the big matrices at 40-55 % of the copy
// bandwidth on the H200). A stage of warp `part` is chunk c = part + j * wpr: vectors
// 32c .. 32c+31 of each row (lane l takes vector 32c + l) and the 16 scales of those
// vectors' blocks (copied by lanes 0 and 1). HIP and the CPU emulation copy synchronously.
#ifndef DS4_Q8A_STAGES
#define DS4_Q8A_STAGES 4
#endif
template <class T>
__device__ __forceinline__ void ds4_gemv_q8a(const ds4_u8* __restrict__ W,
                                             const float* __restrict__ x,
                                             float* __restrict__ y, int n_in, int n_out,
                                             int wpr, bool ok) {
    constexpr int R = T::ROWS, S = DS4_Q8A_STAGES;
    __shared__ __align__(16) uint4 ring[DS4_GEMV_WARPS][S][R][DS4_WARP];
    __shared__ __align__(16) ds4_u16 scl[DS4_GEMV_WARPS][S][R][16];
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nvec = n_in / 16, nblk = n_in / 32;
    const int nch = (nvec + DS4_WARP - 1) / DS4_WARP;
    const int mine = part < nch ? (nch - part + wpr - 1) / wpr : 0;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    const bool active = ok && row0 < n_out;
    const ds4_u8* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
        rows[r] = W + (active ? (ds4_size)min(row0 + r, n_out - 1) * row_bytes : 0);
    // Queues stage j (chunk part + j * wpr) into slot j % S; always commits a group, so
    // that group j is the j-th this thread committed.
    auto issue = [&](int j) {
        if (active && j < mine) {
            const int c = part + j * wpr, slot = j % S;
            const int v = c * DS4_WARP + lane;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const bool okv = v < nvec;
                ds4_cp_async16(&ring[warp][slot][r][lane],
                               rows[r] + (okv ? (ds4_size)v * 16 : 0), okv);
                if (lane < 2) {
                    const bool oks = c * 16 + lane * 8 < nblk;
                    ds4_cp_async16(&scl[warp][slot][r][lane * 8],
                                   rows[r] + n_in + (oks ? (ds4_size)c * 32 + lane * 16 : 0), oks);
                }
            }
        }
        ds4_cp_commit();
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);
    // Only weights were read so far (overlapped launches, docs/gpu.md §6).
    ds4_grid_wait();
    for (int j = 0; j < mine; ++j) {
        issue(j + S - 1);
        ds4_cp_wait<S - 1>();
        ds4_syncwarp();  // the scales other lanes copied
        const int slot = j % S;
        const int v = (part + j * wpr) * DS4_WARP + lane;
        if (active && v < nvec) {
            const float* xp = x + (ds4_size)v * 16;
            const Ds4X16 xv = ds4_ld_x16(xp);
#pragma unroll
            for (int r = 0; r < R; ++r)
                acc[r] += ds4_h2f(scl[warp][slot][r][lane >> 1]) *
                          ds4_q8s_dot16(ring[warp][slot][r][lane], xv);
        }
        ds4_syncwarp();  // slot j % S is refilled by the next iteration's issue
    }
    ds4_cp_wait_all();
    ds4_finish_rows<R>(acc, y, row0, n_out, wpr, ok);
}

// ---------------------------------------------------------------------------------------
// Int8 activations (docs: int8 activations). The block's threads first quantize the input
// vector into shared memory (every block does it, identically, so no extra launch and no
// ordering between blocks), then the rows are streamed as above and each unit multiplies
// int8 codes with dp4a: integer sums are exact, so the CPU backend's integer part is
// bit-equal, and only the per-unit float scaling and the order of the float sum differ.
// Which matmuls take this path is the engine's rule (one-token matmuls of block-quantized
// weights when the backend's activation mode is q8); the host never mixes the two paths
// inside one op.
// ---------------------------------------------------------------------------------------

// Widest input the shared-memory quantization holds (DeepSeek V4 Flash's widest
// block-quantized matmul input is 8192: the attention output projection).
#define DS4_Q8_MAX_IN 8192
extern "C" __device__ const int ds4_gemvq_max_in[2] = {DS4_Q8_MAX_IN, 32};

// The shared-memory home of a quantized input (Ds4XQ points into it), one per block of the
// int8-activation kernels.
struct Ds4XQBuf {
    __align__(16) ds4_i8 q[DS4_Q8_MAX_IN];
    float d[DS4_Q8_MAX_IN / 32];
    int s16[DS4_Q8_MAX_IN / 16];
};

// max(|a|, |b|) that propagates NaN (fmaxf would drop it and hide a poisoned input).
__device__ __forceinline__ float ds4_nanmax(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

// Quantizes x[0..n) (n a multiple of 32, <= DS4_Q8_MAX_IN) into q/d/s16 with all threads of
// the block; ends with a barrier. Per block of 32: amax over the block (NaN propagates),
// d = amax / 127, q = round-half-away(x · (1 / d)) (0 when d is 0 or NaN, so that NaN shows
// in the output through d).
__device__ __forceinline__ void ds4_quantize_x(const float* __restrict__ x, int n, ds4_i8* q,
                                               float* d, int* s16) {
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int nthreads_warps = blockDim.x / DS4_WARP;
    for (int b = warp; b < n / 32; b += nthreads_warps) {
        const float v = x[b * 32 + lane];
        float amax = fabsf(v);
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) amax = ds4_nanmax(amax, ds4_shfl_xor(amax, m));
        const float db = amax / 127.0f;
        const int qi = db > 0.0f ? (int)roundf(v * (1.0f / db)) : 0;
        q[b * 32 + lane] = (ds4_i8)qi;
        int s = qi;
#pragma unroll
        for (int m = 8; m > 0; m >>= 1) s += ds4_shfl_xor_i(s, m);
        if (lane == 0) d[b] = db;
        if ((lane & 15) == 0) s16[b * 2 + (lane >> 4)] = s;
    }
    __syncthreads();
}

// Where code i of an n-code input goes in the split layout (docs/gpu.md §27): each run of 32
// 32-code units holds the first 16 codes of its units together, then their last 16 (a short
// last run of m units keeps the halves m·16 bytes apart), so lane l reading unit 32k + l
// reads consecutive 16-byte pieces. i a multiple of 4 (4 codes never straddle a half).
__device__ __forceinline__ int ds4_xsplit_at(int i, int n) {
    const int u = i >> 5, run = u >> 5, m = min(32, (n >> 5) - (run << 5));
    return (run << 10) + ((i >> 4) & 1) * (m << 4) + ((u & 31) << 4) + (i & 15);
}

// The same quantization, fast: x 16-byte aligned. Each thread owns 4 consecutive values of
// every 1024 (8 threads per block of 32) and issues all its loads before any arithmetic,
// so the whole prologue costs about one trip to L2 instead of one per block of 32.
// x: a 16-byte aligned float array, or a Ds4XSwiglu (g and u 16-byte aligned).
template <bool SPLIT = false, class XIn>
__device__ __forceinline__ void ds4_quantize_x4(const XIn& xin, int n, ds4_i8* q, float* d,
                                                int* s16) {
    constexpr int MAXIT = DS4_Q8_MAX_IN / (4 * DS4_GEMV_THREADS);
    const int t = threadIdx.x;
    const int lane = t & (DS4_WARP - 1);
    const auto x = ds4_xin_begin(xin, n);
    float4 v[MAXIT];
#pragma unroll
    for (int it = 0; it < MAXIT; ++it) {
        const int i = 4 * (t + it * DS4_GEMV_THREADS);
        v[it] = i < n ? ds4_xin4(x, i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int it = 0; it < MAXIT; ++it) {
        const int i = 4 * (t + it * DS4_GEMV_THREADS);
        if (i < n) ds4_xin_keep(x, i, v[it]);
    }
#pragma unroll
    for (int it = 0; it < MAXIT; ++it) {
        const int i = 4 * (t + it * DS4_GEMV_THREADS);
        if (4 * (it * DS4_GEMV_THREADS) >= n) break;  // uniform across the block
        const float4 f = v[it];
        float amax = ds4_nanmax(ds4_nanmax(fabsf(f.x), fabsf(f.y)),
                                ds4_nanmax(fabsf(f.z), fabsf(f.w)));
#pragma unroll
        for (int m = 4; m > 0; m >>= 1) amax = ds4_nanmax(amax, ds4_shfl_xor(amax, m));
        const float db = amax / 127.0f;
        int q0 = 0, q1 = 0, q2 = 0, q3 = 0;
        if (db > 0.0f) {
            const float id = 1.0f / db;
            q0 = (int)roundf(f.x * id);
            q1 = (int)roundf(f.y * id);
            q2 = (int)roundf(f.z * id);
            q3 = (int)roundf(f.w * id);
        }
        int sum = (q0 + q1) + (q2 + q3);
        sum += ds4_shfl_xor_i(sum, 2);
        sum += ds4_shfl_xor_i(sum, 1);
        if (i < n) {
            *(int*)(q + (SPLIT ? ds4_xsplit_at(i, n) : i)) =
                (int)(((ds4_u32)q0 & 0xff) | (((ds4_u32)q1 & 0xff) << 8) |
                                   (((ds4_u32)q2 & 0xff) << 16) | ((ds4_u32)q3 << 24));
            if ((lane & 7) == 0) d[i / 32] = db;
            if ((lane & 3) == 0) s16[i / 16] = sum;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ int ds4_ld_i32s(const ds4_i8* p) { return *(const int*)p; }
// Four weight bytes at a 2-byte aligned address (blocks of 34 and 66 bytes).
__device__ __forceinline__ int ds4_ld_w4(const ds4_u8* p) {
    return (int)((ds4_u32)ds4_ld_u16(p) | ((ds4_u32)ds4_ld_u16(p + 2) << 16));
}

// Q2_K unit with int8 activations. A sub-block of 16 values is four dp4a on its 2-bit codes
// (bit plane j of 16 code bytes); the min term uses the precomputed code sum of those 16
// activations. With DS4_Q2K_PLANES (default, docs/gpu.md §33) a unit is the four sub-blocks
// that share their 16 code bytes (planes j = 0..3 of (h, half)): the bytes, the scale bytes
// and d/dmin are read once for the four, where one unit per sub-block read the same 16
// bytes four times (24 shared-memory loads per row and 64 values, now 7). Each sub-block's
// term is the same expression; a lane adds its sub-blocks in another order, so rows differ
// from the one-sub-block unit in the last bits (the batched and one-token kernels share the
// unit, so they still agree bit for bit). -DDS4_Q2K_PLANES=0: one sub-block per unit (A/B).
#ifndef DS4_Q2K_PLANES
#define DS4_Q2K_PLANES 1
#endif
struct Ds4Q2Kx : Ds4Q2K {
    static constexpr bool XSPLIT = false;
#if DS4_Q2K_PLANES
    // Units of 64 values, 4 per block; a chunk must hold a multiple of 32 units (8 blocks:
    // the routed down projection's 2048 inputs in one chunk). The host sizes warps per row
    // by the f32 chunk (ds4_gemv_config_q2_k, 12 blocks), never more parts than these.
    static constexpr int UPB = 4;
    __host__ __device__ static constexpr int cb(int R) { return R == 1 ? 16 : 8; }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 2, h = (u >> 1) & 1, half = u & 1;
        ds4_u32 q[R][4], scw[R][2];
        float d[R], dmin[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk + 80);
            d[r] = ds4_h2f((ds4_u16)(dd & 0xffff));
            dmin[r] = ds4_h2f((ds4_u16)(dd >> 16));
            // Scale bytes 8h .. 8h + 7: sub-block 8h + 2j + half is byte 2j + half.
            scw[r][0] = ds4_ld_u32(blk + 8 * h);
            scw[r][1] = ds4_ld_u32(blk + 8 * h + 4);
            const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
#pragma unroll
            for (int i = 0; i < 4; ++i) q[r][i] = ds4_ld_u32(qs + 4 * i);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int sb = 8 * h + 2 * j + half;
            const ds4_i8* xq = xc.q + b * BE + 16 * sb;
            const int x0 = ds4_ld_i32s(xq), x1 = ds4_ld_i32s(xq + 4);
            const int x2 = ds4_ld_i32s(xq + 8), x3 = ds4_ld_i32s(xq + 12);
            const float dx = xc.d[b * 8 + (sb >> 1)];
            const int xs = xc.s16[b * 16 + sb];
            const int m = 0x03030303;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int sc = (int)((scw[r][j >> 1] >> (8 * (2 * (j & 1) + half))) & 255u);
                int is = ds4_dp4a((int)(q[r][0] >> (2 * j)) & m, x0, 0);
                is = ds4_dp4a((int)(q[r][1] >> (2 * j)) & m, x1, is);
                is = ds4_dp4a((int)(q[r][2] >> (2 * j)) & m, x2, is);
                is = ds4_dp4a((int)(q[r][3] >> (2 * j)) & m, x3, is);
                acc[r] += dx * (d[r] * (float)((sc & 15) * is) - dmin[r] * (float)((sc >> 4) * xs));
            }
        }
    }
#else
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 4, sb = u & 15;
        const int h = sb >> 3, j = (sb >> 1) & 3, half = sb & 1;
        const ds4_i8* xq = xc.q + b * BE + 16 * sb;
        const int x0 = ds4_ld_i32s(xq), x1 = ds4_ld_i32s(xq + 4);
        const int x2 = ds4_ld_i32s(xq + 8), x3 = ds4_ld_i32s(xq + 12);
        const float dx = xc.d[b * 8 + (sb >> 1)];
        const int xs = xc.s16[b * 16 + sb];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk + 80);
            const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
            const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
            const int sc = blk[sb];
            const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
            const int m = 0x03030303;
            int is = ds4_dp4a((int)(ds4_ld_u32(qs) >> (2 * j)) & m, x0, 0);
            is = ds4_dp4a((int)(ds4_ld_u32(qs + 4) >> (2 * j)) & m, x1, is);
            is = ds4_dp4a((int)(ds4_ld_u32(qs + 8) >> (2 * j)) & m, x2, is);
            is = ds4_dp4a((int)(ds4_ld_u32(qs + 12) >> (2 * j)) & m, x3, is);
            acc[r] += dx * (d * (float)((sc & 15) * is) - dmin * (float)((sc >> 4) * xs));
        }
    }
#endif
};

// Q4_K unit (16 values of sub-block j): four dp4a on the 4-bit codes.
struct Ds4Q4Kx : Ds4Q4K {
    static constexpr bool XSPLIT = false;
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 4, t = u & 15, j = t >> 1, half = t & 1;
        const ds4_i8* xq = xc.q + b * BE + 16 * t;
        const int x0 = ds4_ld_i32s(xq), x1 = ds4_ld_i32s(xq + 4);
        const int x2 = ds4_ld_i32s(xq + 8), x3 = ds4_ld_i32s(xq + 12);
        const float dx = xc.d[b * 8 + j];
        const int xs = xc.s16[b * 16 + t];
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk);
            const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
            const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
            const ds4_u8* sp = blk + 4;
            int sc, mn;
            ds4_q4k_scale_min(sp, j, &sc, &mn);
            const uint4 qv = *(const uint4*)(blk + 16 + 32 * (j >> 1) + 16 * half);
            const int m = 0x0f0f0f0f;
            int is = ds4_dp4a((int)(qv.x >> shift) & m, x0, 0);
            is = ds4_dp4a((int)(qv.y >> shift) & m, x1, is);
            is = ds4_dp4a((int)(qv.z >> shift) & m, x2, is);
            is = ds4_dp4a((int)(qv.w >> shift) & m, x3, is);
            acc[r] += dx * (d * (float)(sc * is) - dmin * (float)(mn * xs));
        }
    }
};

// IQ2_XXS unit with int8 activations: one 32-value group (4 grid entries sharing the
// group's scale), the CPU's q8act term (db · dx) · Σ ±grid · q_x exactly. One unit per entry
// (8 values) read the group's scale and sign word once per 8 values (the routed gate/up
// GEMV issue-bound: ncu 31.8 µs for 26 MB on the H200); here once per 32. A grid byte (8,
// 25 or 43, never 0) takes its sign as (g ^ m) + (m & 1) per byte with m = 0xFF to negate:
// 255 - g + 1 = 256 - g stays inside the byte, so one 32-bit add does four bytes.
//
// Tables (docs/gpu.md §20). A warp's 32 grid lookups hit random entries of one 2 KB table:
// a 64-bit shared load then replays over colliding bank pairs (≈ 6 wavefronts instead of
// 2), and ncu put the routed gate/up GEMV's L1/shared pipe at 75 % busy with DRAM at 27 %
// (H100, 2026-12-06). So each table is kept in C lane-private copies interleaved entry by
// entry (entry e of copy c at e·C + c) and lane l reads copy l mod C: the 16 lanes of a
// half-warp touch 16 different bank pairs whatever entries they want, and with C = 16 every
// lookup is conflict-free. That also makes a 64-bit byte-mask table (128 sign patterns)
// cheaper than forming the masks from the 128-byte sign table with two multiplies per four
// bytes (in one shared copy it had measured slower: 35.9 µs against 31.8, conflicts). The
// copies live in dynamic shared memory (48 KB with C = 16: grid, then masks), which the host
// passes at launch (ds4_gemvq_iq2_smem); a launch given less reads no table and writes NaN
// rows (one kernel body: a pointer chosen between a static and a dynamic table turned every
// table load into a generic one). HIP keeps one static table (its runtime here passes no
// dynamic shared memory); -DDS4_IQ2_GRID_COPIES=1 does the same on CUDA.
#ifndef DS4_IQ2_GRID_COPIES
#if defined(DS4_HIP)
#define DS4_IQ2_GRID_COPIES 1
#else
#define DS4_IQ2_GRID_COPIES 16
#endif
#endif
#ifndef DS4_IQ2_MASK_TABLE
#define DS4_IQ2_MASK_TABLE (DS4_IQ2_GRID_COPIES > 1)
#endif
// -DDS4_IQ2_MASK_TABLE=0 -DDS4_IQ2_SIGNS_ALU=1: the masks from the sign index's bits and
// parity with integer ops only (no shared-memory read for them; an A/B for the batched
// step's routed gate/up GEMV, whose L1/shared pipe and issue slots both ran near 65 %;
// measured slower on an H100, docs/gpu.md §20).
#ifndef DS4_IQ2_SIGNS_ALU
#define DS4_IQ2_SIGNS_ALU 0
#endif
// The int8 unit's values by byte permutes (docs/gpu.md §32): each table entry is a 32-bit
// selector (one shared-memory wavefront per warp where a 64-bit entry took two), the
// point's levels OR the signs' bits pick each signed value out of the eight level bytes.
// Lane-private copies as above, 32 of them (a 32-bit entry's copies then fill the banks).
// Measured on an H200 (BENCHMARKS.md, 2026-12-07): the batched step's flat kernels gain
// (8 sequences 26.98 / 27.18 → 26.48 / 26.57 ms), the one-token kernels lose a little (1
// sequence 8.39 / 8.38 → 8.45 / 8.46 ms), so only the flat kernels take it by default.
// -DDS4_IQ2_PRMT=0: the flat kernels with the 64-bit lattice and masks; -DDS4_IQ2_PRMT_ONE=1:
// the one-token and grouped kernels with the permutes (A/B). Both give the same values.
#ifndef DS4_IQ2_PRMT
#define DS4_IQ2_PRMT 1
#endif
#ifndef DS4_IQ2_PRMT_ONE
#define DS4_IQ2_PRMT_ONE 0
#endif
#if DS4_IQ2_GRID_COPIES > 1
#define DS4_IQ2_SEL_COPIES 32
#else
#define DS4_IQ2_SEL_COPIES 1
#endif
// Dynamic shared memory of the 64-bit tables and of the selector tables; the host passes
// the larger to every int8 IQ2_XXS launch.
#define DS4_IQ2_U64_SMEM \
    (DS4_IQ2_GRID_COPIES > 1 ? (256 + (DS4_IQ2_MASK_TABLE ? 128 : 0)) * 8 * DS4_IQ2_GRID_COPIES : 0)
#define DS4_IQ2_SEL_SMEM (DS4_IQ2_GRID_COPIES > 1 ? DS4_IQ2_SEL_ENTRIES * 4 * DS4_IQ2_SEL_COPIES : 0)
#define DS4_IQ2_GRID_SMEM \
    (DS4_IQ2_U64_SMEM > DS4_IQ2_SEL_SMEM ? DS4_IQ2_U64_SMEM : DS4_IQ2_SEL_SMEM)
static_assert((DS4_IQ2_GRID_COPIES & (DS4_IQ2_GRID_COPIES - 1)) == 0 &&
                  DS4_IQ2_GRID_COPIES <= DS4_WARP,
              "grid copies: a power of two, at most a warp");
// {dynamic shared bytes the int8-activation IQ2_XXS GEMVs want, copies}, read by the host
// after loading.
extern "C" __device__ const int ds4_gemvq_iq2_smem[2] = {DS4_IQ2_GRID_SMEM, DS4_IQ2_GRID_COPIES};
// Four sign bits (bit e: negate byte e) to the byte mask 0x00/0xFF per byte: the multiply
// by 1 + 2^7 + 2^14 + 2^21 moves bit e to bit 8e with no two partial products meeting.
__device__ __forceinline__ ds4_u32 ds4_sign_mask4(ds4_u32 bits4) {
    return ((bits4 * 0x00204081u) & 0x01010101u) * 0xffu;
}
__device__ __forceinline__ ds4_u64 ds4_sign_mask8(ds4_u32 sg) {
    return (ds4_u64)ds4_sign_mask4(sg & 15u) | ((ds4_u64)ds4_sign_mask4(sg >> 4) << 32);
}
// The activation codes in the split layout (ds4_xsplit_at, docs/gpu.md §27);
// -DDS4_IQ2_XSPLIT=0: input order (A/B).
#ifndef DS4_IQ2_XSPLIT
#define DS4_IQ2_XSPLIT 1
#endif
// P: the values by byte permutes (docs/gpu.md §32), else the 64-bit lattice and masks.
template <bool P>
struct Ds4Iq2XxsxT : Ds4Iq2Xxs {
    static constexpr int UPB = 8;
    static constexpr bool XSPLIT = DS4_IQ2_XSPLIT;
    __device__ static Ds4Tables prologue() {
        __shared__ ds4_u8 signs[128];
        if constexpr (P) {
            return prologue_sel(signs);
        } else {
#if DS4_IQ2_GRID_COPIES > 1
            constexpr int C = DS4_IQ2_GRID_COPIES;
            DS4_DYN_SHARED(ds4_iq2_tables, DS4_IQ2_GRID_SMEM);
            ds4_u64* grid = (ds4_u64*)ds4_iq2_tables;
            ds4_u64* smask = grid + 256 * C;
            const bool given = ds4_dynamic_smem_bytes() >= (unsigned)DS4_IQ2_U64_SMEM;
            if (given) {
                for (int i = threadIdx.x; i < 256 * C; i += DS4_GEMV_THREADS)
                    grid[i] = ds4_iq2xxs_grid[i / C];
                if (DS4_IQ2_MASK_TABLE)
                    for (int i = threadIdx.x; i < 128 * C; i += DS4_GEMV_THREADS)
                        smask[i] = ds4_sign_mask8(ds4_iq2xxs_ksigns[i / C]);
            }
            for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS)
                signs[i] = (ds4_u8)ds4_iq2xxs_ksigns[i];
            __syncthreads();
            const int c = threadIdx.x & (C - 1);
            return Ds4Tables{grid + c, signs, smask + c, C, given};
#else
            __shared__ ds4_u64 grid[256];
            __shared__ ds4_u64 smask[DS4_IQ2_MASK_TABLE ? 128 : 1];
            for (int i = threadIdx.x; i < 256; i += DS4_GEMV_THREADS) grid[i] = ds4_iq2xxs_grid[i];
            for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS) {
                const ds4_u32 sg = ds4_iq2xxs_ksigns[i];
                signs[i] = (ds4_u8)sg;
                if (DS4_IQ2_MASK_TABLE) smask[i] = ds4_sign_mask8(sg);
            }
            __syncthreads();
            return Ds4Tables{grid, signs, smask, 1};
#endif
        }
    }
    // The selector tables (DS4_IQ2_PRMT): grid selectors then sign selectors, entry e's C
    // copies side by side, written four copies per 16-byte store.
    __device__ static Ds4Tables prologue_sel(ds4_u8* signs) {
        constexpr int C = DS4_IQ2_SEL_COPIES;
        for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS)
            signs[i] = (ds4_u8)ds4_iq2xxs_ksigns[i];
#if DS4_IQ2_SEL_COPIES > 1
        DS4_DYN_SHARED(ds4_iq2_tables, DS4_IQ2_GRID_SMEM);
        ds4_u32* gsel = (ds4_u32*)ds4_iq2_tables;
        const bool given = ds4_dynamic_smem_bytes() >= (unsigned)DS4_IQ2_SEL_SMEM;
        if (given) {
            for (int i = threadIdx.x; i < DS4_IQ2_SEL_ENTRIES * C / 4; i += DS4_GEMV_THREADS) {
                const ds4_u32 v = ds4_iq2_sel_entry(4 * i / C);
                ((uint4*)gsel)[i] = make_uint4(v, v, v, v);
            }
        }
        __syncthreads();
        const int c = threadIdx.x & (C - 1);
        const ds4_u32* lv = gsel + 384 * C + c;
        return Ds4Tables{nullptr, signs, nullptr, C, given, gsel + c, gsel + 256 * C + c,
                         given ? lv[0] : 0u, given ? lv[C] : 0u};
#else
        __shared__ ds4_u32 gsel[DS4_IQ2_SEL_ENTRIES];
        for (int i = threadIdx.x; i < DS4_IQ2_SEL_ENTRIES; i += DS4_GEMV_THREADS)
            gsel[i] = ds4_iq2_sel_entry(i);
        __syncthreads();
        return Ds4Tables{nullptr,
                         signs,
                         nullptr,
                         1,
                         true,
                         gsel,
                         gsel + 256,
                         gsel[384],
                         gsel[385]};
#endif
    }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables tb,
                                float (&acc)[R]) {
        const int b = u >> 3, g = u & 7;
#if DS4_IQ2_XSPLIT
        // Full runs only: IQ2_XXS rows are multiples of 2048 values, and a chunk starts a run.
        const ds4_i8* xq = xc.q + ((u >> 5) << 10) + ((u & 31) << 4);
        const uint4 xa = *(const uint4*)xq, xb = *(const uint4*)(xq + 512);
#else
        const ds4_i8* xq = xc.q + b * BE + 32 * g;
        const uint4 xa = *(const uint4*)xq, xb = *(const uint4*)(xq + 16);
#endif
        const int xv[8] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w,
                           (int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
        const float dx = xc.d[b * 8 + g];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const float d = ds4_h2f(ds4_ld_u16(blk));
            const ds4_u8* gp = blk + 2 + 8 * g;
            const ds4_u32 aux = (ds4_u32)ds4_ld_w4(gp);
            const ds4_u32 w1 = (ds4_u32)ds4_ld_w4(gp + 4);
            const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
            int is = 0;
            if constexpr (P) {
                // Signed values by permuting the levels +8, +25, +43, 0 | −8, −25, −43, 0 with
                // the point's selector OR its signs' (docs/gpu.md §32): exactly the values below.
                // Entries are 4 · gstride bytes apart (this lane's copy; a stride the compiler
                // cannot fold into the lane's offset keeps the address at shift, mask, add).
                const unsigned es = 4u * (unsigned)tb.gstride;
                const ds4_u8* gs = (const ds4_u8*)tb.gsel;
                const ds4_u8* ss = (const ds4_u8*)tb.ssel;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const ds4_u32 sel = *(const ds4_u32*)(gs + ((aux >> (8 * k)) & 255u) * es) |
                                        *(const ds4_u32*)(ss + ((w1 >> (7 * k)) & 127u) * es);
                    const int vlo = (int)ds4_byte_perm(tb.lv_lo, tb.lv_hi, sel);
                    const int vhi = (int)ds4_byte_perm(tb.lv_lo, tb.lv_hi, sel >> 16);
                    is = ds4_dp4a(vhi, xv[2 * k + 1], ds4_dp4a(vlo, xv[2 * k], is));
                }
            } else {
                // Entries are 8 · gstride bytes apart (this lane's copy, docs/gpu.md §20).
                const unsigned es = 8u * (unsigned)tb.gstride;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const ds4_u64 gv =
                        *(const ds4_u64*)((const ds4_u8*)tb.grid + ((aux >> (8 * k)) & 255u) * es);
                    const ds4_u32 si = (w1 >> (7 * k)) & 127u;
                    ds4_u32 mlo, mhi;
                    if (DS4_IQ2_MASK_TABLE) {
                        const ds4_u64 m = *(const ds4_u64*)((const ds4_u8*)tb.smask + si * es);
                        mlo = (ds4_u32)m;
                        mhi = (ds4_u32)(m >> 32);
                    } else {
#if DS4_IQ2_SIGNS_ALU
                        // The sign byte is the 7 stored bits and their parity as bit 7
                        // (ds4_iq2xxs_ksigns' definition): no table read.
                        const ds4_u32 sg = si | ((ds4_u32)(ds4_popc(si) & 1) << 7);
#else
                        const ds4_u32 sg = tb.signs[si];
#endif
                        mlo = ds4_sign_mask4(sg & 15u);
                        mhi = ds4_sign_mask4(sg >> 4);
                    }
                    const ds4_u32 glo = (ds4_u32)gv, ghi = (ds4_u32)(gv >> 32);
                    const int vlo = (int)((glo ^ mlo) + (mlo & 0x01010101u));
                    const int vhi = (int)((ghi ^ mhi) + (mhi & 0x01010101u));
                    is = ds4_dp4a(vhi, xv[2 * k + 1], ds4_dp4a(vlo, xv[2 * k], is));
                }
            }
            acc[r] += (db * dx) * (float)is;
        }
    }
};
// The one-token and grouped kernels' unit, and the flat (batched) kernels'.
using Ds4Iq2XxsxOne = Ds4Iq2XxsxT<DS4_IQ2_PRMT_ONE != 0>;
using Ds4Iq2XxsxFlat = Ds4Iq2XxsxT<DS4_IQ2_PRMT != 0>;

// The staged row engine with int8 activations: quantize x, then as ds4_gemv_quant, but
// persistent: the host may launch fewer blocks than row groups (one wave: the routed
// experts' 12 x 128 blocks ran in ~6 waves of short-lived blocks, each paying the x
// quantization, the IQ2 tables and a full load latency with nothing to overlap), and each
// block walks row-group steps; a warp issues the loads of its next step's first chunk
// before it computes its current last chunk, so the load latency of one step hides behind
// the arithmetic of the previous one. Every row is still summed by one warp in a fixed
// order (deterministic, and the same sums as one block per step).
//
// The launch's matrices are "jobs" (J below): one for a plain GEMV, a selection x matrix
// each for the routed experts. Two ways to hand out the steps:
// - strided (J::FLAT false): grid y and z pick the job, and block b of grid x takes steps
//   b, b + gridDim.x, ... of it; the weights are known before the grid wait.
// - flat (J::FLAT true, docs/gpu.md §25): every step of every job in one sequence, and block
//   b takes a contiguous, equal share of it. A batched decode step's 96 gate/up matrices
//   on one wave of resident blocks then cost what their work costs, where the strided grid
//   (a whole number of blocks per matrix) overfilled the wave by up to a third. The input
//   is quantized again where the block's steps enter a job with another input (J::key).
// Which warp sums which row is the same either way, so the rows are the same bits.
// J gives FLAT, count(), and per job ok (valid expert), w (weights), y (outputs), input and
// key (jobs with equal keys share one quantized input).
template <class T, class J>
__device__ __forceinline__ void ds4_gemvq_jobs(const J& jobs, int n_in, int n_out, int wpr) {
    constexpr int R = T::ROWS;
    constexpr int CB = T::cb(R);
    constexpr int VEC = CB * T::BB / 16;
    constexpr int V = (VEC + DS4_WARP - 1) / DS4_WARP;
    static_assert((CB * T::BB) % 16 == 0, "chunk must be whole 16-byte vectors");
    static_assert((CB * T::UPB) % DS4_WARP == 0, "full chunk must split evenly");
    __shared__ uint4 stage[DS4_GEMV_WARPS][R * VEC];
    __shared__ Ds4XQBuf xbuf;
    ds4_i8* const xq = xbuf.q;
    float* const xd = xbuf.d;
    int* const xs = xbuf.s16;
    const Ds4Tables tb = T::prologue();
    const bool fits =
        n_in <= DS4_Q8_MAX_IN && n_in % 32 == 0 && (!T::XSPLIT || n_in % 1024 == 0);
    const bool ok = fits && tb.ok;  // each job's own validity is jobs.ok(job)
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int gpb = DS4_GEMV_WARPS / wpr;  // row groups per block step
    const int nsteps = (n_out + R * gpb - 1) / (R * gpb);
    const ds4_size row_bytes = (ds4_size)(n_in / T::BE) * T::BB;
    const int nblocks = n_in / T::BE;
    const int nchunks = (nblocks + CB - 1) / CB;
    const ds4_u8* sbytes = (const ds4_u8*)stage[warp];
    const Ds4XQ xqv{xq, xd, xs};
    // This block's steps: gs = first, first + inc, ... while gs < last (flat: job gs /
    // nsteps, row step gs % nsteps; strided: the one job's row step gs).
    int first, last, inc;
    if (J::FLAT) {
        const ds4_size total = (ds4_size)jobs.count() * nsteps;
        first = (int)(total * blockIdx.x / gridDim.x);
        last = (int)(total * (blockIdx.x + 1) / gridDim.x);
        inc = 1;
        ds4_grid_wait();  // the jobs' expert ids come from the router
    } else {
        first = blockIdx.x;
        last = nsteps;
        inc = gridDim.x;
    }
    auto job_of = [&](int gs) { return J::FLAT ? gs / nsteps : 0; };
    // Rows of step gs for this warp; false when it has none there.
    auto rows_of = [&](int gs, const ds4_u8* (&rows)[R], int& row0) -> bool {
        const int job = gs < last ? job_of(gs) : 0;
        row0 = ((J::FLAT ? gs % nsteps : gs) * gpb + warp / wpr) * R;
        const bool act = ok && gs < last && jobs.ok(job) && row0 < n_out;
        const int nvalid = act ? min(R, n_out - row0) : 1;
        const ds4_u8* W = jobs.w(job);
#pragma unroll
        for (int r = 0; r < R; ++r)
            rows[r] = W + (act ? (ds4_size)(row0 + min(r, nvalid - 1)) * row_bytes : 0);
        return act;
    };
    uint4 regs[R][V];
    int gs = first;
    const ds4_u8* rows[R];
    int row0;
    bool act = rows_of(gs, rows, row0);
    if (act && part < nchunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) ds4_load_chunk<T, CB, V>(rows[r], part, nblocks, lane, regs[r]);
    }
    // Only weights were read so far (overlapped launches, docs/gpu.md §6); the first
    // chunk's loads are in flight while x is quantized.
    ds4_grid_wait();
    long long key = -1;  // the input now in xbuf (flat grids)
    if (!J::FLAT) {
        // One input: quantized before the loop (keeps the loop's registers free).
        if (fits) ds4_quantize_x4<T::XSPLIT>(jobs.input(0), n_in, xq, xd, xs);
        else __syncthreads();
    }
    for (; gs < last; gs += inc) {
        const int job = job_of(gs);
        if (J::FLAT && fits && jobs.key(job) != key) {
            // Block-uniform: every thread is at the same step. The last step's readers of
            // xbuf passed the barrier after its rows were written.
            key = jobs.key(job);
            ds4_quantize_x4<T::XSPLIT>(jobs.input(job), n_in, xq, xd, xs);
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
        const ds4_u8* nrows[R];
        int nrow0;
        const bool nact = rows_of(gs + inc, nrows, nrow0);
        if (act) {
            for (int c = part; c < nchunks; c += wpr) {
                const int b0 = c * CB;
                const int nb = min(CB, nblocks - b0);
                ds4_stage_chunk<R, V, VEC>(stage[warp], regs, nb * T::BB / 16, lane);
                ds4_syncwarp();
                if (c + wpr < nchunks) {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        ds4_load_chunk<T, CB, V>(rows[r], c + wpr, nblocks, lane, regs[r]);
                } else if (nact) {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        ds4_load_chunk<T, CB, V>(nrows[r], part, nblocks, lane, regs[r]);
                }
                ds4_chunk_units<T, R, CB>(sbytes, nb, lane, ds4_x_at(xqv, (ds4_size)b0 * T::BE),
                                          tb, acc);
                ds4_syncwarp();
            }
        } else if (nact && part < nchunks) {
#pragma unroll
            for (int r = 0; r < R; ++r) ds4_load_chunk<T, CB, V>(nrows[r], part, nblocks, lane, regs[r]);
        }
        ds4_finish_rows<R>(acc, jobs.y(job), row0, n_out, wpr, ok && jobs.ok(job));
        __syncthreads();  // part_sums of ds4_finish_rows are rewritten by the next step
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = nrows[r];
        row0 = nrow0;
        act = nact;
    }
}

// One matrix (grid y and z, if any, chosen by the entry point).
template <class XIn>
struct Ds4JobMatrix {
    static constexpr bool FLAT = false;
    const ds4_u8* W;
    XIn x;
    float* yp;
    bool okj;
    __device__ int count() const { return 1; }
    __device__ bool ok(int) const { return okj; }
    __device__ const ds4_u8* w(int) const { return W; }
    __device__ float* y(int) const { return yp; }
    __device__ const XIn& input(int) const { return x; }
    __device__ long long key(int) const { return 0; }
};
template <class T, class XIn>
__device__ __forceinline__ void ds4_gemvq_quant(const ds4_u8* __restrict__ W, const XIn& x,
                                                float* __restrict__ y, int n_in, int n_out,
                                                int wpr, bool ok) {
    ds4_gemvq_jobs<T>(Ds4JobMatrix<XIn>{W, x, y, ok}, n_in, n_out, wpr);
}

// ---------------------------------------------------------------------------------------
// Split-layout Q8_0 rows with int8 activations (docs/gpu.md §7, §8). Profiled on the H200
// (ncu, 2026-12-04), the f32-activation engine above ran its largest matrices with the
// L1/TEX pipe 93 % busy and DRAM at 68 %: every lane reads 64 bytes of f32 x from L1 per
// 16 bytes of weights. Here each block quantizes x once into shared memory (16 bytes of
// int8 codes per 32 weights, shared by the warp's R rows) and multiplies with dp4a.
// Persistent like ds4_gemvq_quant: a block walks row-group steps blockIdx.x, +gridDim.x, ...;
// the warp's work is a flat sequence of items (a step's row group, U units of 32 codes per
// lane and row), and the loads of item j+1 are issued before item j is computed (two
// register buffers, swapped by unrolling the loop twice: copying a buffer whose loads are
// still in flight would wait for them). Unit u of a row: its 32 codes at 32·u, its f16
// scale at n_in + 2·u; the term is (d · dx) · Σ q_w q_x, the CPU backend's expression
// (ds4_gguf::quant::q8act), and each row is summed by its warps in a fixed order.
// ---------------------------------------------------------------------------------------
// Units of 32 codes per lane and row in one item: 1 measured 96.8 tok/s decode against
// 95.5-95.9 for 2 on the H200 (2026-12-04).
#ifndef DS4_Q8Q_UNITS
#define DS4_Q8Q_UNITS 1
#endif
#ifndef DS4_MINB_Q_Q8_0
#define DS4_MINB_Q_Q8_0 2
#endif
struct Ds4Q8Sx {
    static constexpr int ROWS = DS4_ROWS_Q8_0;
    static constexpr int UNITS = DS4_Q8Q_UNITS;
};

// Σ of 32 int8 weight codes (lo, hi) times 32 int8 activation codes (xa, xb): eight dp4a in
// code order (exact integer sums, as the CPU's q8act).
__device__ __forceinline__ int ds4_dot32_i8(uint4 lo, uint4 hi, uint4 xa, uint4 xb) {
    int is = ds4_dp4a((int)lo.x, (int)xa.x, 0);
    is = ds4_dp4a((int)lo.y, (int)xa.y, is);
    is = ds4_dp4a((int)lo.z, (int)xa.z, is);
    is = ds4_dp4a((int)lo.w, (int)xa.w, is);
    is = ds4_dp4a((int)hi.x, (int)xb.x, is);
    is = ds4_dp4a((int)hi.y, (int)xb.y, is);
    is = ds4_dp4a((int)hi.z, (int)xb.z, is);
    return ds4_dp4a((int)hi.w, (int)xb.w, is);
}

template <int R, int U>
struct Ds4Q8Item {
    uint4 lo[R][U], hi[R][U];
    ds4_u16 sc[R][U];
};

template <class T, class XIn>
__device__ __forceinline__ void ds4_gemvq_q8s(const ds4_u8* __restrict__ W, const XIn& x,
                                              float* __restrict__ y, int n_in, int n_out,
                                              int wpr, bool ok) {
    constexpr int R = T::ROWS, U = T::UNITS;
    __shared__ Ds4XQBuf xbuf;
    ds4_i8* const xq = xbuf.q;
    float* const xd = xbuf.d;
    int* const xs = xbuf.s16;
    const bool fits = n_in <= DS4_Q8_MAX_IN && n_in % 32 == 0;
    ok = ok && fits;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int gpb = DS4_GEMV_WARPS / wpr;  // row groups per block step
    const int nsteps = (n_out + R * gpb - 1) / (R * gpb);
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nunits = n_in / 32;
    const int stride = DS4_WARP * wpr;  // units between a lane's consecutive units
    const int nit = max(1, (nunits + U * stride - 1) / (U * stride));  // items per step
    const int my_steps = (int)blockIdx.x < nsteps ? (nsteps - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int nj = my_steps * nit;
    auto row0_of = [&](int j) { return (((int)blockIdx.x + (j / nit) * (int)gridDim.x) * gpb + warp / wpr) * R; };
    auto load = [&](int j, Ds4Q8Item<R, U>& b) {
        const int row0 = row0_of(j);
        const int it = j % nit;
        const bool act = ok && j < nj && row0 < n_out;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* row = W + (act ? (ds4_size)min(row0 + r, n_out - 1) * row_bytes : 0);
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int u = part * DS4_WARP + lane + (it * U + k) * stride;
                if (act && u < nunits) {
                    b.lo[r][k] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u));
                    b.hi[r][k] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u + 16));
                    b.sc[r][k] = ds4_ldg((const ds4_u16*)(row + n_in) + u);
                }
            }
        }
    };
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    // Item j's units times the shared codes; the step's rows are written after its last item.
    auto compute = [&](int j, const Ds4Q8Item<R, U>& b) {
        const int it = j % nit;
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = part * DS4_WARP + lane + (it * U + k) * stride;
            if (u < nunits) {
                const uint4 xa = *(const uint4*)(xq + 32 * u);
                const uint4 xb = *(const uint4*)(xq + 32 * u + 16);
                const float dx = xd[u];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int is = ds4_dot32_i8(b.lo[r][k], b.hi[r][k], xa, xb);
                    acc[r] += (ds4_h2f(b.sc[r][k]) * dx) * (float)is;
                }
            }
        }
        if (it == nit - 1) {
            ds4_finish_rows<R>(acc, y, row0_of(j), n_out, wpr, ok);
            __syncthreads();  // part_sums of ds4_finish_rows are rewritten by the next step
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.f;
        }
    };
    Ds4Q8Item<R, U> b0, b1;
    load(0, b0);
    // Only weights were read so far (overlapped launches, docs/gpu.md §6); the first
    // item's loads are in flight while x is quantized.
    ds4_grid_wait();
    if (fits) ds4_quantize_x4(x, n_in, xq, xd, xs);
    else __syncthreads();
    if (!ok && my_steps > 0) {
        // A bad expert id or an input too wide: NaN rows, as the other engines.
        for (int s = 0; s < my_steps; ++s) {
            ds4_finish_rows<R>(acc, y, row0_of(s * nit), n_out, wpr, false);
            __syncthreads();
        }
        return;
    }
    for (int j = 0; j < nj; j += 2) {
        load(j + 1, b1);
        compute(j, b0);
        if (j + 1 >= nj) break;
        load(j + 2, b0);
        compute(j + 1, b1);
    }
}

// ---------------------------------------------------------------------------------------
// Split-layout Q8_0 with int8 activations for a few independent columns at once (batched
// decode: M <= DS4_Q8M_COLS tokens of different sequences, each its own one-token matmul).
// Each weight unit is loaded once and multiplied with every column's codes, so M tokens
// read the matrix once instead of M times; each column's sum is the one-token kernel's
// (same unit terms, same per-lane order, same reduction, given the same warps per row and
// the default DS4_Q8Q_UNITS=1), so a batched row equals the row computed alone.
//
// The inputs arrive quantized (ds4_quantize_q8_rows, once per step: the one-token kernel's
// ds4_quantize_x4, so the same codes): each block copies its columns' codes and scales into
// shared memory instead of quantizing every column itself — with the quantization in each
// block, a launch cost ~27 µs at 8 columns on the H100 whatever the matrix (BENCHMARKS.md).
// Grid y = group g (matmul_grouped's out_a: matrix g at W0 + g·w_group_bytes, writing
// y0 + g·n_out): column c of group g reads quantized row c·q_col + g (q_col = the groups).
// y holds M rows y_stride apart. Shared memory holds M * n_in <= DS4_Q8M_CODES codes.
// ---------------------------------------------------------------------------------------
// CUDA stages the codes in dynamic shared memory (docs/gpu.md §28): 64 K codes hold eight
// columns of 8192 (out_b's input), which 32 K of static memory split into two launches
// that each read the whole matrix. The host passes n_cols · n_in + 4 · n_cols · n_in / 32
// bytes; a launch given less writes NaN rows. HIP keeps the static 32 K (its runtime here
// passes no dynamic shared memory), as does -DDS4_Q8M_DYN=0 on CUDA (A/B).
#ifndef DS4_Q8M_DYN
#if defined(DS4_HIP)
#define DS4_Q8M_DYN 0
#else
#define DS4_Q8M_DYN 1
#endif
#endif
#if DS4_Q8M_DYN
#define DS4_Q8M_CODES 65536
#else
#define DS4_Q8M_CODES 32768
#endif
extern "C" __device__ const int ds4_gemvq_cols_max[2] = {DS4_Q8M_COLS, DS4_Q8M_CODES};
// {1 when the host passes the codes' dynamic shared memory, 0}.
extern "C" __device__ const int ds4_gemvq_cols_dyn[2] = {DS4_Q8M_DYN, 0};

// Where a column's codes sit in shared memory (docs/gpu.md §24). Lane l of a warp reads unit
// u = 32·k + l, 32 codes, as two 16-byte loads; with the codes in input order the lanes' loads
// are 32 bytes apart, so each load instruction spans 1 KB and costs 8 shared wavefronts for
// 512 useful bytes. Split (default): ds4_xsplit_at's layout, where the lanes of one load read
// 512 consecutive bytes (4 wavefronts). Offsets are in 16-byte vectors from the column's
// start; -DDS4_Q8M_XSPLIT=0 keeps input order (A/B).
#ifndef DS4_Q8M_XSPLIT
#define DS4_Q8M_XSPLIT 1
#endif
__device__ __forceinline__ int ds4_q8m_vec(int u, int half, int nunits) {
#if DS4_Q8M_XSPLIT
    return ds4_xsplit_at(32 * u + 16 * half, 32 * nunits) >> 4;
#else
    return 2 * u + half;
#endif
}

// Item i = c·n + k of a block-strided copy as (c, k), advanced by the block size per item:
// one division at the start instead of one per item.
struct Ds4ColIdx {
    int c, k, n, dc, dk;
    __device__ Ds4ColIdx(int i, int n_, int step)
        : c(i / n_), k(i % n_), n(n_), dc(step / n_), dk(step % n_) {}
    __device__ void next() {
        c += dc;
        k += dk;
        if (k >= n) {
            k -= n;
            ++c;
        }
    }
};

// One block (DS4_GEMV_THREADS) per row r of x (n_in values, rows x_stride floats apart; n_in
// a multiple of 32, at most DS4_Q8_MAX_IN): its codes, 32-value scales and 16-code sums as
// ds4_quantize_x4 makes them inside a GEMV block, at q + r·n_in, d + r·n_in/32, s16 + r·n_in/16.
extern "C" __global__ void __launch_bounds__(DS4_GEMV_THREADS)
    ds4_quantize_q8_rows(const float* __restrict__ x, ds4_size x_stride, int n_in,
                         ds4_i8* __restrict__ q, float* __restrict__ d, int* __restrict__ s16) {
    ds4_grid_wait();
    const ds4_size r = blockIdx.x;
    if (n_in % 32 != 0 || n_in > DS4_Q8_MAX_IN) return;  // the host checks first
    ds4_quantize_x4(x + r * x_stride, n_in, q + r * (ds4_size)n_in, d + r * (ds4_size)(n_in / 32),
                    s16 + r * (ds4_size)(n_in / 16));
}

// Rows per warp of the several-column kernel (-DDS4_Q8M_ROWS=n, an A/B): each column's
// codes, read from shared memory once per unit, serve that many rows, so more rows cut the
// shared-memory reads per weight byte (at 8 columns and two rows the kernel reads 4 bytes
// of codes from shared memory per byte of weights; docs/gpu.md §30). Rows do not change any
// row's sum (its lanes, units, order and warps' parts are the same), only which rows a warp
// takes together.
#ifndef DS4_Q8M_ROWS
#define DS4_Q8M_ROWS DS4_ROWS_Q8_0
#endif
// Loads per thread in flight while the several-column kernel stages its codes (see there).
#ifndef DS4_Q8M_STAGE
#define DS4_Q8M_STAGE 4
#endif
#ifndef DS4_MINB_Q8M
#define DS4_MINB_Q8M DS4_MINB_Q_Q8_0
#endif
extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_Q8M)
    ds4_gemv_cols_q_q8_0(const ds4_u8* __restrict__ W0, ds4_size w_group_bytes,
                         const ds4_i8* __restrict__ xq_g, const float* __restrict__ xd_g,
                         int q_col, float* __restrict__ y0, ds4_size y_stride, int n_in,
                         int n_out, int n_cols, int wpr) {
    constexpr int R = DS4_Q8M_ROWS, MC = DS4_Q8M_COLS;
#if DS4_Q8M_DYN
    DS4_DYN_SHARED(ds4_q8m_smem, DS4_Q8M_CODES + DS4_Q8M_CODES / 8);
    ds4_i8* const xq = (ds4_i8*)ds4_q8m_smem;
    // Codes, then one f32 scale per 32 (n_cols · n_in a multiple of 32: aligned).
    const ds4_size ncodes = (ds4_size)max(0, n_cols) * (ds4_size)max(0, n_in);
    float* const xd = (float*)(ds4_q8m_smem + ncodes);
    const bool given = (ds4_size)ds4_dynamic_smem_bytes() >= ncodes + ncodes / 8;
#else
    __shared__ __align__(16) ds4_i8 xq[DS4_Q8M_CODES];
    __shared__ float xd[DS4_Q8M_CODES / 32];
    const bool given = true;
#endif
    const int g = blockIdx.y;
    const ds4_u8* const W = W0 + (ds4_size)g * w_group_bytes;
    float* const y = y0 + (ds4_size)g * n_out;
    const bool ok = n_in % 32 == 0 && n_in <= DS4_Q8_MAX_IN && n_cols >= 1 && n_cols <= MC &&
                    (ds4_size)n_cols * n_in <= DS4_Q8M_CODES && given;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int gpb = DS4_GEMV_WARPS / wpr;
    const int nsteps = (n_out + R * gpb - 1) / (R * gpb);
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nunits = n_in / 32;
    const int stride = DS4_WARP * wpr;
    const int nit = max(1, (nunits + stride - 1) / stride);
    const int my_steps =
        (int)blockIdx.x < nsteps ? (nsteps - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int nj = ok ? my_steps * nit : 0;
    auto row0_of = [&](int j) {
        return (((int)blockIdx.x + (j / nit) * (int)gridDim.x) * gpb + warp / wpr) * R;
    };
    auto load = [&](int j, Ds4Q8Item<R, 1>& b) {
        const int row0 = row0_of(j);
        const int u = part * DS4_WARP + lane + (j % nit) * stride;
        const bool act = j < nj && row0 < n_out && u < nunits;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (act) {
                const ds4_u8* row = W + (ds4_size)min(row0 + r, n_out - 1) * row_bytes;
                b.lo[r][0] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u));
                b.hi[r][0] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u + 16));
                b.sc[r][0] = ds4_ldg((const ds4_u16*)(row + n_in) + u);
            }
        }
    };
    float acc[MC][R];
#pragma unroll
    for (int c = 0; c < MC; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[c][r] = 0.f;
    auto compute = [&](int j, const Ds4Q8Item<R, 1>& b) {
        const int u = part * DS4_WARP + lane + (j % nit) * stride;
        if (u < nunits) {
            const int vlo = ds4_q8m_vec(u, 0, nunits), vhi = ds4_q8m_vec(u, 1, nunits);
#pragma unroll
            for (int c = 0; c < MC; ++c) {
                if (c < n_cols) {
                    const uint4* xc = (const uint4*)(xq + (ds4_size)c * n_in);
                    const uint4 xa = xc[vlo];
                    const uint4 xb = xc[vhi];
                    const float dx = xd[c * (n_in / 32) + u];
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const int is = ds4_dot32_i8(b.lo[r][0], b.hi[r][0], xa, xb);
                        acc[c][r] += (ds4_h2f(b.sc[r][0]) * dx) * (float)is;
                    }
                }
            }
        }
        if (j % nit == nit - 1) {
            ds4_finish_cols<R, MC>(acc, y, y_stride, row0_of(j), n_out, wpr, n_cols);
            __syncthreads();  // the parts are rewritten by the next step
#pragma unroll
            for (int c = 0; c < MC; ++c)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[c][r] = 0.f;
        }
    };
    Ds4Q8Item<R, 1> b0, b1;
    load(0, b0);
    ds4_grid_wait();  // only weights were read so far (docs/gpu.md §6)
    if (ok) {
        // The columns' codes and scales, written by the previous launch (coherent loads),
        // DS4_Q8M_STAGE loads per thread in flight before the first store: a loop of one
        // load and one store waited one L2 round trip per 4 KB of codes (8 codes trips and
        // 4 scale trips per block at 8 columns of 4096), with only the first weights in
        // flight meanwhile (docs/gpu.md §35). -DDS4_Q8M_STAGE=1 is the old loop (A/B).
        const int v16 = n_in / 16, nb = n_in / 32;
        const int ncv = n_cols * v16, ncs = n_cols * nb;
        // (column, index) of the thread's items, stepped without a division per item.
        const int bd = blockDim.x;
        Ds4ColIdx cv{(int)threadIdx.x, v16, bd}, cs{(int)threadIdx.x, nb, bd};
        for (int i0 = threadIdx.x; i0 < ncv; i0 += DS4_Q8M_STAGE * bd) {  // ncs = ncv / 2
            uint4 v[DS4_Q8M_STAGE];
            float f[DS4_Q8M_STAGE];
            Ds4ColIdx lv = cv, ls = cs;
#pragma unroll
            for (int k = 0; k < DS4_Q8M_STAGE; ++k) {
                const int i = i0 + k * bd;
                if (i < ncv)
                    v[k] = ds4_ld_act((const uint4*)xq_g + ((ds4_size)lv.c * q_col + g) * v16 + lv.k);
                if (i < ncs) f[k] = ds4_ld_act(xd_g + ((ds4_size)ls.c * q_col + g) * nb + ls.k);
                lv.next();
                ls.next();
            }
#pragma unroll
            for (int k = 0; k < DS4_Q8M_STAGE; ++k) {
                const int i = i0 + k * bd;
                if (i < ncv) ((uint4*)xq)[cv.c * v16 + ds4_q8m_vec(cv.k >> 1, cv.k & 1, nb)] = v[k];
                if (i < ncs) xd[i] = f[k];
                cv.next();
                cs.next();
            }
        }
        __syncthreads();
    } else {
        // Unsupported shape: NaN rows (the host checks first), as the other engines.
        for (int s = 0; s < my_steps; ++s)
            for (int c = 0; c < max(1, min(n_cols, MC)); ++c) {
                float z[R] = {};
                ds4_finish_rows<R>(z, y + (ds4_size)c * y_stride, row0_of(s * nit), n_out, wpr,
                                   false);
                __syncthreads();
            }
        return;
    }
    for (int j = 0; j < nj; j += 2) {
        load(j + 1, b1);
        compute(j, b0);
        if (j + 1 >= nj) break;
        load(j + 2, b0);
        compute(j + 1, b1);
    }
}

// ---------------------------------------------------------------------------------------
// Int8 activations for any row alignment (the tiny models' rows are not 16-byte
// multiples): one warp per row, each lane one 32-value unit at a time read byte-wise from
// global memory. The per-unit terms are written exactly as the CPU backend's
// (ds4_gguf::quant::q8act): same integer sums, same float expression.
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ float ds4_f16_at(const ds4_u8* p) {
    return ds4_h2f((ds4_u16)((ds4_u32)p[0] | ((ds4_u32)p[1] << 8)));
}

// Term of 32-value unit u of a row of n_in values of type `ty` (DS4_T_Q8_0 in the split
// layout, DS4_T_Q2_K, DS4_T_Q4_K or IQ2_XXS; the types ds4_gguf::quant::q8act::applies
// names).
__device__ float ds4_q8_unit_term(int ty, const ds4_u8* row, int n_in, int u, const ds4_i8* xq,
                                  const float* xd, const ds4_u64* grid, const ds4_u8* ksigns) {
    const float dx = xd[u];
    const ds4_i8* x = xq + 32 * u;
    const int b = u >> 3, i = u & 7;
    if (ty == DS4_T_Q8_0) {
        const ds4_u8* c = row + 32 * u;
        int is = 0;
        for (int m = 0; m < 32; ++m) is += (int)(ds4_i8)c[m] * (int)x[m];
        return (ds4_f16_at(row + n_in + 2 * u) * dx) * (float)is;
    }
    if (ty == DS4_T_Q2_K) {
        const ds4_u8* blk = row + 84 * b;
        const float d = ds4_f16_at(blk + 80), dmin = ds4_f16_at(blk + 82);
        int A = 0, B = 0;
        for (int half = 0; half < 2; ++half) {
            const int sb = 2 * i + half;
            const int h = sb >> 3, j = (sb >> 1) & 3;
            const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
            int is = 0, xs = 0;
            for (int m = 0; m < 16; ++m) {
                is += (int)((qs[m] >> (2 * j)) & 3) * (int)x[16 * half + m];
                xs += (int)x[16 * half + m];
            }
            A += (int)(blk[sb] & 15) * is;
            B += (int)(blk[sb] >> 4) * xs;
        }
        return dx * (d * (float)A - dmin * (float)B);
    }
    if (ty == DS4_T_Q4_K) {
        const ds4_u8* blk = row + 144 * b;
        const float d = ds4_f16_at(blk), dmin = ds4_f16_at(blk + 2);
        const ds4_u8* sp = blk + 4;
        const int j = i;
        int sc, mn;
        ds4_q4k_scale_min(sp, j, &sc, &mn);
        const ds4_u8* qs = blk + 16 + 32 * (j >> 1);
        int is = 0, xs = 0;
        for (int m = 0; m < 32; ++m) {
            is += (int)((qs[m] >> (4 * (j & 1))) & 15) * (int)x[m];
            xs += (int)x[m];
        }
        return dx * (d * (float)(sc * is) - dmin * (float)(mn * xs));
    }
    // IQ2_XXS: group i of block b.
    const ds4_u8* blk = row + 66 * b;
    const float d = ds4_f16_at(blk);
    const ds4_u8* gp = blk + 2 + 8 * i;
    const ds4_u32 w1 = (ds4_u32)gp[4] | ((ds4_u32)gp[5] << 8) | ((ds4_u32)gp[6] << 16) |
                       ((ds4_u32)gp[7] << 24);
    const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
    int is = 0;
    for (int k = 0; k < 4; ++k) {
        const ds4_u64 g = grid[gp[k]];
        const ds4_u32 sg = ksigns[(w1 >> (7 * k)) & 127];
        for (int e = 0; e < 8; ++e) {
            const int v = (int)((g >> (8 * e)) & 0xff);
            is += (((sg >> e) & 1u) ? -v : v) * (int)x[8 * k + e];
        }
    }
    return (db * dx) * (float)is;
}

// y[n_out] = W · q8(x): grid x = ceil(n_out / 8) blocks of 256 threads, one warp per row.
extern "C" __global__ void __launch_bounds__(DS4_GEMV_THREADS)
    ds4_gemvq_generic(const ds4_u8* __restrict__ W, int ty, ds4_size row_bytes,
                      const float* __restrict__ x, float* __restrict__ y, int n_in, int n_out) {
    ds4_grid_wait();
    __shared__ Ds4XQBuf xbuf;
    ds4_i8* const xq = xbuf.q;
    float* const xd = xbuf.d;
    int* const xs = xbuf.s16;
    __shared__ ds4_u64 grid[256];
    __shared__ ds4_u8 ksigns[128];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) grid[i] = ds4_iq2xxs_grid[i];
    for (int i = threadIdx.x; i < 128; i += blockDim.x) ksigns[i] = ds4_iq2xxs_ksigns[i];
    const bool ok = n_in <= DS4_Q8_MAX_IN && n_in % 32 == 0;
    if (ok) ds4_quantize_x(x, n_in, xq, xd, xs);
    else __syncthreads();
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row = blockIdx.x * DS4_GEMV_WARPS + warp;
    if (row >= n_out) return;
    float acc = 0.f;
    if (ok) {
        const ds4_u8* r = W + (ds4_size)row * row_bytes;
        for (int u = lane; u < n_in / 32; u += DS4_WARP)
            acc += ds4_q8_unit_term(ty, r, n_in, u, xq, xd, grid, ksigns);
    }
    acc = ds4_warp_sum(acc);
    if (lane == 0) y[row] = ok ? acc : __int_as_float(0x7fc00000);
}

// Launch configuration compiled into this module, read by the host after loading:
// {rows per warp, blocks per chunk (plain types: vectors per lane pass = 32)}.
#define DS4_GEMV_CONFIG(NAME, ROWS, CB) \
    extern "C" __device__ const int ds4_gemv_config_##NAME[2] = {ROWS, CB};
DS4_GEMV_CONFIG(f32, DS4_GEMV_PLAIN_ROWS, 32)
DS4_GEMV_CONFIG(f16, DS4_GEMV_PLAIN_ROWS, 32)
DS4_GEMV_CONFIG(q8_0, Ds4Q8S::ROWS, 16)
DS4_GEMV_CONFIG(q2_k, Ds4Q2K::ROWS, Ds4Q2K::cb(Ds4Q2K::ROWS))
DS4_GEMV_CONFIG(q4_k, Ds4Q4K::ROWS, Ds4Q4K::cb(Ds4Q4K::ROWS))
DS4_GEMV_CONFIG(iq2_xxs, Ds4Iq2Xxs::ROWS, Ds4Iq2Xxs::cb(Ds4Iq2Xxs::ROWS))

// ---------------------------------------------------------------------------------------
// Entry points. Grid: x = ceil(n_out / (R * 8 / wpr)) blocks of 256 threads, R the
// rows per warp of ds4_gemv_config_<t>.
//
// ds4_gemv_<t>(W, x, y, n_in, n_out, wpr): y[n_out] = W[n_out][n_in] · x[n_in].
//
// ds4_gemv_grouped_<t>(W0, W1, expert_bytes, ids, n_experts, x, x_stride, y0, y1, n_in,
// n_out, wpr): routed experts. Grid y = selection s (n_sel), grid z = matrix m (1 or 2).
// Expert e of matrix m starts at (m ? W1 : W0) + e·expert_bytes; with e = ids[s]:
// (m ? y1 : y0)[s·n_out + r] = row r of that expert · x[s·x_stride ..]. x_stride = 0
// shares one x (gate and up); x_stride = n_in gives each selection its own input (down).
// An id outside [0, n_experts) makes that selection's outputs NaN instead of reading out
// of bounds.
// ---------------------------------------------------------------------------------------

#define DS4_GEMV_ENTRY(NAME, ENGINE, FMT, MINB)                                                 \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                   \
        ds4_gemv_##NAME(const ds4_u8* __restrict__ W, const float* __restrict__ x,          \
                        float* __restrict__ y, int n_in, int n_out, int wpr) {              \
        ENGINE<FMT>(W, x, y, n_in, n_out, wpr, true);                                       \
    }                                                                                       \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                   \
        ds4_gemv_grouped_##NAME(const ds4_u8* __restrict__ W0, const ds4_u8* __restrict__ W1, \
                                ds4_size expert_bytes, const ds4_i32* __restrict__ ids,     \
                                int n_experts, const float* __restrict__ x,                 \
                                ds4_size x_stride, float* __restrict__ y0,                  \
                                float* __restrict__ y1, int n_in, int n_out, int wpr) {     \
        ds4_grid_wait(); /* the ids come from the router */                                 \
        const int sel = blockIdx.y;                                                         \
        const int id = ids[sel];                                                            \
        const bool ok = id >= 0 && id < n_experts;                                          \
        const ds4_u8* base = blockIdx.z ? W1 : W0;                                          \
        const ds4_u8* W = base + (ok ? (ds4_size)id * expert_bytes : 0);                    \
        float* y = (blockIdx.z ? y1 : y0) + (ds4_size)sel * n_out;                          \
        ENGINE<FMT>(W, x + (ds4_size)sel * x_stride, y, n_in, n_out, wpr, ok);              \
    }

DS4_GEMV_ENTRY(f32, ds4_gemv_plain, Ds4F32, DS4_MINB_PLAIN)
DS4_GEMV_ENTRY(f16, ds4_gemv_plain, Ds4F16, DS4_MINB_PLAIN)

// The router's matmul and the router for one token in one launch (docs/gpu.md §17): the F16
// GEMV of ds4_gemv_f16 writes the logits row y, then every block fences and counts itself in
// *counter; the block that completes the count resets it for the next launch and runs the
// router (ds4_router_token, what ds4_router_warp runs) on y with its first warp.
extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_PLAIN)
    ds4_gemv_router_f16(const ds4_u8* __restrict__ W, const float* __restrict__ x, float* y,
                        int n_in, int n_out, int wpr, int k, float rscale, int mode,
                        const float* bias, const ds4_u8* table, int table_rows,
                        const int* tokens, int* ids, float* weights, int* fault, int* counter) {
    ds4_gemv_plain<Ds4F16>(W, x, y, n_in, n_out, wpr, true);
    __shared__ int s_last;
    ds4_fence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(counter, 1);
        s_last = done == (int)gridDim.x - 1;
        if (s_last) *counter = 0;
    }
    __syncthreads();
    if (!s_last) return;
    ds4_fence();
    if (threadIdx.x < DS4_WARP)
        ds4_router_token(y, 0, n_out, k, rscale, mode, bias, table, table_rows, tokens, ids,
                         weights, fault, threadIdx.x);
}
// Several columns (batched decode): y[c * y_stride + r] = row r · x[c * x_stride ..] for
// c < n_cols <= DS4_Q8M_COLS; warps per row as ds4_gemv_<t>, DS4_PLAIN_COLS_ROWS rows per warp
// (grid: kernels::cols_grid_x). More than four rows per warp hold 8·R column sums and R weight
// vectors per step: one block
// per multiprocessor (up to 255 registers) rather than spilling at two.
#ifndef DS4_MINB_PLAIN_COLS
#define DS4_MINB_PLAIN_COLS (DS4_PLAIN_COLS_ROWS > 4 ? 1 : 2)
#endif
#define DS4_GEMV_COLS_ENTRY(NAME, FMT)                                                          \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_PLAIN_COLS)        \
        ds4_gemv_cols_##NAME(const ds4_u8* __restrict__ W, const float* __restrict__ x,        \
                             ds4_size x_stride, float* __restrict__ y, ds4_size y_stride,      \
                             int n_in, int n_out, int n_cols, int wpr) {                       \
        ds4_gemv_plain_cols<FMT>(W, x, x_stride, y, y_stride, n_in, n_out, n_cols, wpr);       \
    }
DS4_GEMV_COLS_ENTRY(f32, Ds4F32)
DS4_GEMV_COLS_ENTRY(f16, Ds4F16)
// Several columns with one column per grid y (docs/gpu.md §23): every block is a block of the
// one-token ds4_gemv_<t> launch for its column, so each column's rows are that launch's bit
// for bit. For matrices whose one-token grid is small (a few rows: the several-column engine
// above then runs its columns one after another in a handful of warps), at the price of
// reading the matrix once per column (from L2 for such sizes).
#define DS4_GEMV_COLSPLIT_ENTRY(NAME, FMT)                                                      \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_PLAIN)             \
        ds4_gemv_colsplit_##NAME(const ds4_u8* __restrict__ W, const float* __restrict__ x,    \
                                 ds4_size x_stride, float* __restrict__ y, ds4_size y_stride,  \
                                 int n_in, int n_out, int wpr) {                               \
        ds4_gemv_plain<FMT>(W, x + (ds4_size)blockIdx.y * x_stride,                             \
                            y + (ds4_size)blockIdx.y * y_stride, n_in, n_out, wpr, true);      \
    }
DS4_GEMV_COLSPLIT_ENTRY(f32, Ds4F32)
DS4_GEMV_COLSPLIT_ENTRY(f16, Ds4F16)
// The register-staged Q8_0 engine by default: on the H200 (2026-12-04, ds4-gpu-check
// graphs) it read 1024->32768 in 15.2 us and 4096->8192 in 13.3 us against the cp.async
// ring's 17.6 / 16.9 us (4 stages; 3 or 5 stages, or 4 rows x 2 stages, no better), so
// bytes in flight were not what bounded it. -DDS4_Q8S_REGS=0 selects the ring for A/B.
#ifndef DS4_Q8S_REGS
#define DS4_Q8S_REGS 1
#endif
#if DS4_Q8S_REGS
#define DS4_Q8_ENGINE ds4_gemv_q8s
#else
#define DS4_Q8_ENGINE ds4_gemv_q8a
#endif
DS4_GEMV_ENTRY(q8_0, DS4_Q8_ENGINE, Ds4Q8S, DS4_MINB_Q8_0)
DS4_GEMV_ENTRY(q2_k, ds4_gemv_quant, Ds4Q2K, DS4_MINB_Q2_K)
DS4_GEMV_ENTRY(q4_k, ds4_gemv_quant, Ds4Q4K, DS4_MINB_Q4_K)
DS4_GEMV_ENTRY(iq2_xxs, ds4_gemv_quant, Ds4Iq2Xxs, DS4_MINB_IQ2_XXS)

// Int8-activation entry points: same arguments as ds4_gemv_<t> / ds4_gemv_grouped_<t>,
// persistent grids (any number of blocks along x); n_in <= DS4_Q8_MAX_IN (else the
// outputs are NaN).
DS4_GEMV_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)
DS4_GEMV_ENTRY(q_q2_k, ds4_gemvq_quant, Ds4Q2Kx, DS4_MINB_Q2_K)
DS4_GEMV_ENTRY(q_q4_k, ds4_gemvq_quant, Ds4Q4Kx, DS4_MINB_Q4_K)
DS4_GEMV_ENTRY(q_iq2_xxs, ds4_gemvq_quant, Ds4Iq2XxsxOne, DS4_MINB_IQ2_XXS)

// The same with the input computed from SwiGLU on the way (Ds4XSwiglu, docs/gpu.md §17):
// ds4_gemv_swiglu_q_<t>(W, g, u, c, y, n_in, n_out, wpr): y = W · swiglu(g, u, c) (the shared
// expert's down projection); ds4_gemv_grouped_swiglu_q_<t>(W, expert_bytes, ids, n_experts,
// g, u, route_w, c, y, n_in, n_out, wpr, fault): selection s = blockIdx.y, expert ids[s]:
// y[s·n_out ..] = that expert's W · (route_w[s] · swiglu(g[s·n_in ..], u[s·n_in ..], c)) (the
// routed experts' down projection after ds4_moe_act, whose id check it takes over: a bad id
// gives NaN rows and sets the fault bit). g, u 16-byte aligned, n_in a multiple of 32.
#define DS4_GEMV_SWIGLU_ENTRY(NAME, ENGINE, FMT, MINB)                                           \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                     \
        ds4_gemv_swiglu_##NAME(const ds4_u8* __restrict__ W, const float* g, const float* u,   \
                               float c, float* __restrict__ y, int n_in, int n_out, int wpr) { \
        ENGINE<FMT>(W, Ds4XSwiglu{g, u, c, 1.0f}, y, n_in, n_out, wpr, true);                \
    }
#define DS4_GEMV_GROUPED_SWIGLU_ENTRY(NAME, ENGINE, FMT, MINB)                                   \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                     \
        ds4_gemv_grouped_swiglu_##NAME(                                                       \
            const ds4_u8* __restrict__ W0, ds4_size expert_bytes, const ds4_i32* __restrict__ ids, \
            int n_experts, const float* g, const float* u, const float* route_w, float c,     \
            float* __restrict__ y0, int n_in, int n_out, int wpr, int* fault) {                \
        ds4_grid_wait(); /* ids, g, u and the route weights come from earlier kernels */      \
        const int sel = blockIdx.y;                                                           \
        const int id = ids[sel];                                                              \
        const bool ok = id >= 0 && id < n_experts;                                            \
        if (!ok && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(fault, DS4_GEMV_FAULT_EXPERT); \
        const ds4_u8* W = W0 + (ok ? (ds4_size)id * expert_bytes : 0);                       \
        const ds4_size off = (ds4_size)sel * n_in;                                            \
        const Ds4XSwiglu xin{g + off, u + off, c, ds4_ld_act(route_w + sel)};                 \
        ENGINE<FMT>(W, xin, y0 + (ds4_size)sel * n_out, n_in, n_out, wpr, ok);               \
    }
// ops.cu's DS4_FAULT_EXPERT (the bit ds4_moe_act sets for a bad expert id).
#define DS4_GEMV_FAULT_EXPERT 2
// The shared expert's down projection is Q8_0 in every ds4 layout; the routed experts' down
// is Q2_K, Q4_K or IQ2_XXS. (Each entry point costs NVRTC compile time at first start.)
DS4_GEMV_SWIGLU_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_q2_k, ds4_gemvq_quant, Ds4Q2Kx, DS4_MINB_Q2_K)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_q4_k, ds4_gemvq_quant, Ds4Q4Kx, DS4_MINB_Q4_K)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_iq2_xxs, ds4_gemvq_quant, Ds4Iq2XxsxOne, DS4_MINB_IQ2_XXS)

// Flat grouped launches (docs/gpu.md §25): the routed experts' matrices of a batched decode
// step as the jobs of one flat grid. Job p is selection p / mats, matrix p % mats (gate and
// up of one selection follow each other and share its input).
struct Ds4Experts {
    const ds4_u8* W0;
    const ds4_u8* W1;
    ds4_size expert_bytes;
    const ds4_i32* ids;  // written by the router: plain loads after the grid wait
    int n_experts, n_sel, mats;
    float* y0;
    float* y1;
    int n_out;
    static constexpr bool FLAT = true;
    __device__ int count() const { return n_sel * mats; }
    __device__ int sel(int p) const { return p / mats; }
    __device__ bool ok(int p) const {
        const int id = ids[sel(p)];
        return id >= 0 && id < n_experts;
    }
    __device__ const ds4_u8* w(int p) const {
        const ds4_u8* base = p % mats ? W1 : W0;
        return base + (ok(p) ? (ds4_size)ids[sel(p)] * expert_bytes : 0);
    }
    __device__ float* y(int p) const { return (p % mats ? y1 : y0) + (ds4_size)sel(p) * n_out; }
};
// Gate and up: selection s reads row s / x_div of x (x_stride floats apart): x_div = the
// selections per token gives each token's row to its selections without copying it.
struct Ds4JobsExperts : Ds4Experts {
    const float* x;
    ds4_size x_stride;
    int x_div;
    __device__ long long key(int p) const { return sel(p) / x_div; }
    __device__ const float* input(int p) const { return x + (ds4_size)key(p) * x_stride; }
};
// Down: selection s's input is route_w[s] · SwiGLU(g, u) of its own rows (Ds4XSwiglu).
struct Ds4JobsExpertsSwiglu : Ds4Experts {
    const float* g;
    const float* u;
    const float* route_w;
    float c;
    int n_in;
    __device__ long long key(int p) const { return sel(p); }
    __device__ Ds4XSwiglu input(int p) const {
        const ds4_size off = (ds4_size)sel(p) * n_in;
        return Ds4XSwiglu{g + off, u + off, c, ds4_ld_act(route_w + sel(p))};
    }
};
// ds4_gemv_flat_q_<t>(W0, W1, expert_bytes, ids, n_experts, n_sel, mats, x, x_stride, x_div,
// y0, y1, n_in, n_out, wpr): ds4_gemv_grouped_q_<t>'s outputs (matrix m of selection s into
// (m ? y1 : y0)[s·n_out ..]) on a flat grid of any size along x, selection s reading x row
// s / x_div. ds4_gemv_flat_swiglu_q_<t>(W0, expert_bytes, ids, n_experts, n_sel, g, u,
// route_w, c, y0, n_in, n_out, wpr, fault): ds4_gemv_grouped_swiglu_q_<t>'s.
#define DS4_GEMV_FLAT_ENTRY(NAME, FMT, MINB)                                                    \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB) ds4_gemv_flat_##NAME(  \
        const ds4_u8* __restrict__ W0, const ds4_u8* __restrict__ W1, ds4_size expert_bytes,    \
        const ds4_i32* ids, int n_experts, int n_sel, int mats, const float* x,                 \
        ds4_size x_stride, int x_div, float* y0, float* y1, int n_in, int n_out, int wpr) {     \
        const Ds4Experts e{W0, W1, expert_bytes, ids, n_experts, n_sel, mats, y0, y1, n_out};   \
        ds4_gemvq_jobs<FMT>(Ds4JobsExperts{e, x, x_stride, max(1, x_div)}, n_in, n_out, wpr);   \
    }                                                                                           \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                        \
        ds4_gemv_flat_swiglu_##NAME(const ds4_u8* __restrict__ W0, ds4_size expert_bytes,       \
                                    const ds4_i32* ids, int n_experts, int n_sel, const float* g, \
                                    const float* u, const float* route_w, float c, float* y0,   \
                                    int n_in, int n_out, int wpr, int* fault) {                 \
        const Ds4Experts e{W0, W0, expert_bytes, ids, n_experts, n_sel, 1, y0, y0, n_out};      \
        ds4_grid_wait();                                                                        \
        if (blockIdx.x == 0)                                                                    \
            for (int s = threadIdx.x; s < n_sel; s += blockDim.x)                               \
                if (!e.ok(s)) atomicOr(fault, DS4_GEMV_FAULT_EXPERT);                           \
        ds4_gemvq_jobs<FMT>(Ds4JobsExpertsSwiglu{e, g, u, route_w, c, n_in}, n_in, n_out, wpr); \
    }
DS4_GEMV_FLAT_ENTRY(q_q2_k, Ds4Q2Kx, DS4_MINB_Q2_K)
DS4_GEMV_FLAT_ENTRY(q_q4_k, Ds4Q4Kx, DS4_MINB_Q4_K)
DS4_GEMV_FLAT_ENTRY(q_iq2_xxs, Ds4Iq2XxsxFlat, DS4_MINB_IQ2_XXS)

// ds4_gemv_rmsnorm_q_<t>(W, x, norm_w, eps, y, n_in, n_out, wpr, h): y = W · (rms_norm(x) ·
// norm_w) (Ds4XNorm; the query path's low-rank norm before q_b), and block 0 writes the
// normalized vector to h (for the indexer's up-projection, which reads it later); x, norm_w
// and h 16-byte aligned, n_in a multiple of 32.
#define DS4_GEMV_RMSNORM_ENTRY(NAME, ENGINE, FMT, MINB)                                          \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                     \
        ds4_gemv_rmsnorm_##NAME(const ds4_u8* __restrict__ W, const float* x, const float* nw, \
                                float eps, float* __restrict__ y, int n_in, int n_out, int wpr, \
                                float* h) {                                                   \
        const Ds4XNorm xin{x, nw, eps, blockIdx.x == 0 ? h : nullptr, 0.0f};                  \
        ENGINE<FMT>(W, xin, y, n_in, n_out, wpr, true);                                       \
    }
// q_b is Q8_0 in every ds4 layout.
DS4_GEMV_RMSNORM_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)

// ds4_gemv_grouped_rope_q_q8_0(W, group_bytes, x, freqs, head_dim, rope_dim, p, inverse, y,
// n_in, n_out, wpr): out_a, one group per blockIdx.y: y[g·n_out ..] = group g's rows ·
// (x[g·n_in ..] with every head's last rope_dim dims rotated at position p: Ds4XRope);
// n_in a multiple of head_dim (groups start at head boundaries), x 16-byte aligned. out_a is
// Q8_0 in every ds4 layout.
extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_Q_Q8_0)
    ds4_gemv_grouped_rope_q_q8_0(const ds4_u8* __restrict__ W0, ds4_size group_bytes,
                                 const float* x, const float* freqs, int head_dim, int rope_dim,
                                 float p, int inverse, float* __restrict__ y0, int n_in, int n_out,
                                 int wpr) {
    const int g = blockIdx.y;
    const Ds4XRope xin{x + (ds4_size)g * n_in, freqs, head_dim, rope_dim, p, inverse};
    ds4_gemvq_q8s<Ds4Q8Sx>(W0 + (ds4_size)g * group_bytes, xin, y0 + (ds4_size)g * n_out, n_in,
                           n_out, wpr, true);
}
