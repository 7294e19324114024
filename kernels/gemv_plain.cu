// gemv_plain.cu: part of the GEMV module (gemv.cu includes it; it also compiles alone).
//
// The engines for F32 and F16 weights: one column, several columns (their entry points:
// gemv.cu).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_gemv.h"

// ---------------------------------------------------------------------------------------
// Plain formats (F32, F16): a 16-byte vector is 4 or 8 whole elements. A warp computes
// DS4_GEMV_PLAIN_ROWS rows, loading each x vector once for all of them.
// ---------------------------------------------------------------------------------------

// ds4-gpu-check's sweep chose 2 (crates/ds4-gpu/NOTES.md, "F16 rows per warp").
#define DS4_GEMV_PLAIN_ROWS 2

struct Ds4F32 {
    static constexpr int EPV = 4;
    struct X {
        float4 a;
    };
    __device__ static X ldx(const float* x) { return X{ds4_ld_x4(x)}; }
    __device__ static float vdot(uint4 a, const X& x) {
        return __uint_as_float(a.x) * x.a.x + __uint_as_float(a.y) * x.a.y +
               __uint_as_float(a.z) * x.a.z + __uint_as_float(a.w) * x.a.w;
    }
};

struct Ds4F16 {
    static constexpr int EPV = 8;
    struct X {
        float4 a, b;
    };
    __device__ static X ldx(const float* x) { return X{ds4_ld_x4(x), ds4_ld_x4(x + 4)}; }
    __device__ static float vdot(uint4 a, const X& x) {
        float s = ds4_h2f((ds4_u16)(a.x & 0xffff)) * x.a.x;
        s += ds4_h2f((ds4_u16)(a.x >> 16)) * x.a.y;
        s += ds4_h2f((ds4_u16)(a.y & 0xffff)) * x.a.z;
        s += ds4_h2f((ds4_u16)(a.y >> 16)) * x.a.w;
        s += ds4_h2f((ds4_u16)(a.z & 0xffff)) * x.b.x;
        s += ds4_h2f((ds4_u16)(a.z >> 16)) * x.b.y;
        s += ds4_h2f((ds4_u16)(a.w & 0xffff)) * x.b.z;
        s += ds4_h2f((ds4_u16)(a.w >> 16)) * x.b.w;
        return s;
    }
};

template <class T>
__device__ __forceinline__ void ds4_gemv_plain(const ds4_u8* __restrict__ W,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int n_in, int n_out,
                                               int wpr, bool ok) {
    constexpr int R = DS4_GEMV_PLAIN_ROWS;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const int nvec = n_in / T::EPV;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    if (ok && row0 < n_out) {
        const uint4* w[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            w[r] = (const uint4*)(W + (ds4_size)min(row0 + r, n_out - 1) * (ds4_size)nvec * 16);
        const int stride = DS4_WARP * wpr;
        int i = (warp % wpr) * DS4_WARP + lane;
        // Four vectors per row in flight per lane before the first use; the first ones
        // are issued before the wait for the previous kernel (weights only).
        bool waited = false;
        for (; i + 3 * stride < nvec; i += 4 * stride) {
            uint4 a[R][4];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int k = 0; k < 4; ++k) a[r][k] = ds4_ldg(w[r] + i + k * stride);
            if (!waited) {
                ds4_grid_wait();
                waited = true;
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const typename T::X xv = T::ldx(x + (ds4_size)(i + k * stride) * T::EPV);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += T::vdot(a[r][k], xv);
            }
        }
        ds4_grid_wait();
        for (; i < nvec; i += stride) {
            const typename T::X xv = T::ldx(x + (ds4_size)i * T::EPV);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += T::vdot(ds4_ldg(w[r] + i), xv);
        }
    }
    ds4_finish_rows<R>(acc, y, row0, n_out, wpr, ok);
}

