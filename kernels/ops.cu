// ops.cu: every engine op besides the batch-1 GEMV (gemv.cu), for the CUDA and HIP backends.
//
// Each kernel mirrors one `Backend` op of crates/ds4-engine/src/backend.rs and the CPU
// reference in crates/ds4-cpu (the scalar math of crates/ds4-engine/src/numerics.rs), in the
// same operation order where that order decides rounding (RMS sums in double, RoPE angles as
// an f32 product with cos/sin in double, the Sinkhorn iteration, top-k tie rules). Host code
// (crates/ds4-gpu/src/backend) checks every shape and range before a launch; kernels still
// never read or write outside what they are given. Inputs that only the device can see to be
// bad (a token id outside the table, an expert id outside the tensor) set a bit in the fault
// word and produce NaN, and the host reports the fault at its next synchronisation.
//
// All kernels use 1-D blocks and static shared memory only.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"

// Fault bits and ds4_fault: ds4_quant.h.


#define DS4_NAN __int_as_float(0x7fc00000)


// ---------------------------------------------------------------------------------------
// Element access of every weight format (byte loads only: blocks are not aligned).
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ float ds4_bf2f(ds4_u16 h) { return __uint_as_float(((ds4_u32)h) << 16); }

// Value of element i of a row of type ty and row_bytes bytes (ggml block layouts; Q8_0 in
// the GPU's split layout: codes, then scales, see ds4_q8_0_split).
__device__ float ds4_elem(int ty, const ds4_u8* row, int i, ds4_size row_bytes) {
    switch (ty) {
    case DS4_T_F32:
        return __uint_as_float(ds4_b32(row + 4 * (ds4_size)i));
    case DS4_T_F16:
        return ds4_h2f(ds4_b16(row + 2 * (ds4_size)i));
    case DS4_T_BF16:
        return ds4_bf2f(ds4_b16(row + 2 * (ds4_size)i));
    case DS4_T_Q8_0: {
        const ds4_size n = row_bytes / 34 * 32;
        return ds4_h2f(ds4_b16(row + n + 2 * (ds4_size)(i / 32))) * (float)(ds4_i8)row[i];
    }
    case DS4_T_Q2_K: {
        // scales[16] @0, qs[64] @16, d @80, dmin @82.
        const ds4_u8* b = row + (ds4_size)(i / 256) * 84;
        const int j = i % 256, n = j / 128, jj = j % 128, g = jj / 32, l = jj % 32;
        const ds4_u8 sc = b[n * 8 + 2 * g + (l >= 16 ? 1 : 0)];
        const float d = ds4_h2f(ds4_b16(b + 80)), dmin = ds4_h2f(ds4_b16(b + 82));
        const int q = (b[16 + n * 32 + l] >> (2 * g)) & 3;
        return d * (float)(sc & 0xF) * (float)q - dmin * (float)(sc >> 4);
    }
    case DS4_T_Q4_K: {
        // d @0, dmin @2, scales[12] @4, qs[128] @16.
        const ds4_u8* b = row + (ds4_size)(i / 256) * 144;
        const int j = i % 256, c = j / 64, jj = j % 64;
        const int is = 2 * c + (jj >= 32 ? 1 : 0);
        int sc, m;
        ds4_q4k_scale_min(b + 4, is, &sc, &m);
        const ds4_u8 qb = b[16 + c * 32 + (jj % 32)];
        const int q = jj < 32 ? (qb & 0xF) : (qb >> 4);
        const float d = ds4_h2f(ds4_b16(b)), dmin = ds4_h2f(ds4_b16(b + 2));
        return d * (float)sc * (float)q - dmin * (float)m;
    }
    case DS4_T_IQ2_XXS: {
        // d @0, then per 32 values: 4 grid bytes + u32 (7-bit sign sets x4, 4-bit scale).
        const ds4_u8* b = row + (ds4_size)(i / 256) * 66;
        const int j = i % 256, ib = j / 32, l = (j % 32) / 8, k = j % 8;
        const ds4_u8* q = b + 2 + ib * 8;
        const ds4_u32 a1 = ds4_b32(q + 4);
        const float db = ds4_h2f(ds4_b16(b)) * (0.5f + (float)(a1 >> 28)) * 0.25f;
        const ds4_u8 signs = ds4_iq2xxs_ksigns[(a1 >> (7 * l)) & 127];
        const float g = (float)((ds4_iq2xxs_grid[q[l]] >> (8 * k)) & 0xff);
        return db * g * ((signs >> k) & 1 ? -1.0f : 1.0f);
    }
    default:
        return DS4_NAN;
    }
}

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

// The same rows as halves (the f16 GEMM's panel, half the bytes): each value d*q rounded
// once to f16, as the tile kernels' decoded weights are.
extern "C" __global__ void __launch_bounds__(256)
ds4_dequant_q8_rows_h(const ds4_u8* w, ds4_size row_bytes, ds4_size row0, int cols, ds4_u16* out) {
    ds4_grid_wait();
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 16;
    if (c >= cols) return;
    ds4_u32 qw[4];
    const float d = ds4_q8s_load16(w, row_bytes, row0 + blockIdx.x, cols, c, qw);
    ds4_u32 h[8];
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const ds4_u32 v = qw[u];
        h[2 * u] = ds4_f2h2(d * (float)(ds4_i8)(v & 0xff), d * (float)(ds4_i8)((v >> 8) & 0xff));
        h[2 * u + 1] = ds4_f2h2(d * (float)(ds4_i8)((v >> 16) & 0xff), d * (float)(ds4_i8)(v >> 24));
    }
    uint4* o = (uint4*)(out + (ds4_size)blockIdx.x * cols + c);
    o[0] = make_uint4(h[0], h[1], h[2], h[3]);
    o[1] = make_uint4(h[4], h[5], h[6], h[7]);
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

// ---------------------------------------------------------------------------------------
// Elementwise ops.
// ---------------------------------------------------------------------------------------
#define DS4_GRID_STRIDE(i, n) \
    for (ds4_size i = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (ds4_size)gridDim.x * blockDim.x)

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

// ---------------------------------------------------------------------------------------
// Block reductions (256 threads).
// ---------------------------------------------------------------------------------------
// ds4_shfl_xor_d, ds4_block_sum_d and ds4_rms_scale live in ds4_quant.h (the GEMVs that
// normalize their input use them too).

// RMSNorm of one row by the whole block (out may be x: in place).
__device__ void ds4_rms_norm_row(const float* x, const float* w, float* out, int width,
                                 float eps, double* sh) {
    const ds4_size base = 0;
    const float s = ds4_rms_scale(x, width, eps, sh);
    // Four elements per round, all loaded before any store (out may be x: each element is
    // read and written by the same thread only).
    const int bd = blockDim.x;
    int i = threadIdx.x;
    for (; i + 3 * bd < width; i += 4 * bd) {
        float v[4], g[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            v[u] = x[base + i + u * bd];
            g[u] = w ? w[i + u * bd] : 1.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float a = v[u] * s;
            out[base + i + u * bd] = w ? a * g[u] : a;
        }
    }
    for (; i < width; i += bd) {
        const float v = x[base + i] * s;
        out[base + i] = w ? v * w[i] : v;
    }
}

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
    // out_a input stage of gemv.cu), which must agree bit for bit (docs/gpu.md §10). The
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
// barriers and the rotation's double-precision sin/cos on one warp while seven waited: at
// 2048 tokens the launch took ≈ 0.51 ms (H100, 5 % of a layer's prefill), ≈ 3× its memory
// time. Here each warp copies its row into shared memory, normalizes it with the block
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

// ---------------------------------------------------------------------------------------
// Embedding, mHC.
// ---------------------------------------------------------------------------------------

// One block per token: out[t][s] = table[tokens[t]] for every stream s.
extern "C" __global__ void ds4_embed(const ds4_u8* table, int ty, ds4_size row_bytes, int n_vocab,
                                     const int* tokens, int n_streams, int d, float* out,
                                     int* fault) {
    ds4_grid_wait();
    const int t = blockIdx.x;
    const int tok = tokens[t];
    const bool ok = tok >= 0 && tok < n_vocab;
    if (!ok && threadIdx.x == 0) ds4_fault(fault, DS4_FAULT_TOKEN);
    float* o = out + (ds4_size)t * n_streams * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = ok ? ds4_elem(ty, table + (ds4_size)tok * row_bytes, i, row_bytes) : DS4_NAN;
        for (int s = 0; s < n_streams; s++) o[(ds4_size)s * d + i] = v;
    }
}

// Sinkhorn projection of the n x n matrix z (shared memory, n <= 8) by the whole block:
// thread k < n*n owns element (k / n, k % n). Every row/column sum is taken by each of its
// threads in index order, exactly as the CPU reference does, so the result matches it
// operation for operation; only the n*n divisions run in parallel. Every thread of the
// block must call this (it synchronises).
__device__ void ds4_sinkhorn_block(float* z, int n, int iters, float eps) {
    const int k = threadIdx.x;
    const bool own = k < n * n;
    const int i = own ? k / n : 0;
    const int j = own ? k % n : 0;
    float v = 0.0f;
    if (own) {
        const float* row = z + i * n;
        float m = -__int_as_float(0x7f800000);
        for (int q = 0; q < n; q++) m = fmaxf(m, row[q]);
        float s = 0.0f;
        for (int q = 0; q < n; q++) s += expf(row[q] - m);
        v = expf(row[j] - m) / s + eps;
    }
    __syncthreads();
    if (own) z[k] = v;
    __syncthreads();
    const int n_it = iters > 0 ? iters : 1;
    for (int it = 0; it < n_it; it++) {
        if (it > 0) {
            float s = 0.0f;
            if (own) {
                for (int q = 0; q < n; q++) s += z[i * n + q];
                s += eps;
            }
            __syncthreads();
            if (own) z[k] = z[k] / s;
            __syncthreads();
        }
        float s = 0.0f;
        if (own) {
            for (int q = 0; q < n; q++) s += z[q * n + j];
            s += eps;
        }
        __syncthreads();
        if (own) z[k] = z[k] / s;
        __syncthreads();
    }
}

#define DS4_HC_MAX 8

// The same projection by one whole warp (n*n <= 32) with the matrix in registers: lane k
// holds element (k / n, k % n), and every row and column sum is gathered with shuffles and
// added in index order, as the CPU reference does, so the results are the same bits as
// ds4_sinkhorn's; no shared-memory round trip or barrier per step (the decode-time hc_pre
// waited on this loop: ~57 % of its cycles were barrier stalls, ncu on the H200).
// Sum over q < n of lane (first + q * step)'s v, added in q order (every lane of the warp
// must call it: the shuffles take all 32).
__device__ __forceinline__ float ds4_lanes_sum(float v, int first, int step, int n) {
    float t[DS4_HC_MAX];
#pragma unroll
    for (int q = 0; q < DS4_HC_MAX; q++) t[q] = ds4_shfl_idx(v, first + q * step);
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < DS4_HC_MAX; q++)
        if (q < n) s += t[q];
    return s;
}

// ds4_sinkhorn_warp for the model's 4 x 4 matrix: the same operations in the same order,
// straight-line (no per-width predicates or divergent divisions on the dependent chain).
// Lanes 16..31 mirror lanes 0..15 and their results are dropped. The general version's
// predicated 8-wide sums and branches made the Sinkhorn ~8 µs per call at decode, most of
// the fused HCPre's coefficient block (ncu on the H200).
__device__ void ds4_sinkhorn_warp4(float* z, int iters, float eps) {
    const int k = threadIdx.x & (DS4_WARP - 1);
    const int e = k & 15, i = e >> 2, j = e & 3;
    float v = z[e];
    const float r0 = ds4_shfl_idx(v, i * 4), r1 = ds4_shfl_idx(v, i * 4 + 1);
    const float r2 = ds4_shfl_idx(v, i * 4 + 2), r3 = ds4_shfl_idx(v, i * 4 + 3);
    const float m = fmaxf(fmaxf(fmaxf(r0, r1), r2), r3);
    float s = expf(r0 - m);
    s += expf(r1 - m);
    s += expf(r2 - m);
    s += expf(r3 - m);
    v = expf(v - m) / s + eps;
    const int n_it = iters > 0 ? iters : 1;
    for (int it = 0; it < n_it; it++) {
        if (it > 0) {
            const float a = ds4_shfl_idx(v, i * 4), b = ds4_shfl_idx(v, i * 4 + 1);
            const float c = ds4_shfl_idx(v, i * 4 + 2), d = ds4_shfl_idx(v, i * 4 + 3);
            v = v / (((a + b) + c) + d + eps);
        }
        const float a = ds4_shfl_idx(v, j), b = ds4_shfl_idx(v, j + 4);
        const float c = ds4_shfl_idx(v, j + 8), d = ds4_shfl_idx(v, j + 12);
        v = v / (((a + b) + c) + d + eps);
    }
    if (k < 16) z[k] = v;
    ds4_syncwarp();
}

__device__ void ds4_sinkhorn_warp(float* z, int n, int iters, float eps) {
    if (n == 4) {
        ds4_sinkhorn_warp4(z, iters, eps);
        return;
    }
    const int k = threadIdx.x & (DS4_WARP - 1);
    const bool own = k < n * n;
    const int i = own ? k / n : 0;
    const int j = own ? k % n : 0;
    float v = own ? z[k] : 0.0f;
    // Softmax of each row: max (order-free) and the sum in index order.
    float m = -__int_as_float(0x7f800000);
    float row[DS4_HC_MAX];
#pragma unroll
    for (int q = 0; q < DS4_HC_MAX; q++) {
        row[q] = ds4_shfl_idx(v, i * n + q);
        if (q < n) m = fmaxf(m, row[q]);
    }
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < DS4_HC_MAX; q++)
        if (q < n) s += expf(row[q] - m);
    v = own ? expf(v - m) / s + eps : 0.0f;
    const int n_it = iters > 0 ? iters : 1;
    for (int it = 0; it < n_it; it++) {
        if (it > 0) {
            const float rs = ds4_lanes_sum(v, i * n, 1, n) + eps;
            if (own) v = v / rs;
        }
        const float cs = ds4_lanes_sum(v, j, n, n) + eps;
        if (own) v = v / cs;
    }
    if (own) z[k] = v;
    ds4_syncwarp();
}

// y[i] = sum_s c[s] * x[s*d + i] (s in stream order, as the CPU reference) by the whole
// block; two outputs per round with all their loads issued first (latency, as above).
__device__ void ds4_mix_streams_by(const float* x, const float* c, int n, int d, float* y,
                                   int tid, int bd) {
    int i = tid;
    for (; i + bd < d; i += 2 * bd) {
        float a[DS4_HC_MAX], b[DS4_HC_MAX];
#pragma unroll
        for (int s = 0; s < DS4_HC_MAX; s++) {
            if (s < n) {
                a[s] = x[(ds4_size)s * d + i];
                b[s] = x[(ds4_size)s * d + i + bd];
            }
        }
        float ya = 0.0f, yb = 0.0f;
#pragma unroll
        for (int s = 0; s < DS4_HC_MAX; s++) {
            if (s < n) {
                ya += c[s] * a[s];
                yb += c[s] * b[s];
            }
        }
        y[i] = ya;
        y[i + bd] = yb;
    }
    for (; i < d; i += bd) {
        float acc = 0.0f;
        for (int s = 0; s < n; s++) acc += c[s] * x[(ds4_size)s * d + i];
        y[i] = acc;
    }
}

__device__ void ds4_mix_streams(const float* x, const float* c, int n, int d, float* y) {
    ds4_mix_streams_by(x, c, n, d, y, threadIdx.x, blockDim.x);
}

