// tiles.cu: prefill matmuls straight from quantized weights (docs/gpu.md §4).
//
// The panel path (ops.cu: dequantize a whole matrix to f32, then a GEMM) writes and reads
// back four bytes per weight per chunk: for the routed experts of one layer that is ~25 GB
// at a 2048-token chunk, far more than the ~2 GB of quantized weights. These kernels read
// each quantized weight once per tile of tokens, decode it in registers into a half-precision
// tile in shared memory, and multiply it with the tokens' activations (also half precision)
// on the tensor cores (`mma.sync` m16n8k16, f32 accumulation). Half precision keeps 11
// significant bits, as TF32 does, so this is the fast default's numeric class; the pedantic
// f32 path (`--quality`) keeps the panels.
//
// Routed experts are grouped on the device: `ds4_moe_sort` orders the (token, slot)
// selections by expert (token order inside an expert, so every result is deterministic),
// with no host round trip; one `ds4_mm_tiles` launch then covers every expert.
//
// HIP: the same kernels; the tile product is written out as plain FMAs on the same shared
// tiles (the AMD matrix-core builtins are a tuning step that needs AMD hardware). The CPU
// emulation (crates/ds4-gpu/emu) runs the tensor-core path through an emulated mma.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"


#define DS4_FAULT_EXPERT 2

// Tile shape: 128 weight rows (8 warps x 16) by 64 tokens, K in steps of 64.
#define DS4_TR 128
#define DS4_TT 64
#define DS4_TK 64
// Shared rows are padded by 8 halves (16 bytes) so the fragment loads of a warp's 8 row
// groups fall in 8 distinct bank quadruples.
#define DS4_TKP (DS4_TK + 8)

// Two f32 values as one register of two halves (round to nearest even; `lo` in the low
// half, the order the tensor-core fragments expect).
__device__ __forceinline__ ds4_u32 ds4_pack_h2(float lo, float hi) {
    return (ds4_u32)ds4_f2h(lo) | ((ds4_u32)ds4_f2h(hi) << 16);
}

