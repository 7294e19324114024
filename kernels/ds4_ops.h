// ds4_ops.h: device helpers shared by several files of the ops module (ops.cu includes
// them all); each file includes this header, so each also compiles alone.
#pragma once

#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"

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
    case DS4_T_MXFP4: {
        // E8M0 scale e @0, E2M1 codes @1: value j < 16 the low nibble of byte 1 + j, j + 16
        // its high nibble.
        const ds4_u8* b = row + (ds4_size)(i / 32) * 17;
        const int j = i % 32;
        const ds4_u32 c = (b[1 + (j & 15)] >> (4 * (j >> 4))) & 15u;
        return ds4_e8m0_half(b[0]) * (float)ds4_mxfp4_kv(c);
    }
    default:
        return DS4_NAN;
    }
}

// Grid-stride loop over n elements (the elementwise ops and the row helpers).
#define DS4_GRID_STRIDE(i, n) \
    for (ds4_size i = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (ds4_size)gridDim.x * blockDim.x)

// Sequences of one batched decode step (the compressor, indexer and attention *_seqs
// kernels).
#define DS4_SEQS 16

// Per-sequence arguments of the batched attention kernels (attention.cu, prefill_mma.cu).
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
