// gemv.cu: batch-1 matrix-vector products y = W x for every ds4 weight type.
//
// W is a row-major [n_out][n_in] matrix in ggml layout: one row of n_in elements is n_in/BE
// consecutive blocks of the row's type. x and y are f32. Accumulation is f32 throughout.
//
// Work split. A block of 256 threads holds 8 logical warps. `wpr` (warps per row: 1, 2, 4
// or 8, chosen by the host so that small-n_out matrices still fill the GPU) warps share
// one output row: the row is cut into chunks and warp `part` takes chunks part, part+wpr,
// ... . Partial sums are reduced with warp shuffles, then across the row's warps through
// shared memory, and exactly one thread writes y[row]. Every row < n_out is written on
// every launch, also when its inputs are invalid (then with NaN), so a poisoned output
// buffer shows any row that was missed.
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

#define DS4_GEMV_THREADS 256
#define DS4_GEMV_WARPS (DS4_GEMV_THREADS / DS4_WARP)

// Tuning knobs (the host may pass -D options; the defaults are what the engine uses):
// minimum resident blocks per multiprocessor (caps registers: 4 -> 64 per thread) and
// the unroll factor of the unit loop over a staged chunk.
#ifndef DS4_GEMV_MIN_BLOCKS
#define DS4_GEMV_MIN_BLOCKS 4
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

__device__ __forceinline__ float4 ds4_ld_x4(const float* p) {
    return ds4_ldg((const float4*)p);
}

// Lookup tables a format needs in shared memory (IQ2_XXS only).
struct Ds4Tables {
    const ds4_u64* grid;
    const ds4_u8* signs;
};

// ---------------------------------------------------------------------------------------
// Block formats. Each describes: BE elements and BB bytes per block, CB blocks per staged
// chunk (CB*BB a multiple of 16), UPB decode units per block, and unit(): the dot product
// of one unit with x, reading the block from shared memory `s` (the chunk) and x from
// `xc` (x at the chunk's first element).
// ---------------------------------------------------------------------------------------

// Q8_0: 34-byte blocks of 32: d f16 @0, q i8[32] @2. Unit = 8 values.
struct Ds4Q8_0 {
    static constexpr int BE = 32, BB = 34, CB = 56, UPB = 4;
    __device__ static Ds4Tables prologue() { return Ds4Tables{nullptr, nullptr}; }
    __device__ static float unit(const ds4_u8* s, int u, const float* xc, Ds4Tables) {
        const int b = u >> 2, q = u & 3;
        const ds4_u8* blk = s + b * BB;
        const float d = ds4_h2f(ds4_ld_u16(blk));
        const ds4_u8* qs = blk + 2 + 8 * q;
        const ds4_u32 w0 = ds4_ld_u16(qs), w1 = ds4_ld_u16(qs + 2);
        const ds4_u32 w2 = ds4_ld_u16(qs + 4), w3 = ds4_ld_u16(qs + 6);
        const float4 xa = ds4_ld_x4(xc + b * BE + 8 * q);
        const float4 xb = ds4_ld_x4(xc + b * BE + 8 * q + 4);
        float sum = (float)(ds4_i8)(w0 & 0xff) * xa.x;
        sum += (float)(ds4_i8)(w0 >> 8) * xa.y;
        sum += (float)(ds4_i8)(w1 & 0xff) * xa.z;
        sum += (float)(ds4_i8)(w1 >> 8) * xa.w;
        sum += (float)(ds4_i8)(w2 & 0xff) * xb.x;
        sum += (float)(ds4_i8)(w2 >> 8) * xb.y;
        sum += (float)(ds4_i8)(w3 & 0xff) * xb.z;
        sum += (float)(ds4_i8)(w3 >> 8) * xb.w;
        return d * sum;
    }
};