// HCPre, one block (256 threads, or 1024 for few tokens: decode) per token: coefficients from mix and the streams' RMS
// (the Sinkhorn projection spread over the block's first n*n threads), then
// y = sum_i pre_i X_i. Writes post [n] and comb [n*n].
extern "C" __global__ void __launch_bounds__(1024)
ds4_hc_pre(const float* mix, const float* x, const float* base, const float* scale, int n,
           int d, int iters, float hc_eps, float rms_eps, float* y, float* post, float* comb,
           const float* norm_w, float* normed) {
    ds4_grid_wait();
    __shared__ double sh[1024];
    __shared__ float pre[DS4_HC_MAX];
    __shared__ float z[DS4_HC_MAX * DS4_HC_MAX];
    const int t = blockIdx.x;
    const int nm = 2 * n + n * n;
    const float* xt = x + (ds4_size)t * n * d;
    const float rho = ds4_rms_scale(xt, n * d, rms_eps, sh);
    const float* m = mix + (ds4_size)t * nm;
    const int k = threadIdx.x;
    if (k < n) {
        pre[k] = ds4_sigmoid(scale[0] * (m[k] * rho) + base[k]) + hc_eps;
        post[(ds4_size)t * n + k] = 2.0f * ds4_sigmoid(scale[1] * (m[n + k] * rho) + base[n + k]);
    }
    if (k < n * n) z[k] = scale[2] * (m[2 * n + k] * rho) + base[2 * n + k];
    __syncthreads();
    if (n * n <= DS4_WARP && blockDim.x > DS4_WARP) {
        // Warp 0 projects comb while the other warps mix the streams (independent work).
        if (k < DS4_WARP) {
            ds4_sinkhorn_warp(z, n, iters, hc_eps);
            if (k < n * n) comb[(ds4_size)t * n * n + k] = z[k];
        } else {
            ds4_mix_streams_by(xt, pre, n, d, y + (ds4_size)t * d, k - DS4_WARP,
                               blockDim.x - DS4_WARP);
        }
    } else {
        ds4_sinkhorn_block(z, n, iters, hc_eps);
        if (k < n * n) comb[(ds4_size)t * n * n + k] = z[k];
        __syncthreads();
        ds4_mix_streams(xt, pre, n, d, y + (ds4_size)t * d);
    }
    if (normed) {
        // The sublayer's input norm on the block's own y (ds4_rms_norm's arithmetic).
        __syncthreads();
        ds4_rms_norm_row(y + (ds4_size)t * d, norm_w, normed + (ds4_size)t * d, d, rms_eps, sh);
    }
}

// Shared by the decode HCPre kernels (ds4_hc_pre_regs, ds4_hc_mix_apply), which hold the
// streams' Gram matrix G[s][u] = <X_s, X_u> as its upper triangle in row-major order
// (N(N+1)/2 doubles, N = 4).
// The streams' RMS factor rho = 1 / sqrt(trace(G) / (n d) + eps).
template <int N>
__device__ __forceinline__ float ds4_hc_gram_rho(const double* g, ds4_size nd, float rms_eps) {
    double trace = 0.0;
    int q = 0;
#pragma unroll
    for (int s = 0; s < N; s++)
#pragma unroll
        for (int u = s; u < N; u++, q++)
            if (u == s) trace += g[q];
    return (float)(1.0 / sqrt(trace / (double)nd + (double)rms_eps));
}

// The RMSNorm factor of y = sum_s pre_s X_s from G: |y|^2 = sum_s,u pre_s pre_u G[s][u]
// (off-diagonal entries twice), so the output's norm needs no second reduction.
template <int N>
__device__ __forceinline__ float ds4_hc_gram_norm(const float (&pre)[N], const double* g, int d,
                                                  float rms_eps) {
    double yy = 0.0;
    int q = 0;
#pragma unroll
    for (int s = 0; s < N; s++)
#pragma unroll
        for (int u = s; u < N; u++, q++)
            yy += (u == s ? 1.0 : 2.0) * (double)pre[s] * (double)pre[u] * g[q];
    return (float)(1.0 / sqrt(yy / (double)d + (double)rms_eps));
}

// One warp: post = 2 sigmoid(scale1 m_post rho + base) and comb = Sinkhorn(scale2 m_comb rho
// + base) of one token from its raw mix m; z is the warp's n*n shared scratch.
__device__ __forceinline__ void ds4_hc_post_comb_warp(const float* m, float rho, const float* base,
                                                      const float* scale, int n, int iters,
                                                      float hc_eps, float* z, float* post_t,
                                                      float* comb_t) {
    const int lane = threadIdx.x & (DS4_WARP - 1);
    if (lane < n) post_t[lane] = 2.0f * ds4_sigmoid(scale[1] * (m[n + lane] * rho) + base[n + lane]);
    if (lane < n * n) z[lane] = scale[2] * (m[2 * n + lane] * rho) + base[2 * n + lane];
    ds4_syncwarp();
    ds4_sinkhorn_warp(z, n, iters, hc_eps);
    if (lane < n * n) comb_t[lane] = z[lane];
}

// HCPre for the model's shape (n <= 4 streams, d <= 4096), one block per token with every
// value held in registers, for decode latency: the general kernel above takes a global
// round trip and a block reduction for the streams' RMS, a second trip for the mix and a
// third trip plus reduction for the output's RMSNorm (~12 µs per call on the H200, 2 calls
// per layer). Here DS4_HCR_CT threads each load their 4 x 8 values once; one block
// reduction yields the streams' Gram matrix G[s][u] = <X_s, X_u> (in double), whose trace is
// the streams' sum of squares and from which |y|^2 = sum pre_s pre_u G[s][u] follows
// without a second reduction; then y and its norm come from registers. An extra warp runs
// the Sinkhorn projection as soon as the RMS is known, beside the mix. The sums are in a
// different order from the CPU's (and the general kernel's), equal within rounding.
#define DS4_HCR_CT 512
#define DS4_HCR_J 8
#define DS4_HCR_N 4
#define DS4_HCR_G (DS4_HCR_N * (DS4_HCR_N + 1) / 2)
extern "C" __global__ void __launch_bounds__(DS4_HCR_CT + DS4_WARP)
ds4_hc_pre_regs(const float* mix, const float* x, const float* base, const float* scale, int n,
                int d, int iters, float hc_eps, float rms_eps, float* y, float* post, float* comb,
                const float* norm_w, float* normed) {
    __shared__ double gsh[(DS4_HCR_CT + DS4_WARP) / DS4_WARP][DS4_HCR_G];
    __shared__ double gsum[DS4_HCR_G];
    __shared__ float z[DS4_HC_MAX * DS4_HC_MAX];
    const int t = blockIdx.x, k = threadIdx.x;
    const int lane = k & (DS4_WARP - 1), warp = k / DS4_WARP;
    const bool comp = k < DS4_HCR_CT;
    // The norm's weights before the wait (weights only, docs/gpu.md §6).
    float g[DS4_HCR_J];
#pragma unroll
    for (int j = 0; j < DS4_HCR_J; j++) {
        const int i = k + j * DS4_HCR_CT;
        g[j] = (comp && norm_w && i < d) ? norm_w[i] : 0.0f;
    }
    ds4_grid_wait();
    const float* xt = x + (ds4_size)t * n * d;
    float v[DS4_HCR_N][DS4_HCR_J];
#pragma unroll
    for (int s = 0; s < DS4_HCR_N; s++)
#pragma unroll
        for (int j = 0; j < DS4_HCR_J; j++) {
            const int i = k + j * DS4_HCR_CT;
            v[s][j] = (comp && s < n && i < d) ? ds4_ld_act(xt + (ds4_size)s * d + i) : 0.0f;
        }
    // This thread's share of the Gram matrix (upper triangle, row-major).
    double gp[DS4_HCR_G];
    {
        int q = 0;
#pragma unroll
        for (int s = 0; s < DS4_HCR_N; s++)
#pragma unroll
            for (int u = s; u < DS4_HCR_N; u++, q++) {
                double a = 0.0;
#pragma unroll
                for (int j = 0; j < DS4_HCR_J; j++) a += (double)v[s][j] * (double)v[u][j];
                gp[q] = a;
            }
    }
#pragma unroll
    for (int q = 0; q < DS4_HCR_G; q++) {
#pragma unroll
        for (int m = DS4_WARP / 2; m > 0; m >>= 1) gp[q] += ds4_shfl_xor_d(gp[q], m);
    }
    if (lane == 0) {
#pragma unroll
        for (int q = 0; q < DS4_HCR_G; q++) gsh[warp][q] = gp[q];
    }
    __syncthreads();
    if (k < DS4_HCR_G) {
        double a = 0.0;
        for (int w = 0; w < (int)(blockDim.x / DS4_WARP); w++) a += gsh[w][k];
        gsum[k] = a;
    }
    __syncthreads();
    const float rho = ds4_hc_gram_rho<DS4_HCR_N>(gsum, (ds4_size)(n * d), rms_eps);
    const float* m = mix + (ds4_size)t * (2 * n + n * n);
    if (!comp) {
        // The extra warp: post, and comb by Sinkhorn, beside the mix.
        ds4_hc_post_comb_warp(m, rho, base, scale, n, iters, hc_eps, z, post + (ds4_size)t * n,
                              comb + (ds4_size)t * n * n);
        return;
    }
    float pre[DS4_HCR_N];
#pragma unroll
    for (int s = 0; s < DS4_HCR_N; s++)
        pre[s] = s < n ? ds4_sigmoid(scale[0] * (m[s] * rho) + base[s]) + hc_eps : 0.0f;
    float* yt = y + (ds4_size)t * d;
    float yv[DS4_HCR_J];
#pragma unroll
    for (int j = 0; j < DS4_HCR_J; j++) {
        float a = 0.0f;
#pragma unroll
        for (int s = 0; s < DS4_HCR_N; s++)
            if (s < n) a += pre[s] * v[s][j];
        yv[j] = a;
        const int i = k + j * DS4_HCR_CT;
        if (i < d) yt[i] = a;
    }
    if (normed) {
        const float sc = ds4_hc_gram_norm<DS4_HCR_N>(pre, gsum, d, rms_eps);
        float* nt = normed + (ds4_size)t * d;
#pragma unroll
        for (int j = 0; j < DS4_HCR_J; j++) {
            const int i = k + j * DS4_HCR_CT;
            if (i < d) nt[i] = norm_w ? (yv[j] * sc) * g[j] : yv[j] * sc;
        }
    }
}

// HCPre with its mixing matmul, for decode-sized passes (docs/gpu.md §11). The unfused pair
// was a 16384 -> 24 GEMV on 12 blocks followed by a one-block HCPre: ~19 µs per call (ncu on
// the H200, caches flushed), 86 calls per token. Here `ds4_hc_mix_part_*` spreads the
// matmul over ceil(d / 64) blocks (each: 64 columns of every stream, all 2n+n² outputs, and
// that slice's share of the streams' Gram matrix in double); `ds4_hc_mix_apply` has every
// block reduce the same partials in the same order (so all agree bit for bit), then the
// column blocks write y and its RMSNorm while one extra block writes mix, post and comb.
// Sums are in a fixed order (deterministic), not the CPU's.
#define DS4_HCM_COLS 64
#define DS4_HCM_WARPS 8
#define DS4_HCM_N 4
#define DS4_HCM_MAXO 3
#define DS4_HCM_G (DS4_HCM_N * (DS4_HCM_N + 1) / 2)
#define DS4_HCM_APPLY 256
#define DS4_HCM_PARTS 64

// Weights are immutable: plain loads, issued before the wait (docs/gpu.md §6).
__device__ __forceinline__ void ds4_hc_w2(const ds4_u16* p, float& a, float& b) {
    const ds4_u32 v = *reinterpret_cast<const ds4_u32*>(p);
    a = ds4_h2f((ds4_u16)(v & 0xffffu));
    b = ds4_h2f((ds4_u16)(v >> 16));
}
__device__ __forceinline__ void ds4_hc_w2(const float* p, float& a, float& b) {
    a = p[0];
    b = p[1];
}

// This warp's rows of φ for the block's columns (outputs warp, warp + 8, warp + 16).
template <class W>
__device__ __forceinline__ void ds4_hc_mix_weights(const W* fn, int n, int d, int nm,
                                                   float (&w)[DS4_HCM_MAXO][DS4_HCM_N][2]) {
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    const int c = blockIdx.x * DS4_HCM_COLS + 2 * lane;
    const ds4_size nd = (ds4_size)n * d;
#pragma unroll
    for (int k = 0; k < DS4_HCM_MAXO; k++) {
        const int o = warp + k * DS4_HCM_WARPS;
#pragma unroll
        for (int s = 0; s < DS4_HCM_N; s++) {
            w[k][s][0] = 0.0f;
            w[k][s][1] = 0.0f;
            if (c < d && o < nm && s < n)
                ds4_hc_w2(fn + (ds4_size)o * nd + (ds4_size)s * d + c, w[k][s][0], w[k][s][1]);
        }
    }
}

// The previous sublayer's HCPost (docs/gpu.md §11), when the part kernel applies it: its
// output f (+ f2, written back to f, as ds4_hc_post does) and its post / comb coefficients.
struct Ds4HcPrev {
    float* f;
    const float* f2;
    const float* post;
    const float* comb;
};

// One token's partials of the block: the nm mix outputs (warp w sums outputs w, w + 8, w + 16)
// and the Gram entries s <= u in double, each summed over the warp's lanes, into `slot`.
__device__ __forceinline__ void ds4_hc_mix_store(const float (&w)[DS4_HCM_MAXO][DS4_HCM_N][2],
                                                 const float (&xv)[DS4_HCM_N][2], int nm,
                                                 ds4_size slot, float* partf, double* partd) {
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
#pragma unroll
    for (int k = 0; k < DS4_HCM_MAXO; k++) {
        const int o = warp + k * DS4_HCM_WARPS;  // warp-uniform
        if (o < nm) {
            float a = 0.0f;
#pragma unroll
            for (int s = 0; s < DS4_HCM_N; s++) {
                a += w[k][s][0] * xv[s][0];
                a += w[k][s][1] * xv[s][1];
            }
#pragma unroll
            for (int m = DS4_WARP / 2; m > 0; m >>= 1) a += ds4_shfl_xor(a, m);
            if (lane == 0) partf[slot * nm + o] = a;
        }
    }
    int q = 0;
#pragma unroll
    for (int s = 0; s < DS4_HCM_N; s++)
#pragma unroll
        for (int u = s; u < DS4_HCM_N; u++, q++) {
            if (q % DS4_HCM_WARPS != warp) continue;  // warp-uniform
            double a = (double)xv[s][0] * (double)xv[u][0] + (double)xv[s][1] * (double)xv[u][1];
#pragma unroll
            for (int m = DS4_WARP / 2; m > 0; m >>= 1) a += ds4_shfl_xor_d(a, m);
            if (lane == 0) partd[slot * DS4_HCM_G + q] = a;
        }
}

// The block's partial mix (all nm outputs) and partial Gram matrix, after the wait. With
// prev.f non-null, the previous sublayer's HCPost first turns the block's columns of x into
// the new residual streams (ds4_hc_post's expressions, so the same values), written back by
// warp 0 once every warp has read the old ones; the sums then use the new values.
__device__ __forceinline__ void ds4_hc_mix_sums(const float (&w)[DS4_HCM_MAXO][DS4_HCM_N][2],
                                                float* x, int n, int d, int nm,
                                                float* partf, double* partd,
                                                const Ds4HcPrev& prev) {
    const int g = blockIdx.x, t = blockIdx.y, nb = gridDim.x;
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    const int c = g * DS4_HCM_COLS + 2 * lane;
    float* xt = x + (ds4_size)t * n * d;
    float xv[DS4_HCM_N][2];
#pragma unroll
    for (int s = 0; s < DS4_HCM_N; s++) {
        const bool ok = c < d && s < n;
        xv[s][0] = ok ? ds4_ld_act(xt + (ds4_size)s * d + c) : 0.0f;
        xv[s][1] = ok ? ds4_ld_act(xt + (ds4_size)s * d + c + 1) : 0.0f;
    }
    if (prev.f) {
        const bool ok = c < d;
        const float* pt = prev.post + (ds4_size)t * n;
        const float* cb = prev.comb + (ds4_size)t * n * n;
        float fv[2];
        float nv[DS4_HCM_N][2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const ds4_size fi = (ds4_size)t * d + c + e;
            fv[e] = ok ? ds4_ld_act(prev.f + fi) : 0.0f;
            if (prev.f2) fv[e] = fv[e] + (ok ? ds4_ld_act(prev.f2 + fi) : 0.0f);
#pragma unroll
            for (int j = 0; j < DS4_HCM_N; j++) {
                nv[j][e] = 0.0f;
                if (j >= n) continue;
                float acc = 0.0f;
#pragma unroll
                for (int i = 0; i < DS4_HCM_N; i++)
                    if (i < n) acc += ds4_ld_act(cb + i * n + j) * xv[i][e];
                nv[j][e] = ds4_ld_act(pt + j) * fv[e] + acc;
            }
        }
        __syncthreads();  // every warp holds the old columns before warp 0 rewrites them
        if (warp == 0 && ok) {
#pragma unroll
            for (int s = 0; s < DS4_HCM_N; s++) {
                if (s >= n) continue;
                xt[(ds4_size)s * d + c] = nv[s][0];
                xt[(ds4_size)s * d + c + 1] = nv[s][1];
            }
            if (prev.f2) {
                prev.f[(ds4_size)t * d + c] = fv[0];
                prev.f[(ds4_size)t * d + c + 1] = fv[1];
            }
        }
#pragma unroll
        for (int s = 0; s < DS4_HCM_N; s++) {
            xv[s][0] = nv[s][0];
            xv[s][1] = nv[s][1];
        }
    }
    ds4_hc_mix_store(w, xv, nm, (ds4_size)t * nb + g, partf, partd);
}