// Values k0 .. k0+31 (k0 a multiple of 32) of one weight row, in f32, computed with the
// same expressions (and so the same f32 roundings) as ops.cu's ds4_elem and the CPU's
// ds4_gguf::quant::dequantize.
__device__ __forceinline__ void ds4_dec32(int ty, const ds4_u8* row, ds4_size row_bytes, int k0,
                                          const ds4_u64* grid, const ds4_u8* ksigns, float* v) {
    switch (ty) {
    case DS4_T_F32:
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = __uint_as_float(ds4_b32(row + 4 * (ds4_size)(k0 + i)));
        break;
    case DS4_T_F16:
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = ds4_h2f(ds4_b16(row + 2 * (ds4_size)(k0 + i)));
        break;
    case DS4_T_BF16:
#pragma unroll
        for (int i = 0; i < 32; i++)
            v[i] = __uint_as_float(((ds4_u32)ds4_b16(row + 2 * (ds4_size)(k0 + i))) << 16);
        break;
    case DS4_T_Q8_0: {
        // The GPU's split layout (ops.cu ds4_q8_0_split): 32 codes at k0, the scale after
        // all of the row's codes.
        const ds4_size n = row_bytes / 34 * 32;
        const float d = ds4_h2f(ds4_b16(row + n + 2 * (ds4_size)(k0 / 32)));
        const ds4_u8* q = row + k0;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = d * (float)(ds4_i8)q[i];
        break;
    }
    case DS4_T_Q2_K: {
        // Block of 256: scales[16] @0, qs[64] @16, d @80, dmin @82 (4-byte aligned rows).
        const ds4_u8* b = row + (ds4_size)(k0 / 256) * 84;
        const int j0 = k0 % 256, n = j0 / 128, g = (j0 % 128) / 32;
        const float d = ds4_h2f(ds4_b16(b + 80)), dmin = ds4_h2f(ds4_b16(b + 82));
        const ds4_u8 s0 = b[n * 8 + 2 * g], s1 = b[n * 8 + 2 * g + 1];
        const ds4_u32* qs = (const ds4_u32*)(b + 16 + n * 32);
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const ds4_u32 q4 = ds4_ldg(qs + w);
            const ds4_u8 sc = w < 4 ? s0 : s1;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int q = (int)((q4 >> (8 * c + 2 * g)) & 3);
                v[4 * w + c] = d * (float)(sc & 0xF) * (float)q - dmin * (float)(sc >> 4);
            }
        }
        break;
    }
    case DS4_T_Q4_K: {
        // Block of 256: d @0, dmin @2, scales[12] @4, qs[128] @16 (4-byte aligned rows).
        const ds4_u8* b = row + (ds4_size)(k0 / 256) * 144;
        const int j0 = k0 % 256, c = j0 / 64, hi = (j0 % 64) >= 32 ? 1 : 0;
        const int is = 2 * c + hi;
        int sc, m;
        ds4_q4k_scale_min(b + 4, is, &sc, &m);
        const float d = ds4_h2f(ds4_b16(b)), dmin = ds4_h2f(ds4_b16(b + 2));
        const ds4_u32* qs = (const ds4_u32*)(b + 16 + c * 32);
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const ds4_u32 q4 = ds4_ldg(qs + w);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const ds4_u32 qb = (q4 >> (8 * e)) & 0xff;
                const int q = hi ? (int)(qb >> 4) : (int)(qb & 0xF);
                v[4 * w + e] = d * (float)sc * (float)q - dmin * (float)m;
            }
        }
        break;
    }
    case DS4_T_IQ2_XXS: {
        // Block of 256: d @0, then per 32 values 4 grid bytes + a u32 (4 x 7-bit sign sets,
        // 4-bit scale). Rows are 2-byte aligned.
        const ds4_u8* b = row + (ds4_size)(k0 / 256) * 66;
        const ds4_u16* q = (const ds4_u16*)(b + 2 + ((k0 % 256) / 32) * 8);
        const ds4_u32 g01 = ds4_ldg(q), g23 = ds4_ldg(q + 1);
        const ds4_u32 a1 = (ds4_u32)ds4_ldg(q + 2) | ((ds4_u32)ds4_ldg(q + 3) << 16);
        const float db = ds4_h2f(ds4_ldg((const ds4_u16*)b)) * (0.5f + (float)(a1 >> 28)) * 0.25f;
        const ds4_u32 gi[4] = {g01 & 0xff, g01 >> 8, g23 & 0xff, g23 >> 8};
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const ds4_u64 gv = grid[gi[l]];
            const ds4_u8 signs = ksigns[(a1 >> (7 * l)) & 127];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float gf = (float)((gv >> (8 * k)) & 0xff);
                v[8 * l + k] = db * gf * ((signs >> k) & 1 ? -1.0f : 1.0f);
            }
        }
        break;
    }
    default:
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = __int_as_float(0x7fc00000);
    }
}

// One block per expert e (plus one block, e == n_exp, for ids outside 0..n_exp): the
// selections i (= token * k + slot) routed to e, in increasing i, at positions
// offs[e] .. offs[e+1] of `order`; inv[i] is the position of selection i. `order` is a
// permutation of 0..n_sel whatever the ids hold (bad ids sort last and set the fault bit).
extern "C" __global__ void __launch_bounds__(256)
ds4_moe_sort(const int* ids, int n_sel, int n_exp, int* offs, int* order, int* inv, int* fault) {
    ds4_grid_wait();
    __shared__ int warp_n[8];
    __shared__ int s_base;
    const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Selections routed to an expert before e (bad ids count as n_exp, i.e. last).
    int before = 0;
    for (int i = tid; i < n_sel; i += 256) {
        int id = ids[i];
        if (id < 0 || id >= n_exp) {
            if (e == 0) atomicOr(fault, DS4_FAULT_EXPERT);
            id = n_exp;
        }
        before += id < e ? 1 : 0;
    }
    for (int m = 16; m > 0; m >>= 1) before += ds4_shfl_xor_i(before, m);
    if (lane == 0) warp_n[warp] = before;
    __syncthreads();
    if (tid == 0) {
        int s = 0;
        for (int w = 0; w < 8; w++) s += warp_n[w];
        s_base = s;
        offs[e] = s;
    }
    __syncthreads();
    int base = s_base;
    // Ordered compaction, 256 selections per round.
    for (int r0 = 0; r0 < n_sel; r0 += 256) {
        const int i = r0 + tid;
        int id = i < n_sel ? ids[i] : -2;
        if (i < n_sel && (id < 0 || id >= n_exp)) id = n_exp;
        const int mine = (i < n_sel && id == e) ? 1 : 0;
        // Rank among the lanes below this one, then among the warps below this one.
        int incl = mine;
        for (int m = 1; m < 32; m <<= 1) {
            const int t = __float_as_int(ds4_shfl_up(__int_as_float(incl), m));
            if (lane >= m) incl += t;
        }
        __syncthreads();
        if (lane == 31) warp_n[warp] = incl;
        __syncthreads();
        int off = base;
        for (int w = 0; w < warp; w++) off += warp_n[w];
        if (mine) {
            const int p = off + incl - 1;
            order[p] = i;
            inv[i] = p;
        }
        for (int w = 0; w < 8; w++) base += warp_n[w];
    }
    if (e == gridDim.x - 1 && tid == 0) offs[e + 1] = base;
}