// Sum of code(k)·x[k] and of x[k] over four values whose 2- or 4-bit codes sit in the low
// bits of the four bytes of q (already shifted), masked with `mask`.
__device__ __forceinline__ void ds4_codes4(ds4_u32 q, ds4_u32 mask, float4 xv, float& sqx,
                                           float& sx) {
    sqx += (float)(q & mask) * xv.x;
    sqx += (float)((q >> 8) & mask) * xv.y;
    sqx += (float)((q >> 16) & mask) * xv.z;
    sqx += (float)((q >> 24) & mask) * xv.w;
    sx += (xv.x + xv.y) + (xv.z + xv.w);
}

// Q2_K: 84-byte blocks of 256: scales u8[16] @0 (low nibble scale, high nibble min),
// qs u8[64] @16, d f16 @80, dmin f16 @82. Unit = sub-block sb of 16 values: value
// 16·sb + m has its code in bits 2j..2j+1 of qs[32h + 16·half + m], sb = 8h + 2j + half.
struct Ds4Q2K {
    static constexpr int BE = 256, BB = 84, CB = 24, UPB = 16;
    __device__ static Ds4Tables prologue() { return Ds4Tables{nullptr, nullptr}; }
    __device__ static float unit(const ds4_u8* s, int u, const float* xc, Ds4Tables) {
        const int b = u >> 4, sb = u & 15;
        const ds4_u8* blk = s + b * BB;
        const ds4_u32 dd = ds4_ld_u32(blk + 80);
        const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
        const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
        const ds4_u32 sc = blk[sb];
        const int h = sb >> 3, j = (sb >> 1) & 3, half = sb & 1;
        const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
        const float* xs = xc + b * BE + 16 * sb;
        float sqx = 0.f, sx = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const ds4_u32 q = ds4_ld_u32(qs + 4 * w) >> (2 * j);
            ds4_codes4(q, 3u, ds4_ld_x4(xs + 4 * w), sqx, sx);
        }
        return d * (float)(sc & 15) * sqx - dmin * (float)(sc >> 4) * sx;
    }
};

// Q4_K: 144-byte blocks of 256: d f16 @0, dmin f16 @2, 12 bytes of packed 6-bit scales and
// mins @4, qs u8[128] @16. Sub-block j (32 values) uses qs[32·(j/2) ..] shifted by
// 4·(j%2). Unit t = 2j + half = 16 values starting at element 16t.
struct Ds4Q4K {
    static constexpr int BE = 256, BB = 144, CB = 14, UPB = 16;
    __device__ static Ds4Tables prologue() { return Ds4Tables{nullptr, nullptr}; }
    __device__ static float unit(const ds4_u8* s, int u, const float* xc, Ds4Tables) {
        const int b = u >> 4, t = u & 15, j = t >> 1, half = t & 1;
        const ds4_u8* blk = s + b * BB;
        const ds4_u32 dd = ds4_ld_u32(blk);
        const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
        const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
        const ds4_u8* sp = blk + 4;
        ds4_u32 sc, mn;
        if (j < 4) {
            sc = sp[j] & 63;
            mn = sp[j + 4] & 63;
        } else {
            sc = (sp[j + 4] & 0xF) | ((sp[j - 4] >> 6) << 4);
            mn = (sp[j + 4] >> 4) | ((sp[j] >> 6) << 4);
        }
        const uint4 qv = *(const uint4*)(blk + 16 + 32 * (j >> 1) + 16 * half);
        const int shift = 4 * (j & 1);
        const float* xs = xc + b * BE + 16 * t;
        float sqx = 0.f, sx = 0.f;
        ds4_codes4(qv.x >> shift, 15u, ds4_ld_x4(xs), sqx, sx);
        ds4_codes4(qv.y >> shift, 15u, ds4_ld_x4(xs + 4), sqx, sx);
        ds4_codes4(qv.z >> shift, 15u, ds4_ld_x4(xs + 8), sqx, sx);
        ds4_codes4(qv.w >> shift, 15u, ds4_ld_x4(xs + 12), sqx, sx);
        return d * (float)sc * sqx - dmin * (float)mn * sx;
    }
};

