// sampling.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// Greedy decoding (argmax) and the sampling band.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

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
    // lines, docs/gpu.md §31). Counts first, then each warp's
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
// row alone keeps one multiprocessor busy, so rows one after another cost a row's time each;
// side by side they take one row's time (BENCHMARKS.md, batched bands).
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