// ds4_hc_mix_sums for DS4_HCM_TPB tokens per block (blockIdx.y · TPB + i, those below
// n_tok): each token's loads, HCPost and sums are the one-token block's expressions in the
// same order, so the partials are the same bits; the block reads its columns of φ once for
// all of them and issues every token's loads before it sums (a batched step's 8 tokens were
// 8 blocks each waiting on its own loads: ncu 24.2 µs per launch against 9.2 µs for one).
#define DS4_HCM_TPB 4
__device__ __forceinline__ void ds4_hc_mix_sums_tpb(
    const float (&w)[DS4_HCM_MAXO][DS4_HCM_N][2], float* x, int n, int d, int nm, int n_tok,
    float* partf, double* partd, const Ds4HcPrev& prev) {
    const int g = blockIdx.x, nb = gridDim.x;
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    const int c = g * DS4_HCM_COLS + 2 * lane;
    const int t0 = blockIdx.y * DS4_HCM_TPB;
    float xv[DS4_HCM_TPB][DS4_HCM_N][2];
#pragma unroll
    for (int i = 0; i < DS4_HCM_TPB; i++) {
        const int t = t0 + i;
        const float* xt = x + (ds4_size)min(t, n_tok - 1) * n * d;
#pragma unroll
        for (int s = 0; s < DS4_HCM_N; s++) {
            const bool ok = t < n_tok && c < d && s < n;
            xv[i][s][0] = ok ? ds4_ld_act(xt + (ds4_size)s * d + c) : 0.0f;
            xv[i][s][1] = ok ? ds4_ld_act(xt + (ds4_size)s * d + c + 1) : 0.0f;
        }
    }
    if (prev.f) {
        float nv[DS4_HCM_TPB][DS4_HCM_N][2];
        float fv[DS4_HCM_TPB][2];
#pragma unroll
        for (int i = 0; i < DS4_HCM_TPB; i++) {
            const int t = t0 + i;
            const bool okt = t < n_tok;
            const bool ok = okt && c < d;
            const int tt = min(t, n_tok - 1);
            const float* pt = prev.post + (ds4_size)tt * n;
            const float* cb = prev.comb + (ds4_size)tt * n * n;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const ds4_size fi = (ds4_size)tt * d + c + e;
                fv[i][e] = ok ? ds4_ld_act(prev.f + fi) : 0.0f;
                if (prev.f2) fv[i][e] = fv[i][e] + (ok ? ds4_ld_act(prev.f2 + fi) : 0.0f);
#pragma unroll
                for (int j = 0; j < DS4_HCM_N; j++) {
                    nv[i][j][e] = 0.0f;
                    if (j >= n) continue;
                    float acc = 0.0f;
#pragma unroll
                    for (int k = 0; k < DS4_HCM_N; k++)
                        if (k < n) acc += ds4_ld_act(cb + k * n + j) * xv[i][k][e];
                    nv[i][j][e] = ds4_ld_act(pt + j) * fv[i][e] + acc;
                }
            }
        }
        __syncthreads();  // every warp holds the old columns before warp 0 rewrites them
        if (warp == 0 && c < d) {
#pragma unroll
            for (int i = 0; i < DS4_HCM_TPB; i++) {
                const int t = t0 + i;
                if (t >= n_tok) continue;
                float* xt = x + (ds4_size)t * n * d;
#pragma unroll
                for (int s = 0; s < DS4_HCM_N; s++) {
                    if (s >= n) continue;
                    xt[(ds4_size)s * d + c] = nv[i][s][0];
                    xt[(ds4_size)s * d + c + 1] = nv[i][s][1];
                }
                if (prev.f2) {
                    prev.f[(ds4_size)t * d + c] = fv[i][0];
                    prev.f[(ds4_size)t * d + c + 1] = fv[i][1];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < DS4_HCM_TPB; i++)
#pragma unroll
            for (int s = 0; s < DS4_HCM_N; s++) {
                xv[i][s][0] = nv[i][s][0];
                xv[i][s][1] = nv[i][s][1];
            }
    }
#pragma unroll
    for (int i = 0; i < DS4_HCM_TPB; i++) {
        const int t = t0 + i;
        if (t >= n_tok) break;  // block-uniform
        ds4_hc_mix_store(w, xv[i], nm, (ds4_size)t * nb + g, partf, partd);
    }
}

// Grid (ceil(d / 64), T), 256 threads; n <= 4, 2n+n² <= 24, d even. partf [T][G][nm],
// partd [T][G][10] (Gram entries s <= u in row-major order; entries of absent streams 0).
// f null: x as it is; else the previous sublayer's HCPost is applied first (Ds4HcPrev; f2
// may be null), x and f updated in place.
extern "C" __global__ void __launch_bounds__(DS4_HCM_WARPS * DS4_WARP)
ds4_hc_mix_part_f16(const ds4_u16* fn, float* x, int n, int d, int nm, float* partf,
                    double* partd, float* f, const float* f2, const float* post, const float* comb) {
    float w[DS4_HCM_MAXO][DS4_HCM_N][2];
    ds4_hc_mix_weights(fn, n, d, nm, w);
    ds4_grid_wait();
    ds4_hc_mix_sums(w, x, n, d, nm, partf, partd, Ds4HcPrev{f, f2, post, comb});
}
extern "C" __global__ void __launch_bounds__(DS4_HCM_WARPS * DS4_WARP)
ds4_hc_mix_part_f32(const float* fn, float* x, int n, int d, int nm, float* partf,
                    double* partd, float* f, const float* f2, const float* post, const float* comb) {
    float w[DS4_HCM_MAXO][DS4_HCM_N][2];
    ds4_hc_mix_weights(fn, n, d, nm, w);
    ds4_grid_wait();
    ds4_hc_mix_sums(w, x, n, d, nm, partf, partd, Ds4HcPrev{f, f2, post, comb});
}

// As ds4_hc_mix_part_<w> with DS4_HCM_TPB tokens per block: grid (ceil(d / 64),
// ceil(n_tok / DS4_HCM_TPB)); the same partials, bit for bit.
extern "C" __global__ void __launch_bounds__(DS4_HCM_WARPS * DS4_WARP)
ds4_hc_mix_part_tpb_f16(const ds4_u16* fn, float* x, int n, int d, int nm, float* partf,
                        double* partd, float* f, const float* f2, const float* post,
                        const float* comb, int n_tok) {
    float w[DS4_HCM_MAXO][DS4_HCM_N][2];
    ds4_hc_mix_weights(fn, n, d, nm, w);
    ds4_grid_wait();
    ds4_hc_mix_sums_tpb(w, x, n, d, nm, n_tok, partf, partd, Ds4HcPrev{f, f2, post, comb});
}
extern "C" __global__ void __launch_bounds__(DS4_HCM_WARPS * DS4_WARP)
ds4_hc_mix_part_tpb_f32(const float* fn, float* x, int n, int d, int nm, float* partf,
                        double* partd, float* f, const float* f2, const float* post,
                        const float* comb, int n_tok) {
    float w[DS4_HCM_MAXO][DS4_HCM_N][2];
    ds4_hc_mix_weights(fn, n, d, nm, w);
    ds4_grid_wait();
    ds4_hc_mix_sums_tpb(w, x, n, d, nm, n_tok, partf, partd, Ds4HcPrev{f, f2, post, comb});
}

// Grid (ceil(d / 256) + 1, T), 256 threads, nb <= DS4_HCM_PARTS partials per token. The
// last block writes mix [T][nm], post and comb (Sinkhorn by one warp, ds4_sinkhorn_warp);
// the others y (and normed = rms_norm(y) * norm_w when normed is non-null) for 256 columns.
// Every block first copies the token's partials into shared memory with all loads in
// flight at once, then sums them there (one warp per sum, a fixed order).
extern "C" __global__ void __launch_bounds__(DS4_HCM_APPLY)
ds4_hc_mix_apply(const float* partf, const double* partd, int nb, const float* x,
                 const float* base, const float* scale, int n, int d, int nm, int iters,
                 float hc_eps, float rms_eps, float* mix, float* y, float* post, float* comb,
                 const float* norm_w, float* normed) {
    constexpr int NM = 2 * DS4_HCM_N + DS4_HCM_N * DS4_HCM_N;
    constexpr int FPT = (DS4_HCM_PARTS * NM + DS4_HCM_APPLY - 1) / DS4_HCM_APPLY;
    constexpr int DPT = (DS4_HCM_PARTS * DS4_HCM_G + DS4_HCM_APPLY - 1) / DS4_HCM_APPLY;
    __shared__ float spf[DS4_HCM_PARTS * NM];
    __shared__ double spd[DS4_HCM_PARTS * DS4_HCM_G];
    __shared__ float smix[NM];
    __shared__ double sg[DS4_HCM_G];
    __shared__ float z[DS4_HC_MAX * DS4_HC_MAX];
    const int t = blockIdx.y, tid = threadIdx.x;
    const bool coef = blockIdx.x == gridDim.x - 1;
    const int lane = tid & (DS4_WARP - 1), warp = tid / DS4_WARP;
    const int i = blockIdx.x * DS4_HCM_APPLY + tid;
    const bool col = !coef && i < d;
    const float gw = (col && norm_w) ? norm_w[i] : 0.0f;
    ds4_grid_wait();
    const ds4_size nd = (ds4_size)n * d;
    float xv[DS4_HCM_N];
#pragma unroll
    for (int s = 0; s < DS4_HCM_N; s++)
        xv[s] = (col && s < n) ? ds4_ld_act(x + (ds4_size)t * nd + (ds4_size)s * d + i) : 0.0f;
    {
        const float* pf = partf + (ds4_size)t * nb * nm;
        const double* pd = partd + (ds4_size)t * nb * DS4_HCM_G;
        float fv[FPT];
        double dv[DPT];
#pragma unroll
        for (int j = 0; j < FPT; j++) {
            const int e = tid + j * DS4_HCM_APPLY;
            fv[j] = e < nb * nm ? ds4_ld_act(pf + e) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < DPT; j++) {
            const int e = tid + j * DS4_HCM_APPLY;
            dv[j] = e < nb * DS4_HCM_G ? ds4_ld_act(pd + e) : 0.0;
        }
#pragma unroll
        for (int j = 0; j < FPT; j++) {
            const int e = tid + j * DS4_HCM_APPLY;
            if (e < nb * nm) spf[e] = fv[j];
        }
#pragma unroll
        for (int j = 0; j < DPT; j++) {
            const int e = tid + j * DS4_HCM_APPLY;
            if (e < nb * DS4_HCM_G) spd[e] = dv[j];
        }
    }
    __syncthreads();
    // The same code (and order) in every block, so the column blocks' pre weights match the
    // coefficient block's mix.
    const int nf = coef ? nm : n;
    for (int q = warp; q < nf + DS4_HCM_G; q += DS4_HCM_WARPS) {
        if (q < nf) {
            float a = 0.0f;
            for (int k = lane; k < nb; k += DS4_WARP) a += spf[k * nm + q];
#pragma unroll
            for (int m = DS4_WARP / 2; m > 0; m >>= 1) a += ds4_shfl_xor(a, m);
            if (lane == 0) smix[q] = a;
        } else {
            double a = 0.0;
            for (int k = lane; k < nb; k += DS4_WARP) a += spd[k * DS4_HCM_G + (q - nf)];
#pragma unroll
            for (int m = DS4_WARP / 2; m > 0; m >>= 1) a += ds4_shfl_xor_d(a, m);
            if (lane == 0) sg[q - nf] = a;
        }
    }
    __syncthreads();
    const float rho = ds4_hc_gram_rho<DS4_HCM_N>(sg, nd, rms_eps);
    if (coef) {
        if (tid < nm) mix[(ds4_size)t * nm + tid] = smix[tid];
        if (warp != 0) return;
        ds4_hc_post_comb_warp(smix, rho, base, scale, n, iters, hc_eps, z, post + (ds4_size)t * n,
                              comb + (ds4_size)t * n * n);
        return;
    }
    float pre[DS4_HCM_N];
#pragma unroll
    for (int s = 0; s < DS4_HCM_N; s++)
        pre[s] = s < n ? ds4_sigmoid(scale[0] * (smix[s] * rho) + base[s]) + hc_eps : 0.0f;
    float a = 0.0f;
#pragma unroll
    for (int s = 0; s < DS4_HCM_N; s++)
        if (s < n) a += pre[s] * xv[s];
    if (col) y[(ds4_size)t * d + i] = a;
    if (normed && col) {
        const float sc = ds4_hc_gram_norm<DS4_HCM_N>(pre, sg, d, rms_eps);
        normed[(ds4_size)t * d + i] = norm_w ? (a * sc) * gw : a * sc;
    }
}

// HCPost in place: X'_j[e] = post_j f[e] + sum_i comb[i][j] X_i[e]; one thread per (t, e).
// With f2 non-null, f += f2 first (written back: the residual add before HCPost fused in).
extern "C" __global__ void ds4_hc_post(float* x, float* f, const float* f2, const float* post,
                                       const float* comb, int n_tok, int n, int d) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n_tok * d;
    DS4_GRID_STRIDE(e, total) {
        const ds4_size t = e / d;
        const int i0 = (int)(e % d);
        float* xt = x + t * n * d;
        const float* c = comb + t * n * n;
        float old[DS4_HC_MAX];
        for (int i = 0; i < n; i++) old[i] = xt[(ds4_size)i * d + i0];
        float fv = f[t * d + i0];
        if (f2) {
            fv = fv + f2[t * d + i0];
            f[t * d + i0] = fv;
        }
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++) acc += c[i * n + j] * old[i];
            xt[(ds4_size)j * d + i0] = post[t * n + j] * fv + acc;
        }
    }
}

// ds4_hc_post for n = DS4_HCM_N streams over a 2-D grid: x = dims in blocks of 256
// threads, y = tokens (a grid stride past 65,535). The flat grid stride of ds4_hc_post
// divides a 64-bit element index by d for every element and walks `old` through local
// memory (n is a run-time count); here the token comes from the grid and the stream loops
// are unrolled into registers. Per element the same expressions in the same order, so the
// same values (docs/gpu.md §21); the prefill profile had ds4_hc_post at 187 µs per launch
// for 2048 tokens (H100), ≈ 1.5× its memory time.
extern "C" __device__ const int ds4_hc_post4_streams[2] = {DS4_HCM_N, 0};
extern "C" __global__ void __launch_bounds__(256)
ds4_hc_post4(float* x, float* f, const float* f2, const float* post, const float* comb,
             int n_tok, int d) {
    ds4_grid_wait();
    constexpr int n = DS4_HCM_N;
    const int i0 = (int)blockIdx.x * (int)blockDim.x + (int)threadIdx.x;
    if (i0 >= d) return;
    for (int t = blockIdx.y; t < n_tok; t += gridDim.y) {
        float* xt = x + (ds4_size)t * n * d;
        const float* c = comb + (ds4_size)t * n * n;
        float old[n];
#pragma unroll
        for (int i = 0; i < n; i++) old[i] = xt[(ds4_size)i * d + i0];
        const ds4_size fi = (ds4_size)t * d + i0;
        float fv = f[fi];
        if (f2) {
            fv = fv + f2[fi];
            f[fi] = fv;
        }
#pragma unroll
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < n; i++) acc += c[i * n + j] * old[i];
            xt[(ds4_size)j * d + i0] = post[(ds4_size)t * n + j] * fv + acc;
        }
    }
}

// HCHead, one block per token.
extern "C" __global__ void __launch_bounds__(256)
ds4_hc_head(const float* mix, const float* x, const float* base, const float* scale, int n,
            int d, float hc_eps, float rms_eps, float* y) {
    ds4_grid_wait();
    __shared__ double sh[256];
    __shared__ float wts[DS4_HC_MAX];
    const int t = blockIdx.x;
    const float* xt = x + (ds4_size)t * n * d;
    const float rho = ds4_rms_scale(xt, n * d, rms_eps, sh);
    if (threadIdx.x < n) {
        const int i = threadIdx.x;
        wts[i] = ds4_sigmoid(scale[0] * (mix[(ds4_size)t * n + i] * rho) + base[i]) + hc_eps;
    }
    __syncthreads();
    ds4_mix_streams(xt, wts, n, d, y + (ds4_size)t * d);
}