// IQ2_XXS: 66-byte blocks of 256: d f16 @0, then per group g (32 values) two u32 at 2+8g:
// w0 = four 8-bit grid indices, w1 = four 7-bit sign indices (bits 7k..) and a 4-bit scale
// (bits 28..31). Unit t = 4g + k = 8 values starting at element 8t.
struct Ds4Iq2Xxs {
    static constexpr int BE = 256, BB = 66, CB = 32, UPB = 32;
    __device__ static Ds4Tables prologue() {
        __shared__ ds4_u64 grid[256];
        __shared__ ds4_u8 signs[128];
        for (int i = threadIdx.x; i < 256; i += DS4_GEMV_THREADS) grid[i] = ds4_iq2xxs_grid[i];
        for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS) signs[i] = ds4_iq2xxs_ksigns[i];
        __syncthreads();
        return Ds4Tables{grid, signs};
    }
    __device__ static float unit(const ds4_u8* s, int u, const float* xc, Ds4Tables tb) {
        const int b = u >> 5, t = u & 31, g = t >> 2, k = t & 3;
        const ds4_u8* blk = s + b * BB;
        const float d = ds4_h2f(ds4_ld_u16(blk));
        const ds4_u8* gp = blk + 2 + 8 * g;
        const ds4_u32 idx = gp[k];
        const ds4_u32 w1 = (ds4_u32)ds4_ld_u16(gp + 4) | ((ds4_u32)ds4_ld_u16(gp + 6) << 16);
        const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
        const ds4_u64 grid = tb.grid[idx];
        const ds4_u32 sg = tb.signs[(w1 >> (7 * k)) & 127];
        const float* xs = xc + b * BE + 8 * t;
        const float4 xa = ds4_ld_x4(xs);
        const float4 xb = ds4_ld_x4(xs + 4);
        const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float gv = (float)((ds4_u32)(grid >> (8 * e)) & 0xff) * xv[e];
            sum += ((sg >> e) & 1) ? -gv : gv;
        }
        return db * sum;
    }
};

// ---------------------------------------------------------------------------------------
// Row engine for block formats.
// ---------------------------------------------------------------------------------------

template <class T, int V>
__device__ __forceinline__ void ds4_load_chunk(const ds4_u8* __restrict__ row, int c,
                                               int nblocks, int lane, uint4 (&r)[V]) {
    const int b0 = c * T::CB;
    const int nb = min(T::CB, nblocks - b0);
    const int nvec = nb * T::BB / 16;
    const uint4* src = (const uint4*)(row + (ds4_size)b0 * T::BB);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int i = lane + DS4_WARP * v;
        if (i < nvec) r[v] = ds4_ldg(src + i);
    }
}

// This lane's share of row·x over the chunks owned by warp `part` of `wpr`.
template <class T>
__device__ __forceinline__ float ds4_row_partial(const ds4_u8* __restrict__ row,
                                                 const float* __restrict__ x, int n_in,
                                                 int part, int wpr, uint4* stage,
                                                 Ds4Tables tb) {
    constexpr int VEC = T::CB * T::BB / 16;
    constexpr int V = (VEC + DS4_WARP - 1) / DS4_WARP;
    constexpr int UPL = T::CB * T::UPB / DS4_WARP;  // units per lane in a full chunk
    static_assert((T::CB * T::BB) % 16 == 0, "chunk must be whole 16-byte vectors");
    static_assert((T::CB * T::UPB) % DS4_WARP == 0, "full chunk must split evenly");
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int nblocks = n_in / T::BE;
    const int nchunks = (nblocks + T::CB - 1) / T::CB;
    const ds4_u8* sbytes = (const ds4_u8*)stage;
    float acc = 0.f;
    uint4 r[V];
    int c = part;
    if (c < nchunks) ds4_load_chunk<T, V>(row, c, nblocks, lane, r);
    for (; c < nchunks; c += wpr) {
        const int b0 = c * T::CB;
        const int nb = min(T::CB, nblocks - b0);
        const int nvec = nb * T::BB / 16;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int i = lane + DS4_WARP * v;
            if (i < nvec) stage[i] = r[v];
        }
        ds4_syncwarp();
        if (c + wpr < nchunks) ds4_load_chunk<T, V>(row, c + wpr, nblocks, lane, r);
        const float* xc = x + (ds4_size)b0 * T::BE;
        if (nb == T::CB) {
            DS4_UNROLL(DS4_GEMV_UNROLL)
            for (int k = 0; k < UPL; ++k) acc += T::unit(sbytes, lane + DS4_WARP * k, xc, tb);
        } else {
            const int nu = nb * T::UPB;
            for (int u = lane; u < nu; u += DS4_WARP) acc += T::unit(sbytes, u, xc, tb);
        }
        ds4_syncwarp();
    }
    return acc;
}

