// prefill_mma.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// Prefill on the tensor cores: attention (docs/gpu.md §14) and the lightning indexer's
// scores (docs/gpu.md §15).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

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
