// norm_rope.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// Elementwise ops, RMSNorm, RoPE, the QAT simulations and the fused norm + RoPE (+ QAT)
// kernels.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

// ---------------------------------------------------------------------------------------
// Elementwise ops.
// ---------------------------------------------------------------------------------------
// DS4_GRID_STRIDE: ds4_ops.h.

extern "C" __global__ void ds4_fill(float* p, ds4_size n, float v) {
    ds4_grid_wait();
    DS4_GRID_STRIDE(i, n) p[i] = v;
}

extern "C" __global__ void ds4_copy(float* dst, const float* src, ds4_size n) {
    ds4_grid_wait();
    DS4_GRID_STRIDE(i, n) dst[i] = src[i];
}

extern "C" __global__ void ds4_add(float* acc, const float* x, ds4_size n) {
    ds4_grid_wait();
    DS4_GRID_STRIDE(i, n) acc[i] += x[i];
}


extern "C" __global__ void ds4_swiglu(const float* g, const float* u, float c, float* out,
                                      ds4_size n) {
    ds4_grid_wait();
    DS4_GRID_STRIDE(i, n) out[i] = ds4_swiglu1(g[i], u[i], c);
}

// Block reductions and ds4_rms_norm_row (the mHC kernels use it too): ds4_ops.h.

// One block per row (256 threads; 1024 when there are few rows, as at decode: more loads in
// flight on the one multiprocessor that does the work). out may be x (in place).
extern "C" __global__ void __launch_bounds__(1024)
ds4_rms_norm(const float* x, const float* w, float* out, int width, float eps) {
    ds4_grid_wait();
    __shared__ double sh[1024];
    const ds4_size base = (ds4_size)blockIdx.x * width;
    ds4_rms_norm_row(x + base, w, out + base, width, eps, sh);
}

// Position of row r: row_pos[r] when given (a batched decode step: one row per sequence,
// each at its own position), else pos0 + r * pos_step.
__device__ __forceinline__ ds4_size ds4_row_pos(const int* row_pos, ds4_size r, ds4_size pos0,
                                                ds4_size pos_step) {
    return row_pos ? (ds4_size)row_pos[r] : pos0 + r * pos_step;
}

// The rotation of one RoPE pair t[0], t[1] by position p and frequency `freq` (inverse:
// the opposite angle): ds4_rope's expressions, shared with ds4_rope_qat_hfp4.
__device__ __forceinline__ void ds4_rope_pair(float* t, ds4_size p, float freq, int inverse) {
    const double ang = (double)((float)p * freq);
    const float c = (float)cos(ang);
    float s = (float)sin(ang);
    if (inverse) s = -s;
    const float u = t[0], v = t[1];
    // Rounded products, never contracted into FMAs: NVRTC contracts each kernel on its own,
    // and this rotation is inlined into several (ds4_rope, the head preparation, the fused
    // out_a input stage of ds4_gemv.h), which must agree bit for bit (docs/gpu.md §10). The
    // CPU's rotation rounds the same way.
    t[0] = __fsub_rn(__fmul_rn(u, c), __fmul_rn(v, s));
    t[1] = __fadd_rn(__fmul_rn(u, s), __fmul_rn(v, c));
}

// RoPE: one thread per (row, head, pair). freqs[j], j < rope_dim/2.
extern "C" __global__ void ds4_rope(float* x, const float* freqs, int n_rows, int n_heads,
                                    int head_dim, int rope_dim, ds4_size pos0, ds4_size pos_step,
                                    const int* row_pos, int inverse) {
    ds4_grid_wait();
    const int half = rope_dim / 2;
    const ds4_size n = (ds4_size)n_rows * n_heads * half;
    DS4_GRID_STRIDE(e, n) {
        const int j = (int)(e % half);
        const ds4_size rh = e / half;
        const ds4_size r = rh / n_heads;
        const ds4_size p = ds4_row_pos(row_pos, r, pos0, pos_step);
        ds4_rope_pair(x + rh * head_dim + (head_dim - rope_dim) + 2 * j, p, freqs[j], inverse);
    }
}

