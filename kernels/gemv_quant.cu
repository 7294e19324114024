// gemv_quant.cu: part of the GEMV module (gemv.cu includes it; it also compiles alone).
//
// The f32-activation engine for split-layout Q8_0 rows (the other block formats take
// ds4_gemv_quant, ds4_gemv.h; the entry points: gemv.cu).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_gemv.h"

// Split-layout Q8_0 rows (Ds4Q8S): a warp computes R rows; each lane takes 16-code vectors
// i, i + stride, ... with DEPTH of them per row loaded before the first use, the vector's
// scale (shared by two lanes) beside it, and x (16 floats) once for all R rows.
template <class T>
__device__ __forceinline__ void ds4_gemv_q8s(const ds4_u8* __restrict__ W,
                                             const float* __restrict__ x,
                                             float* __restrict__ y, int n_in, int n_out,
                                             int wpr, bool ok) {
    constexpr int R = T::ROWS, D = T::DEPTH;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row0 = (blockIdx.x * (DS4_GEMV_WARPS / wpr) + warp / wpr) * R;
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nvec = n_in / 16;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    // x staged once per block in shared memory: read from global memory per warp it cost
    // 4 bytes of x per byte of weights, from L1 before the coherent loads of docs/gpu.md §6
    // (the L1 pipe nearly saturated, ncu) and from L2 after them (the decode figures of Q8_0
    // on f32 activations: BENCHMARKS.md's progression). The int8 default does not use this
    // engine at decode (§8).
    __shared__ __align__(16) float xsh[DS4_Q8S_XMAX];
    const bool staged = n_in <= DS4_Q8S_XMAX;
    ds4_grid_wait();
    if (staged) {
        for (int e = 4 * (int)threadIdx.x; e < n_in; e += 4 * (int)blockDim.x)
            *(float4*)(xsh + e) = ds4_ld_act((const float4*)(x + e));
        __syncthreads();
    }
    auto ldx = [&](int v) -> Ds4X16 {
        if (staged) {
            const float4* p = (const float4*)(xsh + 16 * v);
            return Ds4X16{{p[0], p[1], p[2], p[3]}};
        }
        return ds4_ld_x16(x + (ds4_size)v * 16);
    };
    if (ok && row0 < n_out) {
        const ds4_u8* rows[R];
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = W + (ds4_size)min(row0 + r, n_out - 1) * row_bytes;
        const int stride = DS4_WARP * wpr;
        int i = (warp % wpr) * DS4_WARP + lane;
        bool waited = false;
        for (; i + (D - 1) * stride < nvec; i += D * stride) {
            uint4 q[R][D];
            ds4_u16 sc[R][D];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int k = 0; k < D; ++k) {
                    const int v = i + k * stride;
                    q[r][k] = ds4_ldg((const uint4*)rows[r] + v);
                    sc[r][k] = ds4_ldg((const ds4_u16*)(rows[r] + n_in) + (v >> 1));
                }
            // Only weights were read so far (overlapped launches, docs/gpu.md §6).
            if (!waited) {
                ds4_grid_wait();
                waited = true;
            }
#pragma unroll
            for (int k = 0; k < D; ++k) {
                const Ds4X16 xv = ldx(i + k * stride);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += ds4_h2f(sc[r][k]) * ds4_q8s_dot16(q[r][k], xv);
            }
        }
        ds4_grid_wait();
        for (; i < nvec; i += stride) {
            const Ds4X16 xv = ldx(i);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 q = ds4_ldg((const uint4*)rows[r] + i);
                const ds4_u16 sc = ds4_ldg((const ds4_u16*)(rows[r] + n_in) + (i >> 1));
                acc[r] += ds4_h2f(sc) * ds4_q8s_dot16(q, xv);
            }
        }
    }
    ds4_finish_rows<R>(acc, y, row0, n_out, wpr, ok);
}
