// ds4_quant.h: block-format pieces and block reductions shared by the kernel files (included
// after ds4_port.h).
#pragma once

// GGML type ids (the GGUF numbering).
#define DS4_T_F32 0
#define DS4_T_F16 1
#define DS4_T_Q8_0 8
#define DS4_T_Q2_K 10
#define DS4_T_Q4_K 12
#define DS4_T_IQ2_XXS 16
#define DS4_T_BF16 30
#define DS4_T_MXFP4 39

// Q4_K / Q5_K 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes `sp`
// (ggml's get_scale_min_k4): sub-blocks 0..3 keep theirs in the low 6 bits of bytes j and
// j+4; 4..7 split theirs over the low/high nibbles of byte j+4 and the top 2 bits of bytes
// j-4 and j.
__device__ __forceinline__ void ds4_q4k_scale_min(const ds4_u8* sp, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = sp[j] & 63;
        *mn = sp[j + 4] & 63;
    } else {
        *sc = (sp[j + 4] & 0xF) | ((sp[j - 4] >> 6) << 4);
        *mn = (sp[j + 4] >> 4) | ((sp[j] >> 6) << 4);
    }
}

// MXFP4 (docs/gguf.md §6): 2^(e-128) exactly, as ds4_gguf's e8m0_to_f32_half: subnormal for
// e < 2, else the f32 exponent field e - 1.
__device__ __forceinline__ float ds4_e8m0_half(ds4_u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}
// The doubled E2M1 value of code c (0..15) as an int: bytes of two 64-bit tables, codes
// 0..7 (0, 1, 2, 3, 4, 6, 8, 12) and 8..15 (their negatives, code 8 = 0).
__device__ __forceinline__ int ds4_mxfp4_kv(ds4_u32 c) {
    const ds4_u64 t = (c & 8u) ? 0xF4F8FAFCFDFEFF00ull : 0x0C08060403020100ull;
    return (int)(signed char)(ds4_u8)(t >> (8 * (c & 7u)));
}

// Little-endian loads at any alignment (block fields are not aligned).
__device__ __forceinline__ ds4_u16 ds4_b16(const ds4_u8* p) {
    return (ds4_u16)p[0] | ((ds4_u16)p[1] << 8);
}
__device__ __forceinline__ ds4_u32 ds4_b32(const ds4_u8* p) {
    return (ds4_u32)p[0] | ((ds4_u32)p[1] << 8) | ((ds4_u32)p[2] << 16) | ((ds4_u32)p[3] << 24);
}

// The routed experts' activation (docs/forward.md §6 step 4), one expression for every kernel
// that applies it so their roundings agree: SiLU(min(g, c)) · clamp(u, −c, c).
__device__ __forceinline__ float ds4_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float ds4_silu(float x) { return x * ds4_sigmoid(x); }
__device__ __forceinline__ float ds4_swiglu1(float g, float u, float c) {
    return ds4_silu(fminf(g, c)) * fminf(fmaxf(u, -c), c);
}

// ---------------------------------------------------------------------------------------
// Block reductions (RMSNorm's sum of squares), shared so that every kernel that normalizes
// a row — norm_rope.cu's ds4_rms_norm and the GEMVs that normalize their own input — sums in the
// same order and gets the same scale.
// ---------------------------------------------------------------------------------------
// v of lane (this lane ^ m), for doubles (two 32-bit shuffles).
__device__ __forceinline__ double ds4_shfl_xor_d(double v, int m) {
    const long long b = __double_as_longlong(v);
    const int lo = ds4_shfl_xor_i((int)(b & 0xffffffffLL), m);
    const int hi = ds4_shfl_xor_i((int)(b >> 32), m);
    return __longlong_as_double(((long long)hi << 32) | (long long)(unsigned)lo);
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024; sh holds >= 33
// doubles): a shuffle tree in each warp, then one over the warps' sums, in a fixed order
// (deterministic). Two barriers instead of one per halving step: at decode the block
// reductions of hc_pre / rms_norm were barrier-bound (ncu; BENCHMARKS.md).
__device__ __forceinline__ double ds4_block_sum_d(double v, double* sh) {
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    const int nw = blockDim.x / DS4_WARP;
#pragma unroll
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) v += ds4_shfl_xor_d(v, m);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double r = lane < nw ? sh[lane] : 0.0;
#pragma unroll
        for (int m = DS4_WARP / 2; m > 0; m >>= 1) r += ds4_shfl_xor_d(r, m);
        if (lane == 0) sh[DS4_WARP] = r;
    }
    __syncthreads();
    const double r = sh[DS4_WARP];
    __syncthreads();
    return r;
}

// (mean(x^2) + eps)^(-1/2) of n values, the sum in double (as the CPU reference).
// At decode one block reads the whole row, so the loop is bound by memory latency: eight
// independent partial sums keep eight loads in flight per thread instead of one.
__device__ __forceinline__ float ds4_rms_scale(const float* x, int n, float eps, double* sh) {
    const int bd = blockDim.x;
    double p[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int i = threadIdx.x;
    for (; i + 7 * bd < n; i += 8 * bd) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = x[i + u * bd];
#pragma unroll
        for (int u = 0; u < 8; u++) p[u] += (double)v[u] * (double)v[u];
    }
    for (; i < n; i += bd) p[0] += (double)x[i] * (double)x[i];
    double ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    ss = ds4_block_sum_d(ss, sh);
    return (float)(1.0 / sqrt(ss / (double)n + (double)eps));
}