// ---------------------------------------------------------------------------------------
// QAT simulations (numerics.rs).
// ---------------------------------------------------------------------------------------
__device__ float ds4_pow2_ceil(float t) {
    const ds4_u32 bits = __float_as_uint(t);
    const int exp = (int)((bits >> 23) & 0xff);
    const ds4_u32 mant = bits & 0x7fffff;
    if (exp == 0) return (float)exp2(ceil(log2((double)t)));
    const int e = exp - 127 + (mant != 0 ? 1 : 0);
    if (e >= -126 && e <= 127) return __uint_as_float(((ds4_u32)(e + 127)) << 23);
    return (float)exp2((double)e);
}

__device__ float ds4_e4m3_round(float x) {
    const float a = fabsf(x);
    if (a == 0.0f) return x;
    float q;
    if (a < 0.015625f) {  // 2^-6
        q = 0.001953125f;  // 2^-9
    } else {
        const int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
        q = __uint_as_float(((ds4_u32)(e - 3 + 127)) << 23);
    }
    const float r = rintf(a / q) * q;
    return copysignf(fminf(r, 448.0f), x);
}

__device__ float ds4_e2m1_round(float x) {
    const float vals[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float a = fabsf(x);
    int best = 0;
    float best_d = __int_as_float(0x7f800000);
    for (int code = 0; code < 8; code++) {
        const float d = fabsf(a - vals[code]);
        if (d < best_d || (d == best_d && code % 2 == 0)) {
            best = code;
            best_d = d;
        }
    }
    return copysignf(vals[best], x);
}

// FP8 (E4M3) round trip of one 64-value block v[0..len) by one warp, two values per lane:
// the block's amax by a shuffle tree (a maximum: the same in any order), a power-of-two
// scale, each value rounded. Every lane of the warp calls it.
__device__ __forceinline__ void ds4_fp8_block_warp(float* v, int len, int lane) {
    const int i0 = lane, i1 = lane + DS4_WARP;
    const float a0 = i0 < len ? v[i0] : 0.0f;
    const float a1 = i1 < len ? v[i1] : 0.0f;
    float amax = fmaxf(fabsf(a0), fabsf(a1));
#pragma unroll
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) amax = fmaxf(amax, ds4_shfl_xor(amax, m));
    amax = fmaxf(amax, 1e-4f);
    const float s = ds4_pow2_ceil(amax * (1.0f / 448.0f));
    if (i0 < len) v[i0] = s * ds4_e4m3_round(fminf(fmaxf(a0 / s, -448.0f), 448.0f));
    if (i1 < len) v[i1] = s * ds4_e4m3_round(fminf(fmaxf(a1 / s, -448.0f), 448.0f));
}

// RoPE of the pairs j = j0, j0 + step, ... (< rope_dim / 2) of the last rope_dim values of
// the row xr (width values) at position p: ds4_rope_pair's expressions, the angle in double,
// the products rounded (no contraction, so every kernel that inlines it agrees).
__device__ __forceinline__ void ds4_rope_row_pairs(float* xr, int width, const float* freqs,
                                                   int rope_dim, ds4_size p, int j0, int step) {
    for (int j = j0; j < rope_dim / 2; j += step) {
        const double ang = (double)((float)p * freqs[j]);
        const float c = (float)cos(ang);
        const float sn = (float)sin(ang);
        float* tp = xr + (width - rope_dim) + 2 * j;
        const float u = tp[0], v = tp[1];
        tp[0] = __fsub_rn(__fmul_rn(u, c), __fmul_rn(v, sn));
        tp[1] = __fadd_rn(__fmul_rn(u, sn), __fmul_rn(v, c));
    }
}

