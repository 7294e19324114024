// attention.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// Sink attention (docs/forward.md §5.2, §5.4, §5.6): decode, split and batched forms, and
// the KV ring (prefill attention on the tensor cores: prefill_mma.cu).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

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
    // walk shared memory in split order (thread 0 used to chain 2 x n_splits global loads;
    // ncu: BENCHMARKS.md).
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
// DS4_ATT_SEQS and ds4_att_seqs: ds4_ops.h (prefill_mma.cu uses them too).

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