// out[p] = x[order[p] / k] as halves (rows of d values): each expert's inputs in sorted order.
extern "C" __global__ void ds4_gather_rows_h(const float* x, const int* order, int k, int n, int d,
                                             ds4_u16* out) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * d;
    for (ds4_size e = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (ds4_size)gridDim.x * blockDim.x) {
        const ds4_size p = e / d;
        out[e] = ds4_f2h(x[(ds4_size)(order[p] / k) * d + (e % d)]);
    }
}

// x as halves, row by row (x_stride floats apart), into a dense [n][d] array.
extern "C" __global__ void ds4_to_half(const float* x, ds4_size x_stride, int n, int d, ds4_u16* out) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * d;
    for (ds4_size e = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (ds4_size)gridDim.x * blockDim.x) {
        out[e] = ds4_f2h(x[(e / d) * x_stride + (e % d)]);
    }
}

// h[p] = weight of selection order[p] * SwiGLU(g[p], u[p]) with the clamp, as halves (the
// down projection's input in sorted order). Same expression as ops.cu's ds4_moe_act.
extern "C" __global__ void ds4_moe_act_h(const float* g, const float* u, const float* weights,
                                         const int* order, int n, int f, float clamp, ds4_u16* h) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n * f;
    for (ds4_size e = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (ds4_size)gridDim.x * blockDim.x) {
        h[e] = ds4_f2h(weights[order[e / f]] * ds4_swiglu1(g[e], u[e], clamp));
    }
}

// out[t] = sum over slots s < k, in slot order, of y[inv[t*k + s]] (NaN for a selection
// whose expert id is outside 0..n_exp; the fault bit says why).
extern "C" __global__ void ds4_moe_sum_sorted(const float* y, const int* inv, const int* ids, int n_tok,
                                              int k, int d, int n_exp, float* out) {
    ds4_grid_wait();
    const ds4_size total = (ds4_size)n_tok * d;
    for (ds4_size e = (ds4_size)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (ds4_size)gridDim.x * blockDim.x) {
        const ds4_size t = e / d;
        const int c = (int)(e % d);
        float s = 0.0f;
        for (int j = 0; j < k; j++) {
            const int i = (int)t * k + j;
            const int id = ids[i];
            s += (id >= 0 && id < n_exp) ? y[(ds4_size)inv[i] * d + c] : __int_as_float(0x7fc00000);
        }
        out[e] = s;
    }
}