// One logical warp per 64-value block of the first n_dims of each row, two values per
// lane. The block's amax is a maximum (exact in any order; fmaxf skips NaN as the serial
// loop did), so results equal the one-thread-per-block form; loads are coalesced. The
// launch has blockDim a multiple of 32, so every lane of a warp takes the same block.
extern "C" __global__ void ds4_qat_fp8(float* x, int rows, int width, int n_dims) {
    ds4_grid_wait();
    const int per_row = (n_dims + 63) / 64;
    const ds4_size n = (ds4_size)rows * per_row;
    const int lane = threadIdx.x % DS4_WARP;
    const ds4_size warps = ((ds4_size)gridDim.x * blockDim.x) / DS4_WARP;
    for (ds4_size e = ((ds4_size)blockIdx.x * blockDim.x + threadIdx.x) / DS4_WARP; e < n;
         e += warps) {
        const ds4_size r = e / per_row;
        const int b0 = (int)(e % per_row) * 64;
        ds4_fp8_block_warp(x + r * width + b0, min(64, n_dims - b0), lane);
    }
}

// Head preparation of one row by one block (256 threads): ds4_rms_norm's arithmetic (times
// w if given), then ds4_rope's rotation of the last rope_dim dims at position p, then
// (fp8_dims > 0) ds4_qat_fp8's round trip of the first fp8_dims dims. Each stage reads what
// the previous one wrote (block barriers between them), so the result equals the three
// kernels run in turn.
__device__ __forceinline__ void ds4_norm_rope_row(float* xr, const float* w, int width, float eps,
                                                  const float* freqs, int rope_dim, ds4_size p,
                                                  int fp8_dims, double* sh) {
    ds4_rms_norm_row(xr, w, xr, width, eps, sh);
    __syncthreads();
    ds4_rope_row_pairs(xr, width, freqs, rope_dim, p, threadIdx.x, blockDim.x);
    if (fp8_dims <= 0) return;
    __syncthreads();
    const int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP;
    const int n_blk = (fp8_dims + 63) / 64;
    for (int b = warp; b < n_blk; b += blockDim.x / DS4_WARP)
        ds4_fp8_block_warp(xr + b * 64, min(64, fp8_dims - b * 64), lane);
}

// Head preparation in one pass, one block (256 threads) per row (row r = token r/n_heads,
// at position pos0 + (r / n_heads)·pos_step, or row_pos[r / n_heads]): ds4_norm_rope_row.
extern "C" __global__ void __launch_bounds__(256)
ds4_norm_rope(float* x, const float* w, int width, float eps, const float* freqs, int n_heads,
              int rope_dim, ds4_size pos0, ds4_size pos_step, const int* row_pos, int fp8_dims) {
    ds4_grid_wait();
    __shared__ double sh[256];
    const ds4_size row = blockIdx.x;
    const ds4_size p = ds4_row_pos(row_pos, row / n_heads, pos0, pos_step);
    ds4_norm_rope_row(x + row * width, w, width, eps, freqs, rope_dim, p, fp8_dims, sh);
}

// Two ds4_norm_rope calls of one width, eps and rotation (the query heads and the KV row of
// an attention layer) in one launch: blocks [0, rows_a) take x_a's rows (n_heads_a heads per
// token), the rest x_b's.
extern "C" __global__ void __launch_bounds__(256)
ds4_norm_rope2(float* xa, const float* wa, int heads_a, int fp8_a, int rows_a, float* xb,
               const float* wb, int heads_b, int fp8_b, int width, float eps, const float* freqs,
               int rope_dim, ds4_size pos0, ds4_size pos_step, const int* row_pos, float* ring_b,
               ds4_size slot) {
    ds4_grid_wait();
    __shared__ double sh[256];
    const bool first = (int)blockIdx.x < rows_a;
    const ds4_size row = first ? blockIdx.x : blockIdx.x - rows_a;
    const ds4_size p = ds4_row_pos(row_pos, row / (first ? heads_a : heads_b), pos0, pos_step);
    float* const x = (first ? xa : xb) + row * width;
    ds4_norm_rope_row(x, first ? wa : wb, width, eps, freqs, rope_dim, p, first ? fp8_a : fp8_b,
                      sh);
    // A one-token step's KV row (b's only row) also goes to its window ring slot: what
    // ds4_ring_store would copy after the attention, which never reads this slot.
    if (!first && ring_b) {
        __syncthreads();
        for (int i = threadIdx.x; i < width; i += blockDim.x) ring_b[slot * width + i] = x[i];
    }
}

