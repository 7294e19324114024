// hc.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// The embedding into the residual streams and mHC (docs/forward.md §4): the Sinkhorn
// projections, the stream mixes and the HC pre/post kernels.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

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
// waited on this loop: most of its cycles were barrier stalls, ncu; BENCHMARKS.md).
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
// predicated 8-wide sums and branches made the Sinkhorn most of the fused HCPre's
// coefficient block at decode (ncu; BENCHMARKS.md).
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
// third trip plus reduction for the output's RMSNorm (2 calls per layer; its time:
// BENCHMARKS.md). Here DS4_HCR_CT threads each load their 4 x 8 values once; one block
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
// was a 16384 -> 24 GEMV on 12 blocks followed by a one-block HCPre, 86 calls per token
// (ncu: BENCHMARKS.md). Here `ds4_hc_mix_part_*` spreads the
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
// 8 blocks each waiting on its own loads, ncu: BENCHMARKS.md, four-token HC blocks).
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
// same values (docs/gpu.md §21); the prefill profile had ds4_hc_post well above its memory
// time (docs/history/gpu-2026-12.md).
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