// ---------------------------------------------------------------------------------------
// Compressor (docs/forward.md §5.3): one block walks the chunk's tokens in order (the accumulator is a
// sequential state); threads split the feature dims. acc = [u slots | z slots].
// ---------------------------------------------------------------------------------------
__device__ void ds4_compressor_block(float* acc, const float* u, const float* z, const float* ape,
                                     ds4_size pos0, int n_tok, int m, int c, int overlap,
                                     float* rows, ds4_size cap) {
    const int pw = overlap ? 2 * c : c;
    const int slots = overlap ? 2 * m : m;
    float* au = acc;
    float* az = acc + (ds4_size)slots * pw;
    for (int t = 0; t < n_tok; t++) {
        const ds4_size p = pos0 + t;
        const int j = (int)(p % m);
        const int slot = overlap ? m + j : j;
        for (int e = threadIdx.x; e < pw; e += blockDim.x) {
            au[slot * pw + e] = u[(ds4_size)t * pw + e];
            az[slot * pw + e] = z[(ds4_size)t * pw + e] + ape[j * pw + e];
        }
        __syncthreads();
        if (j + 1 != m) continue;
        const ds4_size w = p / m;
        if (w < cap) {
            for (int e = threadIdx.x; e < c; e += blockDim.x) {
                // Candidates: previous window's first half (overlap, w > 0), then this
                // window's (second half when overlapping).
                const int s0 = overlap ? (w > 0 ? 0 : m) : 0;
                const int s1 = overlap ? 2 * m : m;
                float mx = -__int_as_float(0x7f800000);
                for (int s = s0; s < s1; s++) {
                    const int off = (overlap && s >= m) ? c + e : e;
                    mx = fmaxf(mx, az[s * pw + off]);
                }
                float sum = 0.0f;
                for (int s = s0; s < s1; s++) {
                    const int off = (overlap && s >= m) ? c + e : e;
                    sum += expf(az[s * pw + off] - mx);
                }
                float o = 0.0f;
                for (int s = s0; s < s1; s++) {
                    const int off = (overlap && s >= m) ? c + e : e;
                    o += (expf(az[s * pw + off] - mx) / sum) * au[s * pw + off];
                }
                rows[w * c + e] = o;
            }
        }
        __syncthreads();
        if (overlap) {
            for (int e = threadIdx.x; e < m * pw; e += blockDim.x) {
                au[e] = au[m * pw + e];
                az[e] = az[m * pw + e];
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(256)
ds4_compressor(float* acc, const float* u, const float* z, const float* ape, ds4_size pos0,
               int n_tok, int m, int c, int overlap, float* rows, ds4_size cap) {
    ds4_grid_wait();
    ds4_compressor_block(acc, u, z, ape, pos0, n_tok, m, c, overlap, rows, cap);
}

// Two independent compressors (a CSA layer's and its indexer's, one sequence) in one launch:
// block 0 runs the first, block 1 the second, each ds4_compressor's code.
extern "C" __global__ void __launch_bounds__(256)
ds4_compressor2(float* acc, const float* u, const float* z, const float* ape, ds4_size pos0,
                int n_tok, int m, int c, int overlap, float* rows, ds4_size cap, float* acc_b,
                const float* u_b, const float* z_b, const float* ape_b, ds4_size pos0_b,
                int n_tok_b, int m_b, int c_b, int overlap_b, float* rows_b, ds4_size cap_b) {
    ds4_grid_wait();
    if (blockIdx.x == 0)
        ds4_compressor_block(acc, u, z, ape, pos0, n_tok, m, c, overlap, rows, cap);
    else
        ds4_compressor_block(acc_b, u_b, z_b, ape_b, pos0_b, n_tok_b, m_b, c_b, overlap_b, rows_b,
                             cap_b);
}

// One token of each of up to DS4_SEQS sequences (a batched decode step): block s runs
// sequence s's compressor (its accumulator, rows and position by value in ds4_comp_seqs;
// row s of u / z), the same code as alone.
#define DS4_SEQS 16
struct ds4_comp_seqs {
    float* acc[DS4_SEQS];
    float* rows[DS4_SEQS];
    ds4_size pos0[DS4_SEQS];
    ds4_size cap[DS4_SEQS];
};
extern "C" __global__ void __launch_bounds__(256)
ds4_compressor_seqs(const float* u, const float* z, const float* ape, ds4_comp_seqs sq, int m,
                    int c, int overlap) {
    ds4_grid_wait();
    const int s = blockIdx.x;
    const ds4_size pw = overlap ? 2 * c : c;
    ds4_compressor_block(sq.acc[s], u + s * pw, z + s * pw, ape, sq.pos0[s], 1, m, c, overlap,
                         sq.rows[s], sq.cap[s]);
}

// Prefill compressor in parallel over the windows a chunk completes: ds4_compressor walks
// the tokens one after another in one block, ds4_compressor_windows pools every completed
// window at once (block x = the chunk's x-th completed window, y = 256 output features) and
// ds4_compressor_tail then leaves the accumulator exactly as ds4_compressor leaves it.
// A window's candidates are its tokens' (u, z + ape): from this chunk's projections, or for
// a token p before pos0 from the accumulator as the chunk found it — with overlap, slot
// p % m once p's window had completed before pos0 (moved to the previous-window half),
// else slot m + p % m; without overlap slot p % m. They are pooled in ds4_compressor's
// order with its operations, so every row is bit for bit the sequential kernel's.
#define DS4_COMP_MAX_OVERLAP_M 8
__device__ __forceinline__ void ds4_comp_value(const float* acc, const float* u, const float* z,
                                               const float* ape, ds4_size pos0, int m, int pw,
                                               int slots, int overlap, ds4_size p, int off,
                                               float* uv, float* zv) {
    const int j = (int)(p % m);
    if (p >= pos0) {
        const ds4_size t = p - pos0;
        *uv = u[t * pw + off];
        *zv = z[t * pw + off] + ape[j * pw + off];
        return;
    }
    const int slot = overlap && (p / m + 1) * m > pos0 ? m + j : j;
    *uv = acc[(ds4_size)slot * pw + off];
    *zv = acc[((ds4_size)slots + slot) * pw + off];
}

extern "C" __global__ void __launch_bounds__(256)
ds4_compressor_windows(const float* acc, const float* u, const float* z, const float* ape,
                       ds4_size pos0, int m, int c, int overlap, float* rows, ds4_size cap) {
    ds4_grid_wait();
    const int pw = overlap ? 2 * c : c;
    const int slots = overlap ? 2 * m : m;
    const ds4_size w = pos0 / m + blockIdx.x;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= c || w >= cap) return;
    // Candidate s: with overlap the previous window's tokens (feature e; none for window
    // 0), then this window's (feature c + e); without, this window's (feature e).
    const int s0 = overlap ? (w > 0 ? 0 : m) : 0;
    const int s1 = overlap ? 2 * m : m;
    float uv, zv;
#define DS4_CAND(s)                                                                          \
    ds4_comp_value(acc, u, z, ape, pos0, m, pw, slots, overlap,                              \
                   overlap ? (w - 1) * m + (s) : w * m + (s), (overlap && (s) >= m) ? c + e : e, \
                   &uv, &zv)
    float mx = -__int_as_float(0x7f800000);
    for (int s = s0; s < s1; s++) {
        DS4_CAND(s);
        mx = fmaxf(mx, zv);
    }
    float sum = 0.0f;
    for (int s = s0; s < s1; s++) {
        DS4_CAND(s);
        sum += expf(zv - mx);
    }
    float o = 0.0f;
    for (int s = s0; s < s1; s++) {
        DS4_CAND(s);
        o += (expf(zv - mx) / sum) * uv;
    }
#undef DS4_CAND
    rows[w * c + e] = o;
}

// The accumulator after the chunk's n_tok tokens, as ds4_compressor leaves it (one thread per
// projection feature): with overlap, once a window completed in the chunk, the last completed
// window's tokens in both halves (ds4_compressor copies the current half to the previous one
// at a window's end) and the current window's first tokens over the current half; otherwise
// each token in slot m + p % m (overlap) or p % m. Runs after ds4_compressor_windows (which
// reads the accumulator as the chunk found it). Overlap needs m <= DS4_COMP_MAX_OVERLAP_M.
extern "C" __global__ void __launch_bounds__(256)
ds4_compressor_tail(float* acc, const float* u, const float* z, const float* ape, ds4_size pos0,
                    int n_tok, int m, int c, int overlap) {
    ds4_grid_wait();
    const int pw = overlap ? 2 * c : c;
    const int slots = overlap ? 2 * m : m;
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= pw) return;
    float* au = acc;
    float* az = acc + (ds4_size)slots * pw;
    const ds4_size end = pos0 + n_tok, wc = end / m;
    const int j_end = (int)(end % m);
    if (overlap && wc * m > pos0) {
        // Window wc - 1 completed in the chunk: its tokens, read before any store.
        float pu[DS4_COMP_MAX_OVERLAP_M], pz[DS4_COMP_MAX_OVERLAP_M];
        for (int s = 0; s < m; s++) {
            ds4_comp_value(acc, u, z, ape, pos0, m, pw, slots, overlap, (wc - 1) * m + s, e,
                           &pu[s], &pz[s]);
        }
        for (int s = 0; s < m; s++) {
            au[(ds4_size)s * pw + e] = pu[s];
            az[(ds4_size)s * pw + e] = pz[s];
            float cu = pu[s], cz = pz[s];
            if (s < j_end) {
                const ds4_size t = wc * m + s - pos0;
                cu = u[t * pw + e];
                cz = z[t * pw + e] + ape[s * pw + e];
            }
            au[(ds4_size)(m + s) * pw + e] = cu;
            az[(ds4_size)(m + s) * pw + e] = cz;
        }
        return;
    }
    // No window completed (overlap), or no overlap: each slot keeps its latest token.
    for (int j = 0; j < m; j++) {
        if (j >= j_end && wc == 0) continue;
        const ds4_size p = j < j_end ? wc * m + j : (wc - 1) * m + j;
        if (p < pos0) continue;
        const ds4_size t = p - pos0;
        const int slot = overlap ? m + j : j;
        au[(ds4_size)slot * pw + e] = u[t * pw + e];
        az[(ds4_size)slot * pw + e] = z[t * pw + e] + ape[j * pw + e];
    }
}

// ---------------------------------------------------------------------------------------
// Lightning indexer (docs/forward.md §5.5).
// ---------------------------------------------------------------------------------------

// scores[t][r] for r < n_p(t). A block (8 warps) takes DS4_IDX_ROWS rows of one query; q
// of the query is staged once per block in shared memory with a padded row stride
// (dim + 1: lane h reading head h's element i hits bank (h + i) mod 32, conflict-free), and
// so are the block's rows when they fit (DS4_IDX_KS values): read from global memory
// inside the dot loop, every step of a row had waited for an L2 round trip (ncu on the
// H200: 31.7 µs for 513 rows at decode). Each warp scores its rows with one lane per head,
// then one thread per row sums the heads. Each head's dot product and the weighted sum over
// heads use the CPU reference's exact order (8 interleaved partial sums folded left, then
// heads in order) with unfused multiplies and adds, so the scores — and the top-k chosen
// from them — equal the CPU's bit for bit.
// q is [T, heads*dim], w [T, heads]; heads <= 64, heads*dim <= 8192, dim % 8 == 0.
#define DS4_IDX_ROWS 16
#define DS4_IDX_KS 2048
__device__ __forceinline__ float ds4_idx_dot(const float* qh, const float* k, int dim, bool shared_k) {
    float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int i = 0; i < dim; i += 8) {
        const float4 k0 = shared_k ? *(const float4*)(k + i) : ds4_ld_act((const float4*)(k + i));
        const float4 k1 =
            shared_k ? *(const float4*)(k + i + 4) : ds4_ld_act((const float4*)(k + i + 4));
        a[0] = __fadd_rn(a[0], __fmul_rn(qh[i + 0], k0.x));
        a[1] = __fadd_rn(a[1], __fmul_rn(qh[i + 1], k0.y));
        a[2] = __fadd_rn(a[2], __fmul_rn(qh[i + 2], k0.z));
        a[3] = __fadd_rn(a[3], __fmul_rn(qh[i + 3], k0.w));
        a[4] = __fadd_rn(a[4], __fmul_rn(qh[i + 4], k1.x));
        a[5] = __fadd_rn(a[5], __fmul_rn(qh[i + 5], k1.y));
        a[6] = __fadd_rn(a[6], __fmul_rn(qh[i + 6], k1.z));
        a[7] = __fadd_rn(a[7], __fmul_rn(qh[i + 7], k1.w));
    }
    float d = a[0];
#pragma unroll
    for (int l = 1; l < 8; l++) d = __fadd_rn(d, a[l]);
    return d;
}

__device__ void ds4_idx_scores_block(const float* q, const float* w, const float* rows, int heads,
                                     int dim, float wscale, ds4_size pos0, int ratio,
                                     int n_cols, float* scores, int t, int bx) {
    __shared__ float qs[8192 + 64];
    __shared__ float ws[64];
    __shared__ __align__(16) float ks[DS4_IDX_KS];
    __shared__ float dsh[DS4_IDX_ROWS][64];
    const ds4_size n_p = (pos0 + t + 1) / ratio;
    const int ld = dim + 1;
    const ds4_size r0 = (ds4_size)bx * DS4_IDX_ROWS;
    // Rows this block scores (the rest of its DS4_IDX_ROWS are past n_cols or n_p).
    const ds4_size r_end = r0 + DS4_IDX_ROWS < (ds4_size)n_cols ? r0 + DS4_IDX_ROWS : (ds4_size)n_cols;
    const int nr = r_end > r0 ? (int)((r_end < n_p ? r_end : (n_p > r0 ? n_p : r0)) - r0) : 0;
    const bool shared_k = DS4_IDX_ROWS * dim <= DS4_IDX_KS;
    // Every load in flight before the first store: a loop that stores each value as it
    // arrives waits for one L2 round trip per step (the staging had cost most of the 31.7 µs).
    {
        constexpr int QPT = 8192 / 256, KPT = DS4_IDX_KS / 4 / 256;
        const float* qt = q + (ds4_size)t * heads * dim;
        const int nq = heads * dim, nk4 = shared_k ? nr * dim / 4 : 0;
        float qv[QPT];
        float4 kv[KPT];
#pragma unroll
        for (int j = 0; j < QPT; j++) {
            const int e = threadIdx.x + j * 256;
            qv[j] = e < nq ? ds4_ld_act(qt + e) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < KPT; j++) {
            const int e = threadIdx.x + j * 256;
            if (e < nk4) kv[j] = ds4_ld_act((const float4*)(rows + r0 * dim) + e);
        }
        // Head h = e / dim and column c = e % dim, advanced without a division per value.
        const int step_h = 256 / dim, step_c = 256 % dim;
        int h = threadIdx.x / dim, c = threadIdx.x % dim;
#pragma unroll
        for (int j = 0; j < QPT; j++) {
            if (threadIdx.x + j * 256 < nq) qs[h * ld + c] = qv[j];
            h += step_h;
            c += step_c;
            if (c >= dim) {
                c -= dim;
                h++;
            }
        }
#pragma unroll
        for (int j = 0; j < KPT; j++) {
            const int e = threadIdx.x + j * 256;
            if (e < nk4) ((float4*)ks)[e] = kv[j];
        }
    }
    for (int i = threadIdx.x; i < heads; i += blockDim.x) {
        ws[i] = __fmul_rn(w[(ds4_size)t * heads + i], wscale);
    }
    __syncthreads();
    const int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    for (int ri = warp; ri < nr; ri += blockDim.x / DS4_WARP) {
        const float* k = shared_k ? ks + ri * dim : rows + (r0 + ri) * dim;
        for (int h = lane; h < heads; h += DS4_WARP) dsh[ri][h] = ds4_idx_dot(qs + h * ld, k, dim, shared_k);
    }
    __syncthreads();
    const int ri = threadIdx.x;
    if (ri < DS4_IDX_ROWS && r0 + ri < (ds4_size)n_cols) {
        float acc = -__int_as_float(0x7f800000);
        if (ri < nr) {
            acc = 0.0f;
            for (int h = 0; h < heads; h++) {
                acc = __fadd_rn(acc, __fmul_rn(ws[h], fmaxf(dsh[ri][h], 0.0f)));
            }
        }
        scores[(ds4_size)t * n_cols + r0 + ri] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(256)
ds4_indexer_scores(const float* q, const float* w, const float* rows, int heads, int dim,
                   float wscale, ds4_size pos0, int ratio, int n_cols, float* scores) {
    ds4_grid_wait();
    ds4_idx_scores_block(q, w, rows, heads, dim, wscale, pos0, ratio, n_cols, scores, blockIdx.y,
                         blockIdx.x);
}


// Top-k per query (one block of DS4_TOPK_THREADS each): the k largest scores (ties: lower
// index), written ascending to out[t][0..k], padded with -1. Queries with n_p <= k take all
// rows. The k-th largest key K is found by a radix select (four passes of 8-bit digits, a
// shared-memory histogram each); then every thread takes a contiguous segment of indices,
// and two block scans (of its "== K" and of its selected counts) give each segment its
// place, so the output comes out in index order with the first need_eq ties.
#define DS4_TOPK_THREADS 1024
static_assert(DS4_TOPK_THREADS == DS4_WARP * DS4_WARP, "the scan's second level is one warp");
// Exclusive prefix sum over the block's 1024 threads (sh holds >= 32 ints): a shuffle scan in
// each warp, one over the 32 warp totals, three barriers (integer sums: any order is exact).
// The Hillis-Steele scan in shared memory it replaces took 22 barriers; six scans per call
// made the decode top-k barrier-bound (ncu on the H200: 10.8 µs for 513 scores).
__device__ int ds4_scan_excl_1024(int v, int* sh) {
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    int x = v;
#pragma unroll
    for (int o = 1; o < DS4_WARP; o <<= 1) {
        const int y = ds4_shfl_up_i(x, o);
        if (lane >= o) x += y;
    }
    if (lane == DS4_WARP - 1) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = sh[lane];
#pragma unroll
        for (int o = 1; o < DS4_WARP; o <<= 1) {
            const int y = ds4_shfl_up_i(w, o);
            if (lane >= o) w += y;
        }
        sh[lane] = w;
    }
    __syncthreads();
    const int r = x - v + (warp > 0 ? sh[warp - 1] : 0);
    __syncthreads();
    return r;
}

__device__ void ds4_topk_block(const float* scores, int n_cols, ds4_size pos0, int ratio, int k,
                               int* out, int t) {
    __shared__ int sh[DS4_TOPK_THREADS];
    __shared__ int hist[256];
    __shared__ ds4_u32 s_prefix;
    __shared__ int s_rank;
    const int tid = threadIdx.x;
    const int n_p = (int)((pos0 + t + 1) / ratio);
    int* o = out + (ds4_size)t * k;
    for (int i = tid; i < k; i += blockDim.x) o[i] = -1;
    __syncthreads();
    if (n_p <= k) {
        for (int i = tid; i < n_p; i += blockDim.x) o[i] = i;
        return;
    }
    const float* s = scores + (ds4_size)t * n_cols;
    ds4_u32 prefix = 0, mask = 0;
    int rank = k;  // rank of K among the keys that match `prefix` under `mask`
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
        for (int i = tid; i < n_p; i += blockDim.x) {
            const ds4_u32 key = ds4_key(s[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        // Thread d (< 256) looks at digit 255 - d: counts of larger digits come first.
        const int c = tid < 256 ? hist[255 - tid] : 0;
        const int before = ds4_scan_excl_1024(c, sh);
        if (tid < 256 && before < rank && before + c >= rank) {
            s_prefix = prefix | ((ds4_u32)(255 - tid) << shift);
            s_rank = rank - before;
        }
        __syncthreads();
        prefix = s_prefix;
        rank = s_rank;
        mask |= 255u << shift;
        __syncthreads();
    }
    const int need_eq = rank;  // keys == K to take (the rest of the k are > K)
    const int seg = (n_p + DS4_TOPK_THREADS - 1) / DS4_TOPK_THREADS;
    const int a = min(tid * seg, n_p), b = min(a + seg, n_p);
    int gt = 0, eq = 0;
    for (int i = a; i < b; i++) {
        const ds4_u32 key = ds4_key(s[i]);
        gt += key > prefix ? 1 : 0;
        eq += key == prefix ? 1 : 0;
    }
    const int eq_before = ds4_scan_excl_1024(eq, sh);
    const int take_eq = max(0, min(eq, need_eq - eq_before));
    const int base = ds4_scan_excl_1024(gt + take_eq, sh);
    int w = base, eq_taken = 0;
    for (int i = a; i < b; i++) {
        const ds4_u32 key = ds4_key(s[i]);
        bool sel = key > prefix;
        if (key == prefix && eq_taken < take_eq) {
            sel = true;
            eq_taken++;
        }
        if (sel && w < k) o[w++] = i;
    }
}

extern "C" __global__ void __launch_bounds__(DS4_TOPK_THREADS)
ds4_topk_select(const float* scores, int n_cols, ds4_size pos0, int ratio, int k, int* out) {
    ds4_grid_wait();
    ds4_topk_block(scores, n_cols, pos0, ratio, k, out, blockIdx.x);
}

// The indexer of one token of each of up to DS4_SEQS sequences (a batched decode step): what
// differs per sequence comes by value (its compressed rows, score row, selection, position,
// visible rows; a null score row = all its rows fit the top-k, as ds4_indexer_topk's host
// skips the scores); row s of q / w is sequence s. Same code as alone.
struct ds4_idx_seqs {
    const float* rows[DS4_SEQS];
    float* scores[DS4_SEQS];
    int* out[DS4_SEQS];
    ds4_size pos0[DS4_SEQS];
    int n_cols[DS4_SEQS];
};
extern "C" __global__ void __launch_bounds__(256)
ds4_indexer_scores_seqs(const float* q, const float* w, ds4_idx_seqs sq, int heads, int dim,
                        float wscale, int ratio) {
    ds4_grid_wait();
    const int s = blockIdx.y;
    if (!sq.scores[s] || (int)blockIdx.x * DS4_IDX_ROWS >= sq.n_cols[s]) return;
    ds4_idx_scores_block(q + (ds4_size)s * heads * dim, w + (ds4_size)s * heads, sq.rows[s],
                         heads, dim, wscale, sq.pos0[s], ratio, sq.n_cols[s], sq.scores[s], 0,
                         blockIdx.x);
}
extern "C" __global__ void __launch_bounds__(DS4_TOPK_THREADS)
ds4_topk_select_seqs(ds4_idx_seqs sq, int ratio, int k) {
    ds4_grid_wait();
    const int s = blockIdx.x;
    ds4_topk_block(sq.scores[s], sq.n_cols[s], sq.pos0[s], ratio, k, sq.out[s], 0);
}

// ---------------------------------------------------------------------------------------
// Sink attention (docs/forward.md §5.2, §5.4, §5.6): one block of 4 warps per (token, head); every warp
// takes keys w, w+4, ... with an online softmax, then the warps combine with the sink.
// head_dim <= 512 (16 values per lane, held in registers).
// ---------------------------------------------------------------------------------------
#define DS4_ATT_WARPS 4
#define DS4_ATT_MAXV 16
extern "C" __global__ void __launch_bounds__(128)
ds4_attention(const float* q, const float* kv, const float* ring, const float* crows,
              const int* idx, const float* sinks, ds4_size pos0, int n_head, int hd, int window,
              int comp_mode, int ratio, int k_sel, ds4_size n_crows, float scale, float* out,
              int* fault) {
    ds4_grid_wait();
    __shared__ float m_sh[DS4_ATT_WARPS], s_sh[DS4_ATT_WARPS];
    __shared__ float o_sh[DS4_ATT_WARPS][DS4_ATT_MAXV * DS4_WARP];
    const int th = blockIdx.x;
    const int t = th / n_head, h = th % n_head;
    const int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    const ds4_size p = pos0 + t;
    const ds4_size lo = p + 1 > (ds4_size)window ? p + 1 - window : 0;
    const int n_win = (int)(p - lo + 1);
    int n_comp = 0;
    if (comp_mode == 1) n_comp = (int)((p + 1) / ratio);
    if (comp_mode == 2) n_comp = k_sel;
    const ds4_size n_vis = comp_mode != 0 ? (p + 1) / ratio : 0;
    const float* qv = q + (ds4_size)th * hd;
    const int nv = (hd + DS4_WARP - 1) / DS4_WARP;
    float qr[DS4_ATT_MAXV], acc[DS4_ATT_MAXV];
#pragma unroll
    for (int j = 0; j < DS4_ATT_MAXV; j++) {
        const int dd = lane + j * DS4_WARP;
        qr[j] = (j < nv && dd < hd) ? qv[dd] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -__int_as_float(0x7f800000), s = 0.0f;
    for (int key = warp; key < n_win + n_comp; key += DS4_ATT_WARPS) {
        const float* kp;
        if (key < n_win) {
            const ds4_size pos = lo + key;
            kp = pos < pos0 ? ring + (pos % window) * hd : kv + (pos - pos0) * hd;
        } else if (comp_mode == 1) {
            kp = crows + (ds4_size)(key - n_win) * hd;
        } else {
            const int r = idx[(ds4_size)t * k_sel + (key - n_win)];
            if (r < 0) continue;
            if ((ds4_size)r >= n_vis || (ds4_size)r >= n_crows) {
                if (lane == 0) ds4_fault(fault, DS4_FAULT_ROW);
                continue;
            }
            kp = crows + (ds4_size)r * hd;
        }
        float d = 0.0f;
#pragma unroll
        for (int j = 0; j < DS4_ATT_MAXV; j++) {
            const int dd = lane + j * DS4_WARP;
            if (j < nv && dd < hd) d += qr[j] * kp[dd];
        }
        const float l = ds4_warp_sum(d) * scale;
        const float mn = fmaxf(m, l);
        const float corr = expf(m - mn), e = expf(l - mn);
        s = s * corr + e;
#pragma unroll
        for (int j = 0; j < DS4_ATT_MAXV; j++) {
            const int dd = lane + j * DS4_WARP;
            acc[j] = acc[j] * corr + ((j < nv && dd < hd) ? e * kp[dd] : 0.0f);
        }
        m = mn;
    }
    if (lane == 0) {
        m_sh[warp] = m;
        s_sh[warp] = s;
    }
#pragma unroll
    for (int j = 0; j < DS4_ATT_MAXV; j++) {
        const int dd = lane + j * DS4_WARP;
        if (j < nv && dd < hd) o_sh[warp][dd] = acc[j];
    }
    __syncthreads();
    const float sink = sinks[h];
    float mm = sink;
    for (int w = 0; w < DS4_ATT_WARPS; w++) mm = fmaxf(mm, m_sh[w]);
    float denom = expf(sink - mm);
    float f[DS4_ATT_WARPS];
    for (int w = 0; w < DS4_ATT_WARPS; w++) {
        f[w] = s_sh[w] > 0.0f ? expf(m_sh[w] - mm) : 0.0f;
        denom += s_sh[w] * f[w];
    }
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < DS4_ATT_WARPS; w++) o += o_sh[w][dd] * f[w];
        out[(ds4_size)th * hd + dd] = o / denom;
    }
}

// Split-key sink attention for few tokens (decode): the keys of (token, head) are cut
// into ranges of `kps` keys, one block of 4 warps per (token·head, range), so the serial
// online-softmax chain per warp is kps/4 keys long instead of (n_win + n_comp)/4. Each
// block writes its partial (max m, sum s, unnormalised output acc[hd]) to `part`; the sink
// and the normalisation are applied by ds4_attention_combine in split order (fixed order:
// deterministic). Same key enumeration and fault rules as ds4_attention.
//
// The block's work is a device function so the batched form (ds4_attention_split_seqs: one
// launch for one token of each of several sequences) runs exactly the same code.
__device__ void ds4_att_split_block(const float* q, const float* kv, const float* ring,
                                    const float* crows, const int* idx, ds4_size pos0, int th,
                                    int n_head, int hd, int window, int comp_mode, int ratio,
                                    int k_sel, ds4_size n_crows, float scale, int kps, int split,
                                    float* pp, int* fault) {
    __shared__ float m_sh[DS4_ATT_WARPS], s_sh[DS4_ATT_WARPS];
    __shared__ float o_sh[DS4_ATT_WARPS][DS4_ATT_MAXV * DS4_WARP];
    const int t = th / n_head;
    const int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    const ds4_size p = pos0 + t;
    const ds4_size lo = p + 1 > (ds4_size)window ? p + 1 - window : 0;
    const int n_win = (int)(p - lo + 1);
    int n_comp = 0;
    if (comp_mode == 1) n_comp = (int)((p + 1) / ratio);
    if (comp_mode == 2) n_comp = k_sel;
    const ds4_size n_vis = comp_mode != 0 ? (p + 1) / ratio : 0;
    const int k0 = split * kps;
    const int k1 = min(k0 + kps, n_win + n_comp);
    const float* qv = q + (ds4_size)th * hd;
    const int nv = (hd + DS4_WARP - 1) / DS4_WARP;
    float qr[DS4_ATT_MAXV], acc[DS4_ATT_MAXV];
#pragma unroll
    for (int j = 0; j < DS4_ATT_MAXV; j++) {
        const int dd = lane + j * DS4_WARP;
        qr[j] = (j < nv && dd < hd) ? qv[dd] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -__int_as_float(0x7f800000), s = 0.0f;
    for (int key = k0 + warp; key < k1; key += DS4_ATT_WARPS) {
        const float* kp;
        if (key < n_win) {
            const ds4_size pos = lo + key;
            kp = pos < pos0 ? ring + (pos % window) * hd : kv + (pos - pos0) * hd;
        } else if (comp_mode == 1) {
            kp = crows + (ds4_size)(key - n_win) * hd;
        } else {
            const int r = idx[(ds4_size)t * k_sel + (key - n_win)];
            if (r < 0) continue;
            if ((ds4_size)r >= n_vis || (ds4_size)r >= n_crows) {
                if (lane == 0) ds4_fault(fault, DS4_FAULT_ROW);
                continue;
            }
            kp = crows + (ds4_size)r * hd;
        }
        float kr[DS4_ATT_MAXV];
        float d = 0.0f;
#pragma unroll
        for (int j = 0; j < DS4_ATT_MAXV; j++) {
            const int dd = lane + j * DS4_WARP;
            kr[j] = (j < nv && dd < hd) ? kp[dd] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < DS4_ATT_MAXV; j++) d += qr[j] * kr[j];
        const float l = ds4_warp_sum(d) * scale;
        const float mn = fmaxf(m, l);
        const float corr = expf(m - mn), e = expf(l - mn);
        s = s * corr + e;
#pragma unroll
        for (int j = 0; j < DS4_ATT_MAXV; j++) acc[j] = acc[j] * corr + e * kr[j];
        m = mn;
    }
    if (lane == 0) {
        m_sh[warp] = m;
        s_sh[warp] = s;
    }
#pragma unroll
    for (int j = 0; j < DS4_ATT_MAXV; j++) {
        const int dd = lane + j * DS4_WARP;
        if (j < nv && dd < hd) o_sh[warp][dd] = acc[j];
    }
    __syncthreads();
    float mm = -__int_as_float(0x7f800000);
    for (int w = 0; w < DS4_ATT_WARPS; w++) mm = fmaxf(mm, m_sh[w]);
    float f[DS4_ATT_WARPS];
    float st = 0.0f;
    for (int w = 0; w < DS4_ATT_WARPS; w++) {
        f[w] = s_sh[w] > 0.0f ? expf(m_sh[w] - mm) : 0.0f;
        st += s_sh[w] * f[w];
    }
    if (threadIdx.x == 0) {
        pp[0] = mm;
        pp[1] = st;
    }
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < DS4_ATT_WARPS; w++) o += o_sh[w][dd] * f[w];
        pp[2 + dd] = o;
    }
}

extern "C" __global__ void __launch_bounds__(128)
ds4_attention_split(const float* q, const float* kv, const float* ring, const float* crows,
                    const int* idx, ds4_size pos0, int n_head, int hd, int window,
                    int comp_mode, int ratio, int k_sel, ds4_size n_crows, float scale,
                    int kps, float* part, int* fault) {
    ds4_grid_wait();
    const int th = blockIdx.x, split = blockIdx.y;
    float* pp = part + ((ds4_size)th * gridDim.y + split) * (ds4_size)(hd + 2);
    ds4_att_split_block(q, kv, ring, crows, idx, pos0, th, n_head, hd, window, comp_mode, ratio,
                        k_sel, n_crows, scale, kps, split, pp, fault);
}

// Combines ds4_attention_split's partials of one (token, head) with the sink, in split
// order, and writes the normalised output. The per-split weights exp(m_i - max) are
// computed once into shared memory (n_splits <= DS4_ATT_MAX_SPLITS, checked by the host),
// then every thread sums its output dims over the splits in index order.
#define DS4_ATT_MAX_SPLITS 1024
__device__ void ds4_att_combine_block(const float* pp, float sink, int hd, int n_splits,
                                      float* out) {
    __shared__ float wsh[DS4_ATT_MAX_SPLITS];
    __shared__ float msh[DS4_ATT_MAX_SPLITS], ssh[DS4_ATT_MAX_SPLITS];
    __shared__ float s_mm, s_inv;
    const ds4_size stride = (ds4_size)(hd + 2);
    // Every split's (m, s) in one parallel round trip; the serial max and denominator then
    // walk shared memory in split order (thread 0 used to chain 2 x n_splits global loads:
    // 15.6 µs per CSA layer at 20 splits, ncu on the H200).
    // Partials through ds4_ld_act (coherent at L2): in ds4_attention_split_combine other
    // blocks wrote them during this kernel.
    for (int i = threadIdx.x; i < n_splits; i += blockDim.x) {
        msh[i] = ds4_ld_act(pp + i * stride);
        ssh[i] = ds4_ld_act(pp + i * stride + 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = sink;
        for (int i = 0; i < n_splits; i++) {
            if (ssh[i] > 0.0f) mm = fmaxf(mm, msh[i]);
        }
        s_mm = mm;
    }
    __syncthreads();
    const float mm = s_mm;
    for (int i = threadIdx.x; i < n_splits; i += blockDim.x)
        wsh[i] = ssh[i] > 0.0f ? expf(msh[i] - mm) : 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        float denom = expf(sink - mm);
        for (int i = 0; i < n_splits; i++) denom += ssh[i] * wsh[i];
        s_inv = denom;
    }
    __syncthreads();
    const float denom = s_inv;
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        // Four splits' loads in flight at a time, added in split order (same sums).
        float o = 0.0f;
        int i = 0;
        for (; i + 4 <= n_splits; i += 4) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = ds4_ld_act(pp + (i + u) * stride + 2 + dd);
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (wsh[i + u] != 0.0f) o += v[u] * wsh[i + u];
        }
        for (; i < n_splits; i++) {
            if (wsh[i] != 0.0f) o += ds4_ld_act(pp + i * stride + 2 + dd) * wsh[i];
        }
        out[dd] = o / denom;
    }
}