// ds4_rms_scale exactly as a block of 1024 threads computes it (the decode launch of
// ds4_rms_norm: one row, 1024 threads), by a block of fewer threads (blockDim.x dividing
// 1024): each thread takes the partial sums of the virtual threads t, t + B, ... of that
// block, each virtual warp's shuffle tree runs on the real warp holding the same lanes, and
// the 32 warp sums are combined as ds4_block_sum_d combines them. Same pairs, same order,
// so the same scale bit for bit (a GEMV that normalizes its own input then matches the
// separate launch it replaces). sh holds >= 33 doubles.
__device__ __forceinline__ float ds4_rms_scale_as1024(const float* x, int n, float eps,
                                                         double* sh) {
    constexpr int V = 1024;
    const int B = blockDim.x, J = V / B;
    const int lane = threadIdx.x & (DS4_WARP - 1), warp = threadIdx.x / DS4_WARP;
    for (int j = 0; j < J; j++) {
        double p[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        int i = threadIdx.x + j * B;
        for (; i + 7 * V < n; i += 8 * V) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = x[i + u * V];
#pragma unroll
            for (int u = 0; u < 8; u++) p[u] += (double)v[u] * (double)v[u];
        }
        for (; i < n; i += V) p[0] += (double)x[i] * (double)x[i];
        double ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
#pragma unroll
        for (int m = DS4_WARP / 2; m > 0; m >>= 1) ss += ds4_shfl_xor_d(ss, m);
        if (lane == 0) sh[warp + j * (B / DS4_WARP)] = ss;
    }
    __syncthreads();
    if (warp == 0) {
        double r = sh[lane];
#pragma unroll
        for (int m = DS4_WARP / 2; m > 0; m >>= 1) r += ds4_shfl_xor_d(r, m);
        if (lane == 0) sh[DS4_WARP] = r;
    }
    __syncthreads();
    const double ss = sh[DS4_WARP];
    __syncthreads();
    return (float)(1.0 / sqrt(ss / (double)n + (double)eps));
}

// Fault bits (crates/ds4-gpu/src/backend/fault.rs names them).
#ifndef DS4_FAULT_TOKEN
#define DS4_FAULT_TOKEN 1
#define DS4_FAULT_EXPERT 2
#define DS4_FAULT_ROW 4
#define DS4_FAULT_TYPE 8
#endif
__device__ __forceinline__ void ds4_fault(int* fault, int bit) { atomicOr(fault, bit); }

// Order-preserving map of f32 to u32 (the order of f32::total_cmp).
__device__ __forceinline__ ds4_u32 ds4_key(float f) {
    const ds4_u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float ds4_sqrtsoftplus(float x) {
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    return sqrtf(sp);
}

// The router of one token t (docs/forward.md §6 steps 1-3) by one warp (`lane` its lane),
// for n_expert <= 256 and k <= 32: mode 0 picks the top k of sqrt(softplus(l)) + bias, mode 1
// reads the hash table's row of the token; weights are the picks' sqrt(softplus(l))
// normalised and scaled. The logits row l is read through ds4_ld_act (in the fused router
// GEMV, ds4_gemv_router_f16, other blocks wrote it during the same kernel).
#define DS4_RW_PER_LANE 8
__device__ __forceinline__ void ds4_router_token(const float* l, int t, int n_expert, int k,
                                                 float rscale, int mode, const float* bias,
                                                 const ds4_u8* table, int table_rows,
                                                 const int* tokens, int* ids, float* weights,
                                                 int* fault, int lane) {
    int mine = -1;
    if (mode == 0) {
        ds4_u32 key[DS4_RW_PER_LANE];
        ds4_u32 live = 0;
#pragma unroll
        for (int j = 0; j < DS4_RW_PER_LANE; j++) {
            const int e = lane + DS4_WARP * j;
            key[j] = 0;
            if (e < n_expert) {
                key[j] = ds4_key(ds4_sqrtsoftplus(ds4_ld_act(l + e)) + (bias ? bias[e] : 0.0f));
                live |= 1u << j;
            }
        }
        for (int r = 0; r < k; r++) {
            ds4_u32 best = 0;
            int besti = -1;
#pragma unroll
            for (int j = 0; j < DS4_RW_PER_LANE; j++) {
                if (((live >> j) & 1u) && (besti < 0 || key[j] > best)) {
                    best = key[j];
                    besti = lane + DS4_WARP * j;
                }
            }
#pragma unroll
            for (int m = DS4_WARP / 2; m > 0; m >>= 1) {
                const ds4_u32 ov = (ds4_u32)ds4_shfl_xor_i((int)best, m);
                const int oi = ds4_shfl_xor_i(besti, m);
                if (oi >= 0 && (besti < 0 || ov > best || (ov == best && oi < besti))) {
                    best = ov;
                    besti = oi;
                }
            }
            if (lane == r) mine = besti;
            if (besti >= 0 && (besti & (DS4_WARP - 1)) == lane) live &= ~(1u << (besti / DS4_WARP));
        }
    } else if (lane < k) {
        const int tok = tokens[t];
        int e = -1;
        if (tok >= 0 && tok < table_rows) e = (int)ds4_b32(table + ((ds4_size)tok * k + lane) * 4);
        else ds4_fault(fault, DS4_FAULT_TOKEN);
        if (e < 0 || e >= n_expert) {
            ds4_fault(fault, DS4_FAULT_EXPERT);
            e = 0;
        }
        mine = e;
    }
    const float pi = lane < k ? ds4_sqrtsoftplus(ds4_ld_act(l + mine)) : 0.0f;
    float sum = 0.0f;
    for (int r = 0; r < k; r++) sum += ds4_shfl_idx(pi, r);
    if (lane < k) {
        weights[(ds4_size)t * k + lane] = sum > 0.0f ? pi / sum * rscale : 0.0f;
        ids[(ds4_size)t * k + lane] = mine;
    }
}