// ds4_rms_scale as a block of 256 threads computes it, by one warp over a row in shared
// memory: lane l takes the partial sums of the virtual threads l, l + 32, ..., l + 224 in the
// block's loop order, each virtual warp's shuffle tree runs on the real lanes of the same
// numbers, and the eight warp sums are combined as ds4_block_sum_d's second stage combines
// them (lanes past the warp count add 0.0). Same pairs in the same order: the same scale bit
// for bit, with no block barrier.
__device__ __forceinline__ float ds4_rms_scale_warp_as256(const float* v, int n, float eps) {
    constexpr int B = 256, J = B / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    double r = 0.0;
#pragma unroll 1
    for (int j = 0; j < J; j++) {
        double p[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        int i = lane + DS4_WARP * j;
        for (; i + 7 * B < n; i += 8 * B) {
            float x[8];
#pragma unroll
            for (int u = 0; u < 8; u++) x[u] = v[i + u * B];
#pragma unroll
            for (int u = 0; u < 8; u++) p[u] += (double)x[u] * (double)x[u];
        }
        for (; i < n; i += B) p[0] += (double)v[i] * (double)v[i];
        double ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
#pragma unroll
        for (int m = DS4_WARP / 2; m > 0; m >>= 1) ss += ds4_shfl_xor_d(ss, m);
        if (lane == j) r = ss;
    }
#pragma unroll
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) r += ds4_shfl_xor_d(r, m);
    return (float)(1.0 / sqrt(r / (double)n + (double)eps));
}

// Widest row ds4_norm_rope2_warps takes (its shared memory: one row per warp).
#define DS4_NRW_MAX 1024
extern "C" __device__ const int ds4_norm_rope_warps_max[2] = {DS4_NRW_MAX, 0};

// ds4_norm_rope2 with one warp per row instead of a block (prefill: 2048 tokens give
// 133,120 rows of 512). A block per row kept one row's work on 256 threads with four block
// barriers and the rotation's double-precision sin/cos on one warp while seven waited: the
// prefill launch took several times its memory time (BENCHMARKS.md, "Figures moved out of
// code comments"). Here each warp copies its row into shared memory, normalizes it with the block
// kernel's scale (ds4_rms_scale_warp_as256: the same bits), rotates, rounds through FP8 and
// writes it back, synchronizing only itself: the same expressions in the same order as
// ds4_norm_rope_row, so the same values bit for bit (docs/gpu.md §21). Rows r < rows_a are
// x_a's, the rest up to rows x_b's; blocks of 256 threads take 8 rows; width <= DS4_NRW_MAX.
extern "C" __global__ void __launch_bounds__(256)
ds4_norm_rope2_warps(float* xa, const float* wa, int heads_a, int fp8_a, int rows_a, float* xb,
                     const float* wb, int heads_b, int fp8_b, int width, float eps,
                     const float* freqs, int rope_dim, ds4_size pos0, ds4_size pos_step,
                     const int* row_pos, float* ring_b, ds4_size slot, int rows) {
    ds4_grid_wait();
    __shared__ __align__(16) float rows_sh[256 / DS4_WARP][DS4_NRW_MAX];
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    const int r = (int)blockIdx.x * (256 / DS4_WARP) + warp;
    if (r >= rows || width > DS4_NRW_MAX) return;  // no block barrier below
    const bool first = r < rows_a;
    const ds4_size row = first ? (ds4_size)r : (ds4_size)(r - rows_a);
    const ds4_size p = ds4_row_pos(row_pos, row / (first ? heads_a : heads_b), pos0, pos_step);
    float* const x = (first ? xa : xb) + row * width;
    const float* const w = first ? wa : wb;
    const int fp8_dims = first ? fp8_a : fp8_b;
    float* const v = rows_sh[warp];
    for (int i = lane; i < width; i += DS4_WARP) v[i] = x[i];
    ds4_syncwarp();
    // ds4_rms_norm_row: (x · s) · w.
    const float s = ds4_rms_scale_warp_as256(v, width, eps);
    for (int i = lane; i < width; i += DS4_WARP) {
        const float a = v[i] * s;
        v[i] = w ? a * w[i] : a;
    }
    ds4_syncwarp();
    ds4_rope_row_pairs(v, width, freqs, rope_dim, p, lane, DS4_WARP);
    ds4_syncwarp();
    const int n_blk = fp8_dims > 0 ? (fp8_dims + 63) / 64 : 0;
    for (int b = 0; b < n_blk; b++) ds4_fp8_block_warp(v + b * 64, min(64, fp8_dims - b * 64), lane);
    ds4_syncwarp();
    for (int i = lane; i < width; i += DS4_WARP) x[i] = v[i];
    if (!first && ring_b)
        for (int i = lane; i < width; i += DS4_WARP) ring_b[slot * width + i] = v[i];
}