// Reduce the lanes' partial sums and write y[row]: NaN when !ok (bad expert id).
__device__ __forceinline__ void ds4_finish_row(float acc, float* __restrict__ y, int row,
                                               int n_out, int wpr, bool ok) {
    __shared__ float part_sums[DS4_GEMV_WARPS];
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    acc = ds4_warp_sum(acc);
    if (wpr == 1) {
        if (lane == 0 && row < n_out) y[row] = ok ? acc : __int_as_float(0x7fc00000);
        return;
    }
    if (lane == 0) part_sums[warp] = acc;
    __syncthreads();
    if (part == 0 && lane == 0 && row < n_out) {
        float total = 0.f;
        for (int p = 0; p < wpr; ++p) total += part_sums[warp + p];
        y[row] = ok ? total : __int_as_float(0x7fc00000);
    }
}

template <class T>
__device__ __forceinline__ void ds4_gemv_quant(const ds4_u8* __restrict__ W,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int n_in, int n_out,
                                               int wpr, bool ok) {
    constexpr int VEC = T::CB * T::BB / 16;
    __shared__ uint4 stage[DS4_GEMV_WARPS][VEC];
    const Ds4Tables tb = T::prologue();
    const int warp = threadIdx.x / DS4_WARP;
    const int row = blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr;
    const ds4_size row_bytes = (ds4_size)(n_in / T::BE) * T::BB;
    float acc = 0.f;
    if (ok && row < n_out) {
        acc = ds4_row_partial<T>(W + (ds4_size)row * row_bytes, x, n_in, warp % wpr, wpr,
                                 stage[warp], tb);
    }
    ds4_finish_row(acc, y, row, n_out, wpr, ok);
}

// ---------------------------------------------------------------------------------------
// Plain formats (F32, F16): a 16-byte vector is 4 or 8 whole elements.
// ---------------------------------------------------------------------------------------

struct Ds4F32 {
    static constexpr int EPV = 4;
    __device__ static float vdot(uint4 a, const float* x) {
        const float4 xv = ds4_ld_x4(x);
        return __uint_as_float(a.x) * xv.x + __uint_as_float(a.y) * xv.y +
               __uint_as_float(a.z) * xv.z + __uint_as_float(a.w) * xv.w;
    }
};

struct Ds4F16 {
    static constexpr int EPV = 8;
    __device__ static float vdot(uint4 a, const float* x) {
        const float4 xa = ds4_ld_x4(x);
        const float4 xb = ds4_ld_x4(x + 4);
        float s = ds4_h2f((ds4_u16)(a.x & 0xffff)) * xa.x;
        s += ds4_h2f((ds4_u16)(a.x >> 16)) * xa.y;
        s += ds4_h2f((ds4_u16)(a.y & 0xffff)) * xa.z;
        s += ds4_h2f((ds4_u16)(a.y >> 16)) * xa.w;
        s += ds4_h2f((ds4_u16)(a.z & 0xffff)) * xb.x;
        s += ds4_h2f((ds4_u16)(a.z >> 16)) * xb.y;
        s += ds4_h2f((ds4_u16)(a.w & 0xffff)) * xb.z;
        s += ds4_h2f((ds4_u16)(a.w >> 16)) * xb.w;
        return s;
    }
};

