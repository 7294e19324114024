// compressor.cu: part of the ops module (ops.cu includes it; it also compiles alone).
//
// The KV compressor (docs/forward.md §5.3): sequential, batched and windowed.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

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
// DS4_SEQS: ds4_ops.h.
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
