// indexer.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// The lightning indexer (docs/forward.md §5.5): scores and the top-k selection (the
// prefill scores on the tensor cores: prefill_mma.cu).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

// ---------------------------------------------------------------------------------------
// Lightning indexer (docs/forward.md §5.5).
// ---------------------------------------------------------------------------------------

// scores[t][r] for r < n_p(t). A block (8 warps) takes DS4_IDX_ROWS rows of one query; q
// of the query is staged once per block in shared memory with a padded row stride
// (dim + 1: lane h reading head h's element i hits bank (h + i) mod 32, conflict-free), and
// so are the block's rows when they fit (DS4_IDX_KS values): read from global memory
// inside the dot loop, every step of a row had waited for an L2 round trip (ncu;
// BENCHMARKS.md). Each warp scores its rows with one lane per head,
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
    // arrives waits for one L2 round trip per step (the staging had cost most of the kernel's
    // time at decode, ncu: BENCHMARKS.md).
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
// made the decode top-k barrier-bound (ncu; BENCHMARKS.md).
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