// Y[p][r] = sum_k W_g[r][k] * X[p][k] for the tokens p of group g, every group in one
// launch: grid = (row tiles of 128, groups [x2 with a second matrix], token-tile stride).
// With `offs`, group g's tokens are offs[g] .. offs[g+1] and its matrix is at
// w + g * mat_bytes (routed experts in sorted order); without, one group of n_tok tokens.
// A second matrix (w2 / y2, same shape and type, e.g. gate and up) takes the upper half of
// gridDim.y. X is half precision, [tokens][cols]; cols is a multiple of 32.
extern "C" __global__ void __launch_bounds__(256)
ds4_mm_tiles(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes, int ty, ds4_size row_bytes,
             int n_rows, int cols, const ds4_u16* x, const int* offs, int n_tok, float* y,
             float* y2, ds4_size y_stride) {
    ds4_grid_wait();
    __shared__ __align__(16) ds4_u16 ws[DS4_TR][DS4_TKP];
    __shared__ __align__(16) ds4_u16 xs[DS4_TT][DS4_TKP];
    __shared__ ds4_u64 grid[256];
    __shared__ ds4_u8 ksigns[128];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_groups = w2 ? (int)gridDim.y / 2 : (int)gridDim.y;
    const int second = (int)blockIdx.y >= n_groups ? 1 : 0;
    const int grp = (int)blockIdx.y - second * n_groups;
    const ds4_u8* wm = (second ? w2 : w) + (ds4_size)grp * mat_bytes;
    float* ym = second ? y2 : y;
    const int lo = offs ? offs[grp] : 0, hi = offs ? offs[grp + 1] : n_tok;
    const int r0 = blockIdx.x * DS4_TR;
    if (lo >= hi) return;
    if (ty == DS4_T_IQ2_XXS) {
        for (int i = tid; i < 256; i += 256) grid[i] = ds4_iq2xxs_grid[i];
        for (int i = tid; i < 128; i += 256) ksigns[i] = ds4_iq2xxs_ksigns[i];
    }
    // This thread decodes 32 values of row r0 + tid / 2 per K step.
    const int dr = r0 + (tid >> 1);
    const ds4_u8* drow = wm + (ds4_size)(dr < n_rows ? dr : 0) * row_bytes;
    const int g = lane >> 2, t4 = lane & 3;
    for (int t0 = lo + (int)blockIdx.z * DS4_TT; t0 < hi; t0 += (int)gridDim.z * DS4_TT) {
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[j][q] = 0.0f;
        for (int k0 = 0; k0 < cols; k0 += DS4_TK) {
            __syncthreads();  // the previous step's tiles are consumed (and the tables loaded)
            {
                const int kg = k0 + (tid & 1) * 32;
                float v[32];
                if (dr < n_rows && kg < cols) {
                    ds4_dec32(ty, drow, row_bytes, kg, grid, ksigns, v);
                } else {
#pragma unroll
                    for (int i = 0; i < 32; i++) v[i] = 0.0f;
                }
                uint4* dst = (uint4*)&ws[tid >> 1][(tid & 1) * 32];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    uint4 o;
                    o.x = ds4_pack_h2(v[8 * q + 0], v[8 * q + 1]);
                    o.y = ds4_pack_h2(v[8 * q + 2], v[8 * q + 3]);
                    o.z = ds4_pack_h2(v[8 * q + 4], v[8 * q + 5]);
                    o.w = ds4_pack_h2(v[8 * q + 6], v[8 * q + 7]);
                    dst[q] = o;
                }
            }
            // 64 tokens x 64 halves = 512 pieces of 16 bytes, two per thread.
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int e = tid + 256 * q, tr = e >> 3, part = e & 7;
                const int p = t0 + tr, kk = k0 + part * 8;
                uint4 val = make_uint4(0, 0, 0, 0);
                if (p < hi && kk < cols) val = *(const uint4*)(x + (ds4_size)p * cols + kk);
                *(uint4*)&xs[tr][part * 8] = val;
            }
            __syncthreads();
            const int wr = warp * 16;
#pragma unroll
            for (int ks = 0; ks < DS4_TK; ks += 16) {
#if defined(DS4_HAS_MMA)
                ds4_u32 a[4];
                a[0] = *(const ds4_u32*)&ws[wr + g][ks + 2 * t4];
                a[1] = *(const ds4_u32*)&ws[wr + g + 8][ks + 2 * t4];
                a[2] = *(const ds4_u32*)&ws[wr + g][ks + 8 + 2 * t4];
                a[3] = *(const ds4_u32*)&ws[wr + g + 8][ks + 8 + 2 * t4];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    ds4_u32 b[2];
                    b[0] = *(const ds4_u32*)&xs[8 * j + g][ks + 2 * t4];
                    b[1] = *(const ds4_u32*)&xs[8 * j + g][ks + 8 + 2 * t4];
                    ds4_mma_16816(acc[j], a, b);
                }
#else
                // The same fragment elements as the tensor-core path, by plain FMAs.
#pragma unroll
                for (int j = 0; j < 8; j++) {
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const int rr = wr + g + (q >> 1) * 8, tt = 8 * j + 2 * t4 + (q & 1);
                        float s = acc[j][q];
                        for (int kk = 0; kk < 16; kk++)
                            s += ds4_h2f(ws[rr][ks + kk]) * ds4_h2f(xs[tt][ks + kk]);
                        acc[j][q] = s;
                    }
                }
#endif
            }
        }
        // Fragment q of n-tile j: row wr + g (+8 for q >= 2), token 8j + 2t4 (+1 for odd q).
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = r0 + warp * 16 + g + (q >> 1) * 8;
                const int p = t0 + 8 * j + 2 * t4 + (q & 1);
                if (r < n_rows && p < hi) ym[(ds4_size)p * y_stride + r] = acc[j][q];
            }
        }
    }
}