extern "C" __global__ void __launch_bounds__(256)
ds4_attention_combine(const float* part, const float* sinks, int n_head, int hd, int n_splits,
                      float* out) {
    ds4_grid_wait();
    const int th = blockIdx.x;
    ds4_att_combine_block(part + (ds4_size)th * n_splits * (ds4_size)(hd + 2),
                          sinks[th % n_head], hd, n_splits, out + (ds4_size)th * hd);
}

// ds4_attention_split and ds4_attention_combine in one launch (docs/gpu.md §17): every split
// block writes its partial, fences, and counts itself in counters[th]; the block that
// completes the count for its (token, head) resets the counter for the next launch and
// runs the combine over all the partials (the same code and order as the separate
// launch, so the same values whichever block comes last). counters: one zeroed int per
// (token, head), left zeroed.
extern "C" __global__ void __launch_bounds__(128)
ds4_attention_split_combine(const float* q, const float* kv, const float* ring,
                            const float* crows, const int* idx, ds4_size pos0, int n_head,
                            int hd, int window, int comp_mode, int ratio, int k_sel,
                            ds4_size n_crows, float scale, int kps, float* part, int* fault,
                            const float* sinks, float* out, int* counters) {
    ds4_grid_wait();
    __shared__ int s_last;
    const int th = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    float* p0 = part + (ds4_size)th * n_splits * (ds4_size)(hd + 2);
    ds4_att_split_block(q, kv, ring, crows, idx, pos0, th, n_head, hd, window, comp_mode, ratio,
                        k_sel, n_crows, scale, kps, split, p0 + (ds4_size)split * (hd + 2),
                        fault);
    ds4_fence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(counters + th, 1);
        s_last = done == n_splits - 1;
        if (s_last) counters[th] = 0;
    }
    __syncthreads();
    if (!s_last) return;
    ds4_fence();
    ds4_att_combine_block(p0, sinks[th % n_head], hd, n_splits, out + (ds4_size)th * hd);
}

