// dequant.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// Weights in bulk: dequantization to f32 rows, the Q8_0 split layout and the dense f32
// GEMM of the prefill panel path (the element access, ds4_elem, is in ds4_ops.h).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

// Fault bits and ds4_fault: ds4_quant.h.
// DS4_NAN and the element access of every weight format (ds4_elem): ds4_ops.h.

// Q8_0 rows from ggml's interleaved blocks (per 32 values: f16 scale, 32 int8 codes) to the
// GPU's split layout (the row's n codes, then its n / 32 scales), in place: the same bytes
// per row, rearranged so the codes are 16-byte aligned for the GEMV (docs/gpu.md §7). One
// block per row at a time; a row must fit the block's shared memory (n <= DS4_Q8S_MAX_IN,
// checked by the host against its copy, Q8_SPLIT_MAX_IN in backend/mod.rs).
#define DS4_Q8S_MAX_IN 32768
extern "C" __global__ void __launch_bounds__(256)
ds4_q8_0_split(ds4_u8* w, ds4_size n_rows, int n) {
    ds4_grid_wait();
    __shared__ __align__(16) ds4_u8 buf[DS4_Q8S_MAX_IN / 32 * 34];
    const int nb = n / 32;
    const ds4_size row_bytes = (ds4_size)nb * 34;
    for (ds4_size r = blockIdx.x; r < n_rows; r += gridDim.x) {
        ds4_u8* row = w + r * row_bytes;
        for (int i = threadIdx.x; i < nb * 34; i += blockDim.x) buf[i] = row[i];
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = buf[(i / 32) * 34 + 2 + i % 32];
        for (int b = threadIdx.x; b < nb; b += blockDim.x) {
            row[n + 2 * b] = buf[b * 34];
            row[n + 2 * b + 1] = buf[b * 34 + 1];
        }
        __syncthreads();
    }
}

// out[r * cols + c] = W[row0 + r][c] as f32, rows of row_bytes bytes.
extern "C" __global__ void ds4_dequant_rows(const ds4_u8* w, int ty, ds4_size row_bytes,
                                            ds4_size row0, int n_rows, int cols, float* out) {
    ds4_grid_wait();
    const ds4_size n = (ds4_size)n_rows * cols;
    for (ds4_size e = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (ds4_size)gridDim.x * blockDim.x) {
        const ds4_size r = e / cols;
        const int c = (int)(e % cols);
        out[e] = ds4_elem(ty, w + (row0 + r) * row_bytes, c, row_bytes);
    }
}

// 16 codes of a split-layout Q8_0 row (codes, then one f16 scale per 32) from value c
// (a multiple of 16) as four words, and their block's scale.
__device__ __forceinline__ float ds4_q8s_load16(const ds4_u8* w, ds4_size row_bytes, ds4_size r,
                                                int cols, int c, ds4_u32 qw[4]) {
    const ds4_u8* row = w + r * row_bytes;
    const uint4 q = *(const uint4*)(row + c);
    qw[0] = q.x;
    qw[1] = q.y;
    qw[2] = q.z;
    qw[3] = q.w;
    return ds4_h2f(ds4_b16(row + cols + 2 * (c / 32)));
}

// ds4_dequant_rows for Q8_0 rows in the split layout, the prefill panels' common case: one thread
// per 16 codes (one 16-byte load and its block's scale) writing 16 floats (four 16-byte
// stores), the row from blockIdx.x and the column run from blockIdx.y, so no per-element
// 64-bit index arithmetic. Each value is the same product as ds4_elem's. The host checks
// that rows, codes and cols are 16-byte / 16-value aligned.
extern "C" __global__ void __launch_bounds__(256)
ds4_dequant_q8_rows(const ds4_u8* w, ds4_size row_bytes, ds4_size row0, int cols, float* out) {
    ds4_grid_wait();
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 16;
    if (c >= cols) return;
    ds4_u32 qw[4];
    const float d = ds4_q8s_load16(w, row_bytes, row0 + blockIdx.x, cols, c, qw);
    float* o = out + (ds4_size)blockIdx.x * cols + c;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const ds4_u32 v = qw[u];
        *(float4*)(o + 4 * u) = make_float4(d * (float)(ds4_i8)(v & 0xff),
                                            d * (float)(ds4_i8)((v >> 8) & 0xff),
                                            d * (float)(ds4_i8)((v >> 16) & 0xff),
                                            d * (float)(ds4_i8)(v >> 24));
    }
}

// ---------------------------------------------------------------------------------------
// Dense f32 GEMM for prefill: C[t][r] = sum_c X[t][c] * W[r][c] (both row-major, K = cols
// contiguous), one 64x64 tile of C per block, 4x4 outputs per thread, K in steps of 16.
// ---------------------------------------------------------------------------------------
#define DS4_GT 64
#define DS4_GK 16
extern "C" __global__ void __launch_bounds__(256)
ds4_gemm_nt(const float* x, ds4_size x_stride, const float* w, ds4_size w_stride, float* y,
            ds4_size y_stride, int n_tok, int n_rows, int k) {
    ds4_grid_wait();
    __shared__ float xs[DS4_GK][DS4_GT + 4];
    __shared__ float ws[DS4_GK][DS4_GT + 4];
    const int t0 = blockIdx.y * DS4_GT, r0 = blockIdx.x * DS4_GT;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) acc[a][b] = 0.0f;
    for (int kk = 0; kk < k; kk += DS4_GK) {
        // 64 rows x 16 k of each operand: 1024 values, 4 per thread.
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int e = tid + q * 256, row = e / DS4_GK, kc = e % DS4_GK;
            const int t = t0 + row, r = r0 + row, kx = kk + kc;
            xs[kc][row] = (t < n_tok && kx < k) ? x[(ds4_size)t * x_stride + kx] : 0.0f;
            ws[kc][row] = (r < n_rows && kx < k) ? w[(ds4_size)r * w_stride + kx] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kc = 0; kc < DS4_GK; kc++) {
            float xv[4], wv[4];
#pragma unroll
            for (int a = 0; a < 4; a++) xv[a] = xs[kc][ty + 16 * a];
#pragma unroll
            for (int b = 0; b < 4; b++) wv[b] = ws[kc][tx + 16 * b];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) acc[a][b] += xv[a] * wv[b];
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int t = t0 + ty + 16 * a;
        if (t >= n_tok) continue;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int r = r0 + tx + 16 * b;
            if (r < n_rows) y[(ds4_size)t * y_stride + r] = acc[a][b];
        }
    }
}

// Small-batch matmul straight from the quantized rows (shapes the GEMV kernels do not take):
// one warp per (row, group of up to 4 tokens).
extern "C" __global__ void ds4_matmul_generic(const ds4_u8* w, int ty, ds4_size row_bytes,
                                              ds4_size row0, int n_rows, int cols,
                                              const float* x, ds4_size x_stride, int n_tok,
                                              float* y, ds4_size y_stride) {
    ds4_grid_wait();
    const int warps = blockDim.x / DS4_WARP;
    const int r = blockIdx.x * warps + threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x % DS4_WARP;
    const int tg = blockIdx.y * 4;
    if (r >= n_rows) return;
    const ds4_u8* row = w + (row0 + r) * row_bytes;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = lane; c < cols; c += DS4_WARP) {
        const float v = ds4_elem(ty, row, c, row_bytes);
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (tg + q < n_tok) acc[q] += v * x[(ds4_size)(tg + q) * x_stride + c];
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const float s = ds4_warp_sum(acc[q]);
        if (lane == 0 && tg + q < n_tok) y[(ds4_size)(tg + q) * y_stride + r] = s;
    }
}