template <class T>
__device__ __forceinline__ void ds4_gemv_plain(const ds4_u8* __restrict__ W,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int n_in, int n_out,
                                               int wpr, bool ok) {
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row = blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr;
    const int nvec = n_in / T::EPV;
    float acc0 = 0.f, acc1 = 0.f;
    if (ok && row < n_out) {
        const uint4* w = (const uint4*)(W + (ds4_size)row * (ds4_size)nvec * 16);
        const int stride = DS4_WARP * wpr;
        int i = (warp % wpr) * DS4_WARP + lane;
        for (; i + 3 * stride < nvec; i += 4 * stride) {
            const uint4 a = ds4_ldg(w + i);
            const uint4 b = ds4_ldg(w + i + stride);
            const uint4 c = ds4_ldg(w + i + 2 * stride);
            const uint4 d = ds4_ldg(w + i + 3 * stride);
            acc0 += T::vdot(a, x + (ds4_size)i * T::EPV);
            acc1 += T::vdot(b, x + (ds4_size)(i + stride) * T::EPV);
            acc0 += T::vdot(c, x + (ds4_size)(i + 2 * stride) * T::EPV);
            acc1 += T::vdot(d, x + (ds4_size)(i + 3 * stride) * T::EPV);
        }
        for (; i < nvec; i += stride) acc0 += T::vdot(ds4_ldg(w + i), x + (ds4_size)i * T::EPV);
    }
    ds4_finish_row(acc0 + acc1, y, row, n_out, wpr, ok);
}

// ---------------------------------------------------------------------------------------
// Entry points. Grid: x = ceil(n_out / (8 / wpr)) blocks of 256 threads.
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

#define DS4_GEMV_ENTRY(NAME, ENGINE, FMT)                                                   \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_GEMV_MIN_BLOCKS)                     \
        ds4_gemv_##NAME(const ds4_u8* __restrict__ W, const float* __restrict__ x,          \
                        float* __restrict__ y, int n_in, int n_out, int wpr) {              \
        ENGINE<FMT>(W, x, y, n_in, n_out, wpr, true);                                       \
    }                                                                                       \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_GEMV_MIN_BLOCKS)                     \
        ds4_gemv_grouped_##NAME(const ds4_u8* __restrict__ W0, const ds4_u8* __restrict__ W1, \
                                ds4_size expert_bytes, const ds4_i32* __restrict__ ids,     \
                                int n_experts, const float* __restrict__ x,                 \
                                ds4_size x_stride, float* __restrict__ y0,                  \
                                float* __restrict__ y1, int n_in, int n_out, int wpr) {     \
        const int sel = blockIdx.y;                                                         \
        const int id = ids[sel];                                                            \
        const bool ok = id >= 0 && id < n_experts;                                          \
        const ds4_u8* base = blockIdx.z ? W1 : W0;                                          \
        const ds4_u8* W = base + (ok ? (ds4_size)id * expert_bytes : 0);                    \
        float* y = (blockIdx.z ? y1 : y0) + (ds4_size)sel * n_out;                          \
        ENGINE<FMT>(W, x + (ds4_size)sel * x_stride, y, n_in, n_out, wpr, ok);              \
    }

DS4_GEMV_ENTRY(f32, ds4_gemv_plain, Ds4F32)
DS4_GEMV_ENTRY(f16, ds4_gemv_plain, Ds4F16)
DS4_GEMV_ENTRY(q8_0, ds4_gemv_quant, Ds4Q8_0)
DS4_GEMV_ENTRY(q2_k, ds4_gemv_quant, Ds4Q2K)
DS4_GEMV_ENTRY(q4_k, ds4_gemv_quant, Ds4Q4K)
DS4_GEMV_ENTRY(iq2_xxs, ds4_gemv_quant, Ds4Iq2Xxs)