// One token of each of up to DS4_ATT_SEQS sequences (a batched decode step) in one launch
// of each attention kernel: row s of q / kv / out is sequence s, and what differs per
// sequence (its cache rows, position, indexer selection, key splits) comes by value in
// `ds4_att_seqs`. Block x = s * n_head + head; blocks beyond a sequence's own number of
// splits return at once, so every (sequence, head) runs the splits and the combine it runs
// when decoded alone, with the same code (same results bit for bit). Partials of block x
// sit at part + (x * max_splits + split) * (hd + 2).
#define DS4_ATT_SEQS DS4_SEQS
struct ds4_att_seqs {
    const float* ring[DS4_ATT_SEQS];
    const float* crows[DS4_ATT_SEQS];
    const int* idx[DS4_ATT_SEQS];
    ds4_size pos0[DS4_ATT_SEQS];
    ds4_size n_crows[DS4_ATT_SEQS];
    int kps[DS4_ATT_SEQS];
    int splits[DS4_ATT_SEQS];
};

extern "C" __global__ void __launch_bounds__(128)
ds4_attention_split_seqs(const float* q, const float* kv, ds4_att_seqs sq, int n_head, int hd,
                         int window, int comp_mode, int ratio, int k_sel, float scale,
                         int max_splits, float* part, int* fault) {
    ds4_grid_wait();
    const int s = blockIdx.x / n_head, split = blockIdx.y;
    if (split >= sq.splits[s]) return;
    const int th = blockIdx.x % n_head;
    float* pp = part + ((ds4_size)blockIdx.x * max_splits + split) * (ds4_size)(hd + 2);
    ds4_att_split_block(q + (ds4_size)s * n_head * hd, kv + (ds4_size)s * hd, sq.ring[s],
                        sq.crows[s], sq.idx[s], sq.pos0[s], th, n_head, hd, window, comp_mode,
                        ratio, k_sel, sq.n_crows[s], scale, sq.kps[s], split, pp, fault);
}

extern "C" __global__ void __launch_bounds__(256)
ds4_attention_combine_seqs(const float* part, const float* sinks, ds4_att_seqs sq, int n_head,
                           int hd, int max_splits, float* out) {
    ds4_grid_wait();
    const int s = blockIdx.x / n_head;
    ds4_att_combine_block(part + (ds4_size)blockIdx.x * max_splits * (ds4_size)(hd + 2),
                          sinks[blockIdx.x % n_head], hd, sq.splits[s],
                          out + (ds4_size)blockIdx.x * hd);
}

// Ring store: rows of the chunk's last min(n_tok, window) tokens into slot p % window.
extern "C" __global__ void ds4_ring_store(float* ring, const float* kv, ds4_size pos0, int n_tok,
                                          int window, int d) {
    ds4_grid_wait();
    const int first = n_tok > window ? n_tok - window : 0;
    const ds4_size n = (ds4_size)(n_tok - first) * d;
    DS4_GRID_STRIDE(e, n) {
        const int ti = first + (int)(e / d);
        const int i = (int)(e % d);
        ring[((pos0 + ti) % window) * d + i] = kv[(ds4_size)ti * d + i];
    }
}

// The ring stores of one token of each of up to DS4_SEQS sequences (row s of kv into
// sequence s's ring at its position): the same copies as alone, one launch.
struct ds4_ring_seqs {
    float* ring[DS4_SEQS];
    ds4_size pos0[DS4_SEQS];
};
extern "C" __global__ void ds4_ring_store_seqs(const float* kv, ds4_ring_seqs sq, int window,
                                               int d) {
    ds4_grid_wait();
    const int s = blockIdx.y;
    float* dst = sq.ring[s] + (sq.pos0[s] % window) * (ds4_size)d;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        dst[i] = kv[(ds4_size)s * d + i];
}

// ---------------------------------------------------------------------------------------
// Router (docs/forward.md §6, steps 1-3): one block (256 threads) per token.
// mode 0: top-k of sqrtsoftplus(l) + bias (bias may be null); mode 1: hash table row.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
ds4_router(const float* logits, int n_expert, int k, float rscale, int mode, const float* bias,
           const ds4_u8* table, int table_rows, const int* tokens, int* ids, float* weights,
           int* fault) {
    ds4_grid_wait();
    __shared__ float sel_s[1024];
    __shared__ ds4_u32 bv[256];
    __shared__ int bi[256];
    __shared__ int taken[1024];
    __shared__ int chosen[64];
    const int t = blockIdx.x;
    const float* l = logits + (ds4_size)t * n_expert;
    if (mode == 0) {
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            sel_s[e] = ds4_sqrtsoftplus(l[e]) + (bias ? bias[e] : 0.0f);
            taken[e] = 0;
        }
        __syncthreads();
        // k rounds of arg-max in f32::total_cmp order, lower index first on ties (the CPU
        // reference sorts by exactly that order).
        for (int r = 0; r < k; r++) {
            ds4_u32 best = 0;
            int besti = -1;
            for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
                const ds4_u32 v = ds4_key(sel_s[e]);
                if (!taken[e] && (besti < 0 || v > best)) {
                    best = v;
                    besti = e;
                }
            }
            bv[threadIdx.x] = best;
            bi[threadIdx.x] = besti;
            __syncthreads();
            for (int s = blockDim.x / 2; s > 0; s >>= 1) {
                if (threadIdx.x < s) {
                    const ds4_u32 ov = bv[threadIdx.x + s];
                    const int oi = bi[threadIdx.x + s];
                    const ds4_u32 mv = bv[threadIdx.x];
                    const int mi = bi[threadIdx.x];
                    if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
                        bv[threadIdx.x] = ov;
                        bi[threadIdx.x] = oi;
                    }
                }
                __syncthreads();
            }
            if (threadIdx.x == 0) {
                chosen[r] = bi[0];
                taken[bi[0]] = 1;
            }
            __syncthreads();
        }
    } else if (threadIdx.x == 0) {
        const int tok = tokens[t];
        for (int r = 0; r < k; r++) {
            int e = -1;
            if (tok >= 0 && tok < table_rows) e = (int)ds4_b32(table + ((ds4_size)tok * k + r) * 4);
            else ds4_fault(fault, DS4_FAULT_TOKEN);
            if (e < 0 || e >= n_expert) {
                ds4_fault(fault, DS4_FAULT_EXPERT);
                e = 0;
            }
            chosen[r] = e;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float pi[64];
        float sum = 0.0f;
        for (int r = 0; r < k; r++) {
            pi[r] = ds4_sqrtsoftplus(l[chosen[r]]);
            sum += pi[r];
        }
        for (int r = 0; r < k; r++) {
            weights[(ds4_size)t * k + r] = sum > 0.0f ? pi[r] / sum * rscale : 0.0f;
            ids[(ds4_size)t * k + r] = chosen[r];
        }
    }
}

// The router with one warp per token (8 tokens per block of 256), for n_expert <= 256 and
// k <= 32: each lane holds 8 experts' keys in registers and each of the k rounds is a
// shuffle arg-max (the order above: larger key, then lower index; a total order, so every
// lane ends with the same winner). The block version's k rounds of 8-step shared-memory
// tree reductions, with thread 0 finishing alone, took 6.7-9.6 µs per decode token (ncu on
// the H200). Lane r keeps round r's expert; the weights' sum runs over r in order on every
// lane, as the CPU (and the block version) add them. The warp's work is ds4_router_token
// (ds4_quant.h), which the fused router GEMV also runs.
extern "C" __global__ void __launch_bounds__(256)
ds4_router_warp(const float* logits, int n_tok, int n_expert, int k, float rscale, int mode,
                const float* bias, const ds4_u8* table, int table_rows, const int* tokens,
                int* ids, float* weights, int* fault) {
    ds4_grid_wait();
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int t = blockIdx.x * (256 / DS4_WARP) + threadIdx.x / DS4_WARP;
    if (t >= n_tok) return;  // warp-uniform
    ds4_router_token(logits + (ds4_size)t * n_expert, t, n_expert, k, rscale, mode, bias, table,
                     table_rows, tokens, ids, weights, fault, lane);
}

// ---------------------------------------------------------------------------------------
// MoE helpers.
// ---------------------------------------------------------------------------------------

// xs[j] = x[src[j]] for j < n (rows of d).
extern "C" __global__ void ds4_gather_rows(const float* x, const int* src, int n, int d, float* xs) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * d;
    DS4_GRID_STRIDE(e, total) {
        const ds4_size j = e / d;
        xs[e] = x[(ds4_size)src[j] * d + (e % d)];
    }
}

// xs[j] = x[j / k] for rows of d: each token's input repeated for its k selections (the
// grouped experts' per-selection inputs at batched decode, with no index list to upload).
extern "C" __global__ void ds4_repeat_rows(const float* x, int k, int n, int d, float* xs) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * d;
    DS4_GRID_STRIDE(e, total) {
        const ds4_size j = e / d;
        xs[e] = x[(j / k) * d + (e % d)];
    }
}

// h[j] = weights[slot[j]] * swiglu(g[j], u[j]) over rows of f.
// With ids non-null, also the range check of the n selections' expert ids (the fault bit;
// the grouped GEMVs before it already wrote NaN rows for a bad id): one launch fewer per
// MoE layer than a separate check.
extern "C" __global__ void ds4_moe_act(const float* g, const float* u, const float* weights,
                                       const int* slot, int n, int f, float clamp, float* h,
                                       const int* ids, int n_expert, int* fault) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * f;
    DS4_GRID_STRIDE(e, total) {
        const ds4_size j = e / f;
        if (ids && e % f == 0 && (ids[j] < 0 || ids[j] >= n_expert)) ds4_fault(fault, DS4_FAULT_EXPERT);
        const float w = slot ? weights[slot[j]] : weights[j];
        h[e] = w * ds4_swiglu1(g[e], u[e], clamp);
    }
}

// per_slot[slot[j]] = o[j] (rows of d).
extern "C" __global__ void ds4_scatter_rows(const float* o, const int* slot, int n, int d,
                                            float* per_slot) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * d;
    DS4_GRID_STRIDE(e, total) {
        const ds4_size j = e / d;
        per_slot[(ds4_size)slot[j] * d + (e % d)] = o[e];
    }
}

// out[t] = sum over slots s < k of per_slot[t*k + s], in slot order.
extern "C" __global__ void ds4_sum_slots(const float* per_slot, int n_tok, int k, int d, float* out) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n_tok * d;
    DS4_GRID_STRIDE(e, total) {
        const ds4_size t = e / d;
        const int i = (int)(e % d);
        float acc = 0.0f;
        for (int s = 0; s < k; s++) acc += per_slot[(t * k + s) * d + i];
        out[e] = acc;
    }
}

// ---------------------------------------------------------------------------------------
// Greedy decoding: the index of the largest of n values, the lowest index on ties, NaN
// never chosen unless x[0] is NaN (then 0) — the CPU's sequential `best = i if x[i] >
// x[best]` scan exactly. One block; a fixed tree order (deterministic).
// ---------------------------------------------------------------------------------------
#define DS4_ARGMAX_THREADS 1024
__device__ __forceinline__ bool ds4_argmax_better(float v, int i, float bv, int bi) {
    if (v != v) return false;          // NaN never wins
    if (bv != bv) return true;         // anything beats NaN / the empty start
    return v > bv || (v == bv && i < bi);
}