// The Hadamard FP4 simulation of one row already in shared memory (v, width <= 4096): the
// normalised Walsh-Hadamard transform in place, then FP4 in blocks of 32, written to row.
__device__ __forceinline__ void ds4_hfp4_shared(float* row, float* v, int width, float norm) {
    for (int h = 1; h < width; h *= 2) {
        for (int p = threadIdx.x; p < width / 2; p += blockDim.x) {
            const int i = (p / h) * 2 * h + (p % h);
            const float a = v[i], b = v[i + h];
            v[i] = a + b;
            v[i + h] = a - b;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < width; i += blockDim.x) v[i] *= norm;
    __syncthreads();
    // One warp per 32-value block, a lane per value: the block's amax by a shuffle tree
    // (max is order-free: the same value as the CPU's loop), then each lane rounds its own
    // value. (One thread per block walked 32 values with a division each, serially.)
    const int lane = threadIdx.x & (DS4_WARP - 1);
    for (int b = threadIdx.x / DS4_WARP; b < width / 32; b += blockDim.x / DS4_WARP) {
        const float q = v[32 * b + lane];
        float amax = fabsf(q);
#pragma unroll
        for (int m = DS4_WARP / 2; m > 0; m >>= 1) amax = fmaxf(amax, ds4_shfl_xor(amax, m));
        amax = fmaxf(amax, 6.0f * 1.17549435e-38f);
        const float s = ds4_pow2_ceil(amax * (1.0f / 6.0f));
        row[32 * b + lane] = s * ds4_e2m1_round(fminf(fmaxf(q / s, -6.0f), 6.0f));
    }
}

// One block (256 threads) per row of `width` (a power of two, <= 4096): normalised
// Walsh-Hadamard transform in shared memory, then FP4 in blocks of 32.
extern "C" __global__ void __launch_bounds__(256)
ds4_qat_hfp4(float* x, int width, float norm) {
    ds4_grid_wait();
    __shared__ float v[4096];
    float* row = x + (ds4_size)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    ds4_hfp4_shared(row, v, width, norm);
}

// ds4_rope of a row's last rope_dim dims, then ds4_qat_hfp4 of the row, in one block per row
// (row r·n_heads + h at position ds4_row_pos(r)): the indexer's query heads (docs/gpu.md §17).
extern "C" __global__ void __launch_bounds__(256)
ds4_rope_qat_hfp4(float* x, int width, float norm, const float* freqs, int n_heads,
                  int rope_dim, ds4_size pos0, ds4_size pos_step, const int* row_pos) {
    ds4_grid_wait();
    __shared__ float v[4096];
    float* row = x + (ds4_size)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    const ds4_size p = ds4_row_pos(row_pos, blockIdx.x / n_heads, pos0, pos_step);
    for (int j = threadIdx.x; j < rope_dim / 2; j += blockDim.x)
        ds4_rope_pair(v + (width - rope_dim) + 2 * j, p, freqs[j], 0);
    __syncthreads();
    ds4_hfp4_shared(row, v, width, norm);
}
