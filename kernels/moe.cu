// moe.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// The router (docs/forward.md §6) and the MoE row helpers.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

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
// tree reductions, with thread 0 finishing alone, were slower (ncu; BENCHMARKS.md, the
// router). Lane r keeps round r's expert; the weights' sum runs over r in order on every
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