extern "C" __global__ void __launch_bounds__(DS4_ARGMAX_THREADS)
ds4_argmax(const float* x, int n, int* out) {
    ds4_grid_wait();
    __shared__ float sv[DS4_ARGMAX_THREADS];
    __shared__ int si[DS4_ARGMAX_THREADS];
    const int t = threadIdx.x;
    float bv = __int_as_float(0x7fc00000);  // NaN: "nothing yet"
    int bi = 0x7fffffff;
    for (int i = t; i < n; i += DS4_ARGMAX_THREADS) {
        const float v = x[i];
        if (ds4_argmax_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    sv[t] = bv;
    si[t] = bi;
    __syncthreads();
    for (int s = DS4_ARGMAX_THREADS / 2; s > 0; s >>= 1) {
        if (t < s && ds4_argmax_better(sv[t + s], si[t + s], sv[t], si[t])) {
            sv[t] = sv[t + s];
            si[t] = si[t + s];
        }
        __syncthreads();
    }
    if (t == 0) {
        const float x0 = x[0];
        out[0] = (x0 != x0 || si[0] == 0x7fffffff) ? 0 : si[0];
    }
}

// ---- Sampling band (docs/server.md §6) ----
//
// The values of a logits row within `span` of its maximum, for a min-p sampler that needs no
// more: out = [max bits, threshold bits, count, first NaN or -1, first +inf or -1, 0, 0, 0]
// then up to `cap` (index, value bits) pairs in index order (ds4_engine::sampler::band_words
// is the definition). Index `exclude` (-1: none) counts as -inf. One block: a strided pass for
// the maximum and the first NaN / +inf (max and min are exact in any order), then every
// warp takes a contiguous run of the row and the runs' counts place its items, so the order
// is the index order.
#define DS4_BAND_THREADS 1024
static_assert(DS4_BAND_THREADS == DS4_WARP * DS4_WARP, "the scan's second level is one warp");
__device__ __forceinline__ void ds4_logit_band_block(const float* x, int n, float span,
                                                     int exclude, int cap, int* out) {
    __shared__ int sh[DS4_BAND_THREADS];
    __shared__ float smax[DS4_BAND_THREADS];
    __shared__ int snan[DS4_BAND_THREADS], sinf[DS4_BAND_THREADS];
    const int tid = threadIdx.x;
    const float inf = __int_as_float(0x7f800000);
    float m = -inf;
    int fn = 0x7fffffff, fi = 0x7fffffff;
    for (int i = tid; i < n; i += DS4_BAND_THREADS) {
        if (i == exclude) continue;
        const float v = x[i];
        if (v != v) {
            fn = min(fn, i);
        } else {
            m = v > m ? v : m;
            if (v == inf) fi = min(fi, i);
        }
    }
    smax[tid] = m;
    snan[tid] = fn;
    sinf[tid] = fi;
    __syncthreads();
    for (int s = DS4_BAND_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            smax[tid] = smax[tid + s] > smax[tid] ? smax[tid + s] : smax[tid];
            snan[tid] = min(snan[tid], snan[tid + s]);
            sinf[tid] = min(sinf[tid], sinf[tid + s]);
        }
        __syncthreads();
    }
    const float mx = smax[0] == 0.0f ? 0.0f : smax[0];  // a zero maximum is +0 (either zero may win)
    const float thr = mx - span;
    // Warp w takes a contiguous run of whole 32-value chunks (runs in index order); its lanes
    // read consecutive values (one thread per contiguous segment made every load touch 32
    // lines: 114 µs a row on an H100, docs/gpu.md §31). Counts first, then each warp's
    // items from its run's offset, placed in a chunk by an inclusive scan of the lanes' hits.
    const int warp = tid / DS4_WARP, lane = tid & (DS4_WARP - 1);
    constexpr int NW = DS4_BAND_THREADS / DS4_WARP;
    const int per = ((n + DS4_WARP - 1) / DS4_WARP + NW - 1) / NW * DS4_WARP;
    const int a = min(warp * per, n), b = min(a + per, n);
    int c = 0;
    for (int i = a + lane; i < b; i += DS4_WARP) c += (i != exclude && x[i] >= thr) ? 1 : 0;
#pragma unroll
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) c += ds4_shfl_xor_i(c, m);
    if (lane == 0) sh[warp] = c;
    __syncthreads();
    int base = 0, count = 0;
    for (int k = 0; k < NW; k++) {
        base += k < warp ? sh[k] : 0;
        count += sh[k];
    }
    int w = base;  // warp-uniform
    for (int i0 = a; i0 < b && w < cap; i0 += DS4_WARP) {
        const int i = i0 + lane;
        const float v = i < b ? x[i] : 0.0f;
        const bool hit = i < b && i != exclude && v >= thr;
        int incl = hit ? 1 : 0;
#pragma unroll
        for (int d = 1; d < DS4_WARP; d <<= 1) {
            const int u = ds4_shfl_up_i(incl, d);
            if (lane >= d) incl += u;
        }
        const int at = w + incl - 1;
        if (hit && at < cap) {
            out[8 + 2 * at] = i;
            out[9 + 2 * at] = __float_as_int(v);
        }
        w += __float_as_int(ds4_shfl_idx(__int_as_float(incl), DS4_WARP - 1));
    }
    // The unused item slots are zeros, as the definition writes them.
    for (int j = min(count, cap) * 2 + tid; j < 2 * cap; j += DS4_BAND_THREADS) out[8 + j] = 0;
    if (tid == 0) {
        out[0] = __float_as_int(mx);
        out[1] = __float_as_int(thr);
        out[2] = count;
        out[3] = snan[0] == 0x7fffffff ? -1 : snan[0];
        out[4] = sinf[0] == 0x7fffffff ? -1 : sinf[0];
        out[5] = out[6] = out[7] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(DS4_BAND_THREADS)
ds4_logit_band(const float* x, int n, float span, int exclude, int cap, int* out) {
    ds4_grid_wait();
    ds4_logit_band_block(x, n, span, exclude, cap, out);
}

// The bands of several rows of a batched decode step in one launch (docs/gpu.md §31): block
// b is the one-row kernel on row jobs.row[b] of x (rows n values apart), nothing excluded. One
// row alone keeps one multiprocessor busy for ~110 µs on an H100, so eight of them one after
// another cost ~0.9 ms of an 8-sequence step; side by side they take one row's time.
#define DS4_BANDS_MAX 16
struct Ds4BandJobs {
    int* out[DS4_BANDS_MAX];
    int row[DS4_BANDS_MAX];
    float span[DS4_BANDS_MAX];
    int cap[DS4_BANDS_MAX];
    int n_jobs;
    int pad;
};
static_assert(sizeof(Ds4BandJobs) == 8 * (DS4_BANDS_MAX + 3 * DS4_BANDS_MAX / 2 + 1),
              "the host's words: the pointers, then rows, spans and caps two per word, the count");
extern "C" __global__ void __launch_bounds__(DS4_BAND_THREADS)
ds4_logit_bands(const float* x, int n, Ds4BandJobs jobs) {
    ds4_grid_wait();
    const int b = blockIdx.x;
    if (b >= jobs.n_jobs || b >= DS4_BANDS_MAX) return;
    ds4_logit_band_block(x + (ds4_size)jobs.row[b] * n, n, jobs.span[b], -1, jobs.cap[b],
                         jobs.out[b]);
}

// ---- Prefill attention on the tensor cores (docs/gpu.md §14) ----
//
// The single-query kernels above give every (token, head) its own block, so the 64 heads of
// a token each read the token's keys (up to 640 rows of 2 KB) from L2: at 2048 tokens a CSA
// layer reads ~170 GB. Attention is multi-query (one key/value row serves every head), so
// here one block takes one token and 64 heads: the token's keys are read once into shared
// memory as halves, S = Q·Kᵀ (64 heads × 32 keys per tile) and O += P·V run as half-
// precision mma with f32 accumulation, with the online softmax between them and the sink
// applied at the end. Same key enumeration, fault rule and sink algebra as ds4_attention;
// the numeric class of the prefill tiles (half operands), so only the fast precision uses
// it. Head dim 512 and heads in groups of 64 (DeepSeek V4 Flash); 16 warps: for S warp w
// computes the 16 × 8 piece (heads 16 (w / 4), keys 8 (w % 4)); for O it owns the 64 heads
// × 32 dims from 32 w.
#define DS4_AMMA_HD 512
#define DS4_AMMA_HEADS 64
#define DS4_AMMA_KT 32
#define DS4_AMMA_WARPS 16
#define DS4_AMMA_QLD (DS4_AMMA_HD + 8)  // halves per Q / K row (+16 bytes: no bank conflicts)
#define DS4_AMMA_VLD (DS4_AMMA_KT + 8)  // halves per Vᵀ / P row
#define DS4_AMMA_SLD (DS4_AMMA_KT + 1)  // floats per S row
#define DS4_AMMA_HALVES                                                                    \
    (DS4_AMMA_HEADS * DS4_AMMA_QLD + DS4_AMMA_KT * DS4_AMMA_QLD + DS4_AMMA_HD * DS4_AMMA_VLD + \
     DS4_AMMA_HEADS * DS4_AMMA_VLD)
#define DS4_AMMA_SMEM (2 * DS4_AMMA_HALVES + 4 * (DS4_AMMA_HEADS * DS4_AMMA_SLD + 3 * DS4_AMMA_HEADS + DS4_AMMA_KT))

// Key j of token t (position p) in ds4_attention's order: window rows, then compressed rows
// (all visible ones, or the token's top-k selection). Null for a skipped selection entry
// (negative, or out of range: then the fault bit is set by `report`).
__device__ __forceinline__ const float* ds4_amma_key(const float* kv, const float* ring,
                                                    const float* crows, const int* idx,
                                                    ds4_size pos0, ds4_size lo, int n_win,
                                                    int t, int j, int window, int comp_mode,
                                                    int k_sel, ds4_size n_vis, ds4_size n_crows,
                                                    bool report, int* fault) {
    if (j < n_win) {
        const ds4_size pos = lo + j;
        return pos < pos0 ? ring + (pos % window) * DS4_AMMA_HD : kv + (pos - pos0) * DS4_AMMA_HD;
    }
    if (comp_mode == 1) return crows + (ds4_size)(j - n_win) * DS4_AMMA_HD;
    const int r = idx[(ds4_size)t * k_sel + (j - n_win)];
    if (r < 0) return nullptr;
    if ((ds4_size)r >= n_vis || (ds4_size)r >= n_crows) {
        if (report) ds4_fault(fault, DS4_FAULT_ROW);
        return nullptr;
    }
    return crows + (ds4_size)r * DS4_AMMA_HD;
}

// One block's work: token t of the chunk (its keys, position and selection), heads
// h0..h0+63, reading q and writing out / part at row `row` (= t, except in the batched
// decode kernel, where row s is sequence s and t is 0 of that sequence's one-token chunk).
// Without `part`, all the token's keys and the normalised output with the sink; with it,
// keys split*kps .. (split+1)*kps only and the unnormalised partial (max m, sum l, O) at
// part + ((row·n_head + h)·n_splits + split)·(hd+2), the layout ds4_attention_combine reads
// (which applies the sink).
__device__ void ds4_amma_block(const float* q, const float* kv, const float* ring,
                               const float* crows, const int* idx, const float* sinks,
                               ds4_size pos0, int n_head, int window, int comp_mode, int ratio,
                               int k_sel, ds4_size n_crows, float scale, float* out, float* part,
                               int n_splits, int split, int kps, int t, int row, int h0,
                               int* fault) {
    DS4_DYN_SHARED(smem, DS4_AMMA_SMEM);
    ds4_u16* qs = (ds4_u16*)smem;
    ds4_u16* ks = qs + DS4_AMMA_HEADS * DS4_AMMA_QLD;
    ds4_u16* vt = ks + DS4_AMMA_KT * DS4_AMMA_QLD;
    ds4_u16* ps = vt + DS4_AMMA_HD * DS4_AMMA_VLD;
    float* ss = (float*)(ps + DS4_AMMA_HEADS * DS4_AMMA_VLD);
    float* row_m = ss + DS4_AMMA_HEADS * DS4_AMMA_SLD;
    float* row_l = row_m + DS4_AMMA_HEADS;
    float* row_c = row_l + DS4_AMMA_HEADS;
    int* kval = (int*)(row_c + DS4_AMMA_HEADS);

    const int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    const int g = lane >> 2, t4 = lane & 3;
    const float ninf = -__int_as_float(0x7f800000);
    const ds4_size p = pos0 + t;
    const ds4_size lo = p + 1 > (ds4_size)window ? p + 1 - window : 0;
    const int n_win = (int)(p - lo + 1);
    int n_comp = 0;
    if (comp_mode == 1) n_comp = (int)((p + 1) / ratio);
    if (comp_mode == 2) n_comp = k_sel;
    const ds4_size n_vis = comp_mode != 0 ? (p + 1) / ratio : 0;
    const int n_all = n_win + n_comp;
    const int k_first = part ? split * kps : 0;
    const int n_keys = part ? min(n_all, k_first + kps) : n_all;

    // This block's 64 query rows as halves.
    const float* qb = q + ((ds4_size)row * n_head + h0) * DS4_AMMA_HD;
    for (int i = tid; i < DS4_AMMA_HEADS * DS4_AMMA_HD / 4; i += DS4_AMMA_WARPS * DS4_WARP) {
        const float4 v = ((const float4*)qb)[i];
        const int r = (i * 4) / DS4_AMMA_HD, c = (i * 4) % DS4_AMMA_HD;
        ds4_u32* dst = (ds4_u32*)(qs + r * DS4_AMMA_QLD + c);
        dst[0] = ds4_f2h2(v.x, v.y);
        dst[1] = ds4_f2h2(v.z, v.w);
    }
    if (tid < DS4_AMMA_HEADS) {
        row_m[tid] = ninf;
        row_l[tid] = 0.0f;
    }
    float acc[4][4][4];
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int nj = 0; nj < 4; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mi][nj][e] = 0.0f;

    for (int k0 = k_first; k0 < n_keys; k0 += DS4_AMMA_KT) {
        __syncthreads();  // the previous tile's readers are done (and Q is in place)
        {
            // Warp w converts dims 32 w.. of all 32 keys (lane = key): K rows as halves and
            // the transpose (Vᵀ), whose stores then fall on consecutive halves of one row.
            const int key = lane, seg = warp;
            const int j = k0 + key;
            const float* kp = j < n_keys
                                  ? ds4_amma_key(kv, ring, crows, idx, pos0, lo, n_win, t, j,
                                                 window, comp_mode, k_sel, n_vis, n_crows,
                                                 seg == 0 && h0 == 0, fault)
                                  : nullptr;
            ds4_u32* krow = (ds4_u32*)(ks + key * DS4_AMMA_QLD + seg * 32);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (kp) v = ((const float4*)(kp + seg * 32))[i];
                const ds4_u32 lo2 = ds4_f2h2(v.x, v.y), hi2 = ds4_f2h2(v.z, v.w);
                krow[2 * i] = lo2;
                krow[2 * i + 1] = hi2;
                const int d = seg * 32 + 4 * i;
                vt[(d + 0) * DS4_AMMA_VLD + key] = (ds4_u16)(lo2 & 0xffff);
                vt[(d + 1) * DS4_AMMA_VLD + key] = (ds4_u16)(lo2 >> 16);
                vt[(d + 2) * DS4_AMMA_VLD + key] = (ds4_u16)(hi2 & 0xffff);
                vt[(d + 3) * DS4_AMMA_VLD + key] = (ds4_u16)(hi2 >> 16);
            }
            if (seg == 0) kval[key] = kp != nullptr;
        }
        __syncthreads();
        {
            // S piece of this warp: heads 16 mi.., keys 8 ni.. of the tile.
            const int mi = warp >> 2, ni = warp & 3;
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(DS4_HAS_MMA)
            // Two accumulation chains (even and odd k steps): each mma waits for the one
            // before it on the same accumulator, so one chain of 32 would be latency-bound.
            float c2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const int piece = lane >> 3;
            const int ar = 16 * mi + (lane & 7) + (piece & 1) * 8, ac = (piece >> 1) * 8;
            const ds4_u16* brow = ks + (8 * ni + g) * DS4_AMMA_QLD + 2 * t4;
#pragma unroll 4
            for (int kk = 0; kk < DS4_AMMA_HD; kk += 32) {
                ds4_u32 a[4], b[2], a2[4], b2[2];
                ds4_ldmatrix_x4(a, qs + ar * DS4_AMMA_QLD + kk + ac);
                ds4_ldmatrix_x4(a2, qs + ar * DS4_AMMA_QLD + kk + 16 + ac);
                b[0] = *(const ds4_u32*)(brow + kk);
                b[1] = *(const ds4_u32*)(brow + kk + 8);
                b2[0] = *(const ds4_u32*)(brow + kk + 16);
                b2[1] = *(const ds4_u32*)(brow + kk + 24);
                ds4_mma_16816(c, a, b);
                ds4_mma_16816(c2, a2, b2);
            }
            for (int e = 0; e < 4; e++) c[e] += c2[e];
#else
            for (int e = 0; e < 4; e++) {
                const int r = 16 * mi + g + (e >> 1) * 8, col = 8 * ni + 2 * t4 + (e & 1);
                float sum = 0.0f;
                for (int d = 0; d < DS4_AMMA_HD; d++)
                    sum += ds4_h2f(qs[r * DS4_AMMA_QLD + d]) * ds4_h2f(ks[col * DS4_AMMA_QLD + d]);
                c[e] = sum;
            }
#endif
            for (int e = 0; e < 4; e++) {
                const int r = 16 * mi + g + (e >> 1) * 8, col = 8 * ni + 2 * t4 + (e & 1);
                ss[r * DS4_AMMA_SLD + col] = c[e] * scale;
            }
        }
        __syncthreads();
        {
            // Online softmax: 8 threads per head row, 4 keys each; P rounded to halves
            // before it is summed, so numerator and denominator use the same values.
            const int row = tid >> 3, part = tid & 7;
            float sv[4];
            bool ok[4];
            float mt = ninf;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = part * 4 + i;
                ok[i] = k0 + key < n_keys && kval[key] != 0;
                sv[i] = ok[i] ? ss[row * DS4_AMMA_SLD + key] : ninf;
                mt = fmaxf(mt, sv[i]);
            }
            mt = fmaxf(mt, ds4_shfl_xor(mt, 1));
            mt = fmaxf(mt, ds4_shfl_xor(mt, 2));
            mt = fmaxf(mt, ds4_shfl_xor(mt, 4));
            const float mo = row_m[row];
            const float mn = fmaxf(mo, mt);
            const bool any = mn != ninf;
            const float corr = any ? expf(mo - mn) : 1.0f;
            float sum = 0.0f;
            ds4_u16 ph[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                ph[i] = ds4_f2h(ok[i] && any ? expf(sv[i] - mn) : 0.0f);
                sum += ds4_h2f(ph[i]);
            }
            ds4_u32* prow = (ds4_u32*)(ps + row * DS4_AMMA_VLD + part * 4);
            prow[0] = (ds4_u32)ph[0] | ((ds4_u32)ph[1] << 16);
            prow[1] = (ds4_u32)ph[2] | ((ds4_u32)ph[3] << 16);
            sum += ds4_shfl_xor(sum, 1);
            sum += ds4_shfl_xor(sum, 2);
            sum += ds4_shfl_xor(sum, 4);
            if (part == 0) {
                row_m[row] = mn;
                row_l[row] = row_l[row] * corr + sum;
                row_c[row] = corr;
            }
        }
        __syncthreads();
        if (k0 + DS4_AMMA_KT < n_keys) {
            // The next tile's rows toward L1 while this one's O update runs: lane = key,
            // warp = its 128-byte piece, as the load above.
            const int j = k0 + DS4_AMMA_KT + lane;
            const float* kp = j < n_keys
                                  ? ds4_amma_key(kv, ring, crows, idx, pos0, lo, n_win, t, j,
                                                 window, comp_mode, k_sel, n_vis, n_crows, false,
                                                 fault)
                                  : nullptr;
            if (kp) ds4_prefetch_l1(kp + warp * 32);
        }
        {
            // O += P·V for this warp's 32 dims, after the rows' rescale.
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                const float c0 = row_c[16 * mi + g], c1 = row_c[16 * mi + g + 8];
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    acc[mi][nj][0] *= c0;
                    acc[mi][nj][1] *= c0;
                    acc[mi][nj][2] *= c1;
                    acc[mi][nj][3] *= c1;
                }
            }