// The plain engine for a few independent columns (batched decode of F16/F32 matrices):
// each weight vector is loaded once and multiplied with every column's x; per column the
// per-lane order (vectors i, i + stride, ... in turn) and the reduction are ds4_gemv_plain's,
// so with the same warps per row each column's rows are bit-for-bit the one-token kernel's.
//
// Rows per warp (docs/gpu.md §35): x is read through L2 (ds4_ld_act), once per warp and
// column, so at MC columns and R rows a warp reads 4·MC / (R·sizeof(w)) bytes of x per byte
// of weights — 8 for F16 at the one-token kernel's two rows, which made the F16 matrices of
// an 8-sequence step run at a tenth of the bandwidth. A row's sum does not depend on which
// rows its warp takes with it, so this kernel takes DS4_PLAIN_COLS_ROWS rows per warp (the
// host sizes the grid from ds4_gemv_cols_rows); the next step's weight vectors are loaded
// right after this step's use (the order of the sums is unchanged). 8 rows: measured against
// the one-token shape's 2 and against 4 (BENCHMARKS.md, session of 2026-12-07, 07:30–10:30).
#define DS4_PLAIN_COLS_ROWS 8
// {rows per warp of ds4_gemv_cols_<t>, 0}: read by the host (a pair, as its other globals).
extern "C" __device__ const int ds4_gemv_cols_rows[2] = {DS4_PLAIN_COLS_ROWS, 0};
template <class T>
__device__ __forceinline__ void ds4_gemv_plain_cols(const ds4_u8* __restrict__ W,
                                                    const float* __restrict__ x,
                                                    ds4_size x_stride, float* __restrict__ y,
                                                    ds4_size y_stride, int n_in, int n_out,
                                                    int n_cols, int wpr) {
    constexpr int R = DS4_PLAIN_COLS_ROWS, MC = DS4_Q8M_COLS;
    static_assert(R >= 1, "rows per warp");
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const int nvec = n_in / T::EPV;
    const bool ok = n_cols >= 1 && n_cols <= MC;
    float acc[MC][R];
#pragma unroll
    for (int c = 0; c < MC; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[c][r] = 0.f;
    if (ok && row0 < n_out) {
        const uint4* const w0 = (const uint4*)(W + (ds4_size)row0 * (ds4_size)nvec * 16);
        // Row r's vectors (rows past the end read the last row; their sums are not written).
        auto wv = [&](int r, int i) { return ds4_ldg(w0 + min(r, n_out - 1 - row0) * nvec + i); };
        const int stride = DS4_WARP * wpr;
        const int i0 = (warp % wpr) * DS4_WARP + lane;
        uint4 a[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (i0 < nvec) a[r] = wv(r, i0);
        ds4_grid_wait();  // only weights were read so far (docs/gpu.md §6)
        for (int i = i0; i < nvec; i += stride) {
#pragma unroll
            for (int c = 0; c < MC; ++c) {
                if (c < n_cols) {
                    const typename T::X xv =
                        T::ldx(x + (ds4_size)c * x_stride + (ds4_size)i * T::EPV);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[c][r] += T::vdot(a[r], xv);
                }
            }
            if (i + stride < nvec) {
#pragma unroll
                for (int r = 0; r < R; ++r) a[r] = wv(r, i + stride);
            }
        }
    }
    ds4_grid_wait();  // a no-op where the loads above waited already
    if (ok) {
        // Every column's rows as ds4_finish_rows writes them (docs/gpu.md §26), FR rows at a
        // time (one lane per column and row adds the warps' parts): one barrier for all
        // columns, measured against a barrier per column (BENCHMARKS.md, session of
        // 2026-12-06, 12:16–15:16).
        constexpr int FR = R < DS4_WARP / MC ? R : DS4_WARP / MC;
        static_assert(R % FR == 0, "rows per warp: a multiple of the rows finished at once");
#pragma unroll
        for (int h = 0; h < R; h += FR) {
            float part[MC][FR];
#pragma unroll
            for (int c = 0; c < MC; ++c)
#pragma unroll
                for (int r = 0; r < FR; ++r) part[c][r] = acc[c][h + r];
            if (h > 0) __syncthreads();  // the parts of the previous rows have been added
            ds4_finish_cols<FR, MC>(part, y, y_stride, row0 + h, n_out, wpr, n_cols);
        }
        return;
    }
    // An unusable column count: every row NaN, as ds4_finish_rows writes it when !ok.
    // Unrolled, so that acc stays in registers (a column index known only at run time
    // would put it in local memory); n_cols is the same for the whole block.
#pragma unroll
    for (int c = 0; c < MC; ++c) {
        if (c < max(1, min(n_cols, MC))) {
            ds4_finish_rows<R>(acc[c], y + (ds4_size)c * y_stride, row0, n_out, wpr, ok);
            __syncthreads();  // part_sums are rewritten by the next column
        }
    }
}