#if defined(DS4_HAS_MMA)
            const int piece = lane >> 3;
#pragma unroll
            for (int kk = 0; kk < DS4_AMMA_KT; kk += 16) {
#pragma unroll
                for (int mi = 0; mi < 4; mi++) {
                    ds4_u32 a[4];
                    const int ar = 16 * mi + (lane & 7) + (piece & 1) * 8, ac = (piece >> 1) * 8;
                    ds4_ldmatrix_x4(a, ps + ar * DS4_AMMA_VLD + kk + ac);
#pragma unroll
                    for (int nj = 0; nj < 4; nj++) {
                        const ds4_u16* brow = vt + (32 * warp + 8 * nj + g) * DS4_AMMA_VLD + kk + 2 * t4;
                        ds4_u32 b[2];
                        b[0] = *(const ds4_u32*)brow;
                        b[1] = *(const ds4_u32*)(brow + 8);
                        ds4_mma_16816(acc[mi][nj], a, b);
                    }
                }
            }
#else
            for (int mi = 0; mi < 4; mi++)
                for (int nj = 0; nj < 4; nj++)
                    for (int e = 0; e < 4; e++) {
                        const int r = 16 * mi + g + (e >> 1) * 8;
                        const int d = 32 * warp + 8 * nj + 2 * t4 + (e & 1);
                        float sum = acc[mi][nj][e];
                        for (int key = 0; key < DS4_AMMA_KT; key++)
                            sum += ds4_h2f(ps[r * DS4_AMMA_VLD + key]) * ds4_h2f(vt[d * DS4_AMMA_VLD + key]);
                        acc[mi][nj][e] = sum;
                    }
#endif
        }
    }
    __syncthreads();
    if (part) {
        for (int r = tid; r < DS4_AMMA_HEADS; r += DS4_AMMA_WARPS * DS4_WARP) {
            float* pp = part + (((ds4_size)row * n_head + h0 + r) * n_splits + split) * (DS4_AMMA_HD + 2);
            pp[0] = row_m[r];
            pp[1] = row_l[r];
        }
#pragma unroll
        for (int mi = 0; mi < 4; mi++) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int r = 16 * mi + g + half * 8;
                float* pp = part + (((ds4_size)row * n_head + h0 + r) * n_splits + split) * (DS4_AMMA_HD + 2) +
                            2 + 32 * warp + 2 * t4;
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    pp[8 * nj] = acc[mi][nj][2 * half];
                    pp[8 * nj + 1] = acc[mi][nj][2 * half + 1];
                }
            }
        }
        return;
    }
    // The sink joins the denominator: out = O · f / (l · f + exp(sink − M)), M = max(m, sink).
#pragma unroll
    for (int mi = 0; mi < 4; mi++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = 16 * mi + g + half * 8;
            const float m = row_m[r], l = row_l[r], sink = sinks[h0 + r];
            const float mm = fmaxf(m, sink);
            const float f = l > 0.0f ? expf(m - mm) : 0.0f;
            const float w = f / (l * f + expf(sink - mm));
            float* orow = out + ((ds4_size)row * n_head + h0 + r) * DS4_AMMA_HD + 32 * warp + 2 * t4;
#pragma unroll
            for (int nj = 0; nj < 4; nj++) {
                orow[8 * nj] = acc[mi][nj][2 * half] * w;
                orow[8 * nj + 1] = acc[mi][nj][2 * half + 1] * w;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(DS4_AMMA_WARPS * DS4_WARP)
ds4_attention_mma(const float* q, const float* kv, const float* ring, const float* crows,
                  const int* idx, const float* sinks, ds4_size pos0, int n_head, int window,
                  int comp_mode, int ratio, int k_sel, ds4_size n_crows, float scale, float* out,
                  int* fault) {
    ds4_grid_wait();
    ds4_amma_block(q, kv, ring, crows, idx, sinks, pos0, n_head, window, comp_mode, ratio, k_sel,
                   n_crows, scale, out, nullptr, 1, 0, 0, blockIdx.x, blockIdx.x,
                   blockIdx.y * DS4_AMMA_HEADS, fault);
}

// Few tokens (decode): the keys of a token split over blocks too (grid: tokens × splits ×
// head groups), each writing ds4_attention_split's partial layout for ds4_attention_combine.
// Split `split` takes keys split·kps .. (split+1)·kps, kps a multiple of DS4_AMMA_KT.
extern "C" __global__ void __launch_bounds__(DS4_AMMA_WARPS * DS4_WARP)
ds4_attention_mma_split(const float* q, const float* kv, const float* ring, const float* crows,
                        const int* idx, ds4_size pos0, int n_head, int window, int comp_mode,
                        int ratio, int k_sel, ds4_size n_crows, float scale, int kps, float* part,
                        int* fault) {
    ds4_grid_wait();
    ds4_amma_block(q, kv, ring, crows, idx, nullptr, pos0, n_head, window, comp_mode, ratio, k_sel,
                   n_crows, scale, nullptr, part, gridDim.y, blockIdx.y, kps, blockIdx.x, blockIdx.x,
                   blockIdx.z * DS4_AMMA_HEADS, fault);
}

// One token of each of up to DS4_ATT_SEQS sequences (a batched decode step): grid
// sequences × max splits × head groups, per-sequence cache rows, position, selection and
// splits in `sq` (as ds4_attention_split_seqs); blocks past a sequence's own splits return
// at once, and ds4_attention_combine_seqs combines each sequence over its own splits, so a
// sequence gets what ds4_attention_mma_split gives it decoded alone.
extern "C" __global__ void __launch_bounds__(DS4_AMMA_WARPS * DS4_WARP)
ds4_attention_mma_split_seqs(const float* q, const float* kv, ds4_att_seqs sq, int n_head,
                             int window, int comp_mode, int ratio, int k_sel, float scale,
                             int max_splits, float* part, int* fault) {
    ds4_grid_wait();
    const int s = blockIdx.x, split = blockIdx.y;
    if (split >= sq.splits[s]) return;
    ds4_amma_block(q, kv + (ds4_size)s * DS4_AMMA_HD, sq.ring[s], sq.crows[s], sq.idx[s], nullptr,
                   sq.pos0[s], n_head, window, comp_mode, ratio, k_sel, sq.n_crows[s], scale,
                   nullptr, part, max_splits, split, sq.kps[s], 0, s, blockIdx.z * DS4_AMMA_HEADS,
                   fault);
}

// Dynamic shared memory of ds4_attention_mma (bytes), read by the host at load.
extern "C" __device__ const int ds4_attention_mma_smem[2] = {DS4_AMMA_SMEM, DS4_AMMA_HEADS};

// ---- Lightning-indexer scores of a prefill chunk on the tensor cores (docs/gpu.md §15) ----
//
// scores[t][r] = Σ_h w[t][h]·wscale · relu(q[t][h]·rows[r]) for the visible rows r < n_p(t),
// −inf for the others below n_cols (as ds4_indexer_scores, which keeps the CPU's exact
// summation order for decode). A block takes 4 tokens (M = 4 × 64 heads = 256 query rows,
// as halves in shared memory once) and 512 rows in tiles of 64: S = Q·Kᵀ with
// mma.m16n8k16 (warp w: token w / 4, heads 16 (w % 4).., all 64 rows of the tile), then
// the weighted relu summed over its 16 heads by a fixed shuffle tree, and the four warps of
// a token in order. 64 heads of 128 dims (DeepSeek V4 Flash); 16 warps.
#define DS4_IMMA_HEADS 64
#define DS4_IMMA_DIM 128
#define DS4_IMMA_TOK 4
#define DS4_IMMA_RT 64    // rows per tile
#define DS4_IMMA_ROWS 512 // rows per block
#define DS4_IMMA_LD (DS4_IMMA_DIM + 8)
#define DS4_IMMA_SMEM                                                                          \
    (2 * (DS4_IMMA_TOK * DS4_IMMA_HEADS * DS4_IMMA_LD + DS4_IMMA_RT * DS4_IMMA_LD) +           \
     4 * (16 * DS4_IMMA_RT + DS4_IMMA_TOK * DS4_IMMA_HEADS))

extern "C" __global__ void __launch_bounds__(512)
ds4_indexer_scores_mma(const float* q, const float* w, const float* rows, float wscale,
                       ds4_size pos0, int ratio, int n_tok, int n_cols, float* scores) {
    ds4_grid_wait();
    DS4_DYN_SHARED(ismem, DS4_IMMA_SMEM);  // its own name: HIP links all dynamic shared arrays
    ds4_u16* qs = (ds4_u16*)ismem;
    ds4_u16* ks = qs + DS4_IMMA_TOK * DS4_IMMA_HEADS * DS4_IMMA_LD;
    float* part = (float*)(ks + DS4_IMMA_RT * DS4_IMMA_LD);
    float* ws = part + 16 * DS4_IMMA_RT;
    const int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    const int g = lane >> 2, t4 = lane & 3;
    const int t0 = blockIdx.x * DS4_IMMA_TOK;
    const int nt = min(DS4_IMMA_TOK, n_tok - t0);
    const int rb = blockIdx.y * DS4_IMMA_ROWS;
    // Query rows (tokens past the chunk: zeros) and head weights.
    for (int i = tid; i < DS4_IMMA_TOK * DS4_IMMA_HEADS * DS4_IMMA_DIM / 4; i += 512) {
        const int r = (i * 4) / DS4_IMMA_DIM, c = (i * 4) % DS4_IMMA_DIM;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r / DS4_IMMA_HEADS < nt)
            v = ds4_ld_act((const float4*)(q + (ds4_size)t0 * DS4_IMMA_HEADS * DS4_IMMA_DIM) + i);
        ds4_u32* dst = (ds4_u32*)(qs + r * DS4_IMMA_LD + c);
        dst[0] = ds4_f2h2(v.x, v.y);
        dst[1] = ds4_f2h2(v.z, v.w);
    }
    if (tid < DS4_IMMA_TOK * DS4_IMMA_HEADS) {
        const int tt = tid / DS4_IMMA_HEADS;
        ws[tid] = tt < nt ? __fmul_rn(w[(ds4_size)(t0 + tt) * DS4_IMMA_HEADS + tid % DS4_IMMA_HEADS], wscale)
                          : 0.0f;
    }
    const int tw = warp >> 2, hb = (warp & 3) * 16;
    for (int r0 = rb; r0 < rb + DS4_IMMA_ROWS && r0 < n_cols; r0 += DS4_IMMA_RT) {
        __syncthreads();  // the previous tile's readers are done (and q, ws are in place)
        for (int i = tid; i < DS4_IMMA_RT * DS4_IMMA_DIM / 4; i += 512) {
            const int r = (i * 4) / DS4_IMMA_DIM, c = (i * 4) % DS4_IMMA_DIM;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r0 + r < n_cols) v = ds4_ld_act((const float4*)(rows + (ds4_size)(r0 + r) * DS4_IMMA_DIM + c));
            ds4_u32* dst = (ds4_u32*)(ks + r * DS4_IMMA_LD + c);
            dst[0] = ds4_f2h2(v.x, v.y);
            dst[1] = ds4_f2h2(v.z, v.w);
        }
        __syncthreads();
        float c[8][4];
#pragma unroll
        for (int nj = 0; nj < 8; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) c[nj][e] = 0.0f;
        const int qr = tw * DS4_IMMA_HEADS + hb;
#if defined(DS4_HAS_MMA)
        const int piece = lane >> 3;
        const int ar = qr + (lane & 7) + (piece & 1) * 8, ac = (piece >> 1) * 8;
#pragma unroll 1
        for (int kk = 0; kk < DS4_IMMA_DIM; kk += 16) {
            ds4_u32 a[4];
            ds4_ldmatrix_x4(a, qs + ar * DS4_IMMA_LD + kk + ac);
#pragma unroll
            for (int nj = 0; nj < 8; nj++) {
                const ds4_u16* brow = ks + (8 * nj + g) * DS4_IMMA_LD + kk + 2 * t4;
                ds4_u32 b[2];
                b[0] = *(const ds4_u32*)brow;
                b[1] = *(const ds4_u32*)(brow + 8);
                ds4_mma_16816(c[nj], a, b);
            }
        }
#else
        for (int nj = 0; nj < 8; nj++)
            for (int e = 0; e < 4; e++) {
                const int h = qr + g + (e >> 1) * 8, col = 8 * nj + 2 * t4 + (e & 1);
                float sum = 0.0f;
                for (int d = 0; d < DS4_IMMA_DIM; d++)
                    sum += ds4_h2f(qs[h * DS4_IMMA_LD + d]) * ds4_h2f(ks[col * DS4_IMMA_LD + d]);
                c[nj][e] = sum;
            }
#endif
        // Weighted relu over this warp's 16 heads: heads g and g + 8 in each lane, then a
        // fixed tree over g (lane bits 2..4).
        const float w0 = ws[tw * DS4_IMMA_HEADS + hb + g], w1 = ws[tw * DS4_IMMA_HEADS + hb + g + 8];
#pragma unroll
        for (int nj = 0; nj < 8; nj++) {
            float s0 = __fadd_rn(__fmul_rn(w0, fmaxf(c[nj][0], 0.0f)), __fmul_rn(w1, fmaxf(c[nj][2], 0.0f)));
            float s1 = __fadd_rn(__fmul_rn(w0, fmaxf(c[nj][1], 0.0f)), __fmul_rn(w1, fmaxf(c[nj][3], 0.0f)));
#pragma unroll
            for (int m = 4; m < 32; m <<= 1) {
                s0 = __fadd_rn(s0, ds4_shfl_xor(s0, m));
                s1 = __fadd_rn(s1, ds4_shfl_xor(s1, m));
            }
            if (g == 0) {
                part[warp * DS4_IMMA_RT + 8 * nj + 2 * t4] = s0;
                part[warp * DS4_IMMA_RT + 8 * nj + 2 * t4 + 1] = s1;
            }
        }
        __syncthreads();
        if (tid < DS4_IMMA_TOK * DS4_IMMA_RT) {
            const int tt = tid / DS4_IMMA_RT, r = tid % DS4_IMMA_RT;
            if (tt < nt && r0 + r < n_cols) {
                const ds4_size n_p = (pos0 + t0 + tt + 1) / ratio;
                float s = part[(4 * tt) * DS4_IMMA_RT + r];
                for (int i = 1; i < 4; i++) s = __fadd_rn(s, part[(4 * tt + i) * DS4_IMMA_RT + r]);
                scores[(ds4_size)(t0 + tt) * n_cols + r0 + r] =
                    (ds4_size)(r0 + r) < n_p ? s : -__int_as_float(0x7f800000);
            }
        }
    }
}

// Dynamic shared memory of ds4_indexer_scores_mma (bytes), read by the host at load.
extern "C" __device__ const int ds4_indexer_scores_mma_smem[2] = {DS4_IMMA_SMEM, DS4_IMMA_TOK};
