// tiles.cu: prefill matmuls straight from quantized weights (docs/gpu.md §4).
//
// The panel path (dequant.cu: dequantize a whole matrix to f32, then a GEMM) writes and reads
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

// K in steps of 64 (block shapes: see ds4_mm_tiles).
#define DS4_TK 64

// Shared tiles are rows of DS4_TK halves (128 bytes, eight 16-byte chunks) without padding;
// chunk c of row r is stored at chunk c ^ (r % 8). The eight row addresses of one 8x8
// ldmatrix piece (8 rows, one chunk) and the eight 16-byte stores of a quarter warp (4
// rows x 2 chunks, 2 x 4 or 1 x 8) then fall in 8 distinct bank quadruples, as the old
// 8-half padding did, and two stages of both tiles fit the 48 KB of static shared memory
// ((128 + 64) x 64 halves = 24 KB per stage).
__device__ __forceinline__ int ds4_tsw(int r, int c) {
    return r * DS4_TK + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
}

// Two f32 values as one register of two halves (round to nearest even; `lo` in the low
// half, the order the tensor-core fragments expect): one paired conversion on CUDA.
__device__ __forceinline__ ds4_u32 ds4_pack_h2(float lo, float hi) { return ds4_f2h2(lo, hi); }

// (float)v for 0 <= v < 2^23, and (float)(signed char)v for a byte v, without an
// int-to-float conversion: the integer goes into the mantissa of 2^23 and 2^23 (+ 128) is
// subtracted, both steps exact, so the value is the same as the cast's. The decode does one
// such conversion per weight, and NVIDIA GPUs convert at a quarter or less of the f32 add
// rate (16 per clock per SM on sm_80/sm_90), which made the conversions, not the tensor
// cores, the decode's limit.
__device__ __forceinline__ float ds4_u8f(ds4_u32 v) {
    return __uint_as_float(0x4B000000u | v) - 8388608.0f;
}
__device__ __forceinline__ float ds4_i8f(ds4_u32 v) {
    return __uint_as_float(0x4B000000u | (v ^ 0x80u)) - 8388736.0f;
}

// One thread's share of a K step: N values k0 .. k0+N-1 (N = 32 or 16, k0 a multiple of
// N) of one weight row, first as the raw bytes of that row (`ds4_wload`, global loads
// only, so that they are in flight while the tensor cores work on the previous step), then
// decoded from those registers into f32 (`ds4_wdec`) with the same expressions (and so the
// same f32 roundings) as ds4_ops.h's ds4_elem and the CPU's ds4_gguf::quant::dequantize. One
// struct template per type; the kernel body is a template over it, so each type gets its
// own register allocation and a branch-free K loop. Every quant block here is a multiple
// of 32 values, so a piece never straddles two blocks.
//
// Where a piece of N values at k0 starts inside its group of 32 (0 for whole groups, known
// at compile time then).
template <int N> __device__ __forceinline__ int ds4_piece_off(int k0) { return N == 32 ? 0 : (int)((unsigned)k0 % 32u); }

// F32, F16, BF16 rows: 16-byte aligned (the host checks), so whole 16-byte loads; a
// byte-wise load would keep every byte in its own register across the MMAs.
template <int N> struct ds4_tw_f32 {
    uint4 r[N / 4];
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_f32<N>& t, const ds4_u8* row, int k0, int) {
    const uint4* p = (const uint4*)(row + 4 * (ds4_size)k0);
#pragma unroll
    for (int i = 0; i < N / 4; i++) t.r[i] = ds4_ldg(p + i);
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_f32<N>& t, int, float* v) {
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        v[4 * i] = __uint_as_float(t.r[i].x);
        v[4 * i + 1] = __uint_as_float(t.r[i].y);
        v[4 * i + 2] = __uint_as_float(t.r[i].z);
        v[4 * i + 3] = __uint_as_float(t.r[i].w);
    }
}

// F16 and BF16: 32-bit word i (of the uint4s) holds values 2i (low half) and 2i+1.
template <int N> struct ds4_tw_f16 {
    uint4 r[N / 8];
};
template <int N> struct ds4_tw_bf16 {
    uint4 r[N / 8];
};
template <int N> __device__ __forceinline__ void ds4_wload16(uint4* r, const ds4_u8* row, int k0) {
    const uint4* p = (const uint4*)(row + 2 * (ds4_size)k0);
#pragma unroll
    for (int i = 0; i < N / 8; i++) r[i] = ds4_ldg(p + i);
}
__device__ __forceinline__ ds4_u32 ds4_word(const uint4* r, int i) {
    const uint4 u = r[i >> 2];
    return (i & 3) == 0 ? u.x : (i & 3) == 1 ? u.y : (i & 3) == 2 ? u.z : u.w;
}
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_f16<N>& t, const ds4_u8* row, int k0, int) {
    ds4_wload16<N>(t.r, row, k0);
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_f16<N>& t, int, float* v) {
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const ds4_u32 u = ds4_word(t.r, i);
        v[2 * i] = ds4_h2f((ds4_u16)(u & 0xffff));
        v[2 * i + 1] = ds4_h2f((ds4_u16)(u >> 16));
    }
}
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_bf16<N>& t, const ds4_u8* row, int k0, int) {
    ds4_wload16<N>(t.r, row, k0);
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_bf16<N>& t, int, float* v) {
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const ds4_u32 u = ds4_word(t.r, i);
        v[2 * i] = __uint_as_float(u << 16);
        v[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
    }
}

// Q8_0 in the GPU's split layout (dequant.cu ds4_q8_0_split, docs/gpu.md §7): the row's `cols`
// int8 codes, then its cols / 32 f16 scales; rows 2-byte aligned (the host checks), so u16
// loads: the piece's N / 2 code pairs and its block's scale.
template <int N> struct ds4_tw_q8_0 {
    ds4_u32 q[N / 2];  // bytes 2i and 2i+1 of the piece
    ds4_u32 d;
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_q8_0<N>& t, const ds4_u8* row, int k0, int cols) {
    t.d = ds4_ldg((const ds4_u16*)(row + cols) + (unsigned)k0 / 32u);
    const ds4_u16* qs = (const ds4_u16*)(row + k0);
#pragma unroll
    for (int i = 0; i < N / 2; i++) t.q[i] = ds4_ldg(qs + i);
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_q8_0<N>& t, int, float* v) {
    const float d = ds4_h2f((ds4_u16)t.d);
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        v[2 * i] = d * ds4_i8f(t.q[i] & 0xff);
        v[2 * i + 1] = d * ds4_i8f((t.q[i] >> 8) & 0xff);
    }
}

// Q2_K, block of 256: scales[16] @0, qs[64] @16, d @80, dmin @82 (4-byte aligned rows).
// Values j0 .. j0+31 of a block (j0 = k0 % 256 rounded down to 32) take 2-bit field
// g = (j0 % 128) / 32 of the 32 qs bytes of half n = j0 / 128 (value i of the 32 in byte
// i), with scale byte 2g for bytes 0..15 and 2g+1 for bytes 16..31.
template <int N> struct ds4_tw_q2_k {
    ds4_u32 q[N / 4];
    ds4_u32 dm;  // d | dmin << 16
    ds4_u32 s;   // the two scale bytes
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_q2_k<N>& t, const ds4_u8* row, int k0, int) {
    const ds4_u8* b = row + (ds4_size)((unsigned)k0 / 256u) * 84;
    const unsigned j0 = (unsigned)k0 % 256u;
    const int n = (int)(j0 / 128u), g = (int)((j0 % 128u) / 32u);
    const ds4_u32* qs = (const ds4_u32*)(b + 16 + n * 32 + ds4_piece_off<N>(k0));
#pragma unroll
    for (int w = 0; w < N / 4; w++) t.q[w] = ds4_ldg(qs + w);
    t.dm = ds4_ldg((const ds4_u32*)(b + 80));
    t.s = ds4_ldg((const ds4_u16*)(b + n * 8 + 2 * g));
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_q2_k<N>& t, int k0, float* v) {
    const int g = (int)(((unsigned)k0 % 128u) / 32u), w0 = ds4_piece_off<N>(k0) / 4;
    const float d = ds4_h2f((ds4_u16)(t.dm & 0xffff)), dmin = ds4_h2f((ds4_u16)(t.dm >> 16));
    const ds4_u8 s0 = (ds4_u8)(t.s & 0xff), s1 = (ds4_u8)(t.s >> 8);
#pragma unroll
    for (int w = 0; w < N / 4; w++) {
        const ds4_u8 sc = w0 + w < 4 ? s0 : s1;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const ds4_u32 q = (t.q[w] >> (8 * c + 2 * g)) & 3;
            v[4 * w + c] = d * (float)(sc & 0xF) * ds4_u8f(q) - dmin * (float)(sc >> 4);
        }
    }
}

// Q4_K, block of 256: d @0, dmin @2, scales[12] @4, qs[128] @16 (4-byte aligned rows).
// Values 64c .. 64c+63 of a block share qs bytes 32c .. 32c+31: low nibbles, then high.
template <int N> struct ds4_tw_q4_k {
    ds4_u32 q[N / 4];
    ds4_u32 dm;    // d | dmin << 16
    ds4_u32 s[3];  // the 12 packed scale bytes
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_q4_k<N>& t, const ds4_u8* row, int k0, int) {
    const ds4_u8* b = row + (ds4_size)((unsigned)k0 / 256u) * 144;
    const int c = (int)(((unsigned)k0 % 256u) / 64u);
    const ds4_u32* qs = (const ds4_u32*)(b + 16 + c * 32 + ds4_piece_off<N>(k0));
#pragma unroll
    for (int w = 0; w < N / 4; w++) t.q[w] = ds4_ldg(qs + w);
    t.dm = ds4_ldg((const ds4_u32*)b);
#pragma unroll
    for (int i = 0; i < 3; i++) t.s[i] = ds4_ldg((const ds4_u32*)(b + 4) + i);
}
// Byte i (0..11) of the packed scales; selects rather than a register-array index.
__device__ __forceinline__ int ds4_q4k_sbyte(const ds4_u32* s, int i) {
    const ds4_u32 w = i < 4 ? s[0] : (i < 8 ? s[1] : s[2]);
    return (int)((w >> (8 * (i & 3))) & 0xff);
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_q4_k<N>& t, int k0, float* v) {
    const int j0 = (int)((unsigned)k0 % 256u), c = j0 / 64, hi = (j0 % 64) >= 32 ? 1 : 0;
    const int j = 2 * c + hi;
    // ds4_q4k_scale_min (ds4_quant.h) on the bytes in registers.
    int sc, m;
    if (j < 4) {
        sc = ds4_q4k_sbyte(t.s, j) & 63;
        m = ds4_q4k_sbyte(t.s, j + 4) & 63;
    } else {
        sc = (ds4_q4k_sbyte(t.s, j + 4) & 0xF) | ((ds4_q4k_sbyte(t.s, j - 4) >> 6) << 4);
        m = (ds4_q4k_sbyte(t.s, j + 4) >> 4) | ((ds4_q4k_sbyte(t.s, j) >> 6) << 4);
    }
    const float d = ds4_h2f((ds4_u16)(t.dm & 0xffff)), dmin = ds4_h2f((ds4_u16)(t.dm >> 16));
#pragma unroll
    for (int w = 0; w < N / 4; w++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const ds4_u32 qb = (t.q[w] >> (8 * e)) & 0xff;
            const ds4_u32 q = hi ? qb >> 4 : qb & 0xF;
            v[4 * w + e] = d * (float)sc * ds4_u8f(q) - dmin * (float)m;
        }
    }
}

// IQ2_XXS, block of 256: d @0, then per 32 values 4 grid bytes + a u32 (4 x 7-bit sign
// sets, 4-bit scale), one grid byte and sign set per 8 values. Rows are 2-byte aligned.
// The lattice and sign tables are read from global memory at decode time (2 KB + 128
// bytes, L1-resident): both shared stages of the tiles take the whole 48 KB.
template <int N> struct ds4_tw_iq2_xxs {
    ds4_u32 h[4];  // the four u16 of this group of 32
    ds4_u32 d;
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_iq2_xxs<N>& t, const ds4_u8* row, int k0, int) {
    const ds4_u8* b = row + (ds4_size)((unsigned)k0 / 256u) * 66;
    const ds4_u16* q = (const ds4_u16*)(b + 2 + (((unsigned)k0 % 256u) / 32u) * 8);
#pragma unroll
    for (int i = 0; i < 4; i++) t.h[i] = ds4_ldg(q + i);
    t.d = ds4_ldg((const ds4_u16*)b);
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_iq2_xxs<N>& t, int k0, float* v) {
    const ds4_u32 a1 = t.h[2] | (t.h[3] << 16);
    const float db = ds4_h2f((ds4_u16)t.d) * (0.5f + (float)(a1 >> 28)) * 0.25f;
    const int l0 = ds4_piece_off<N>(k0) / 8;
    ds4_u64 gv[N / 8];
    ds4_u8 signs[N / 8];
#pragma unroll
    for (int i = 0; i < N / 8; i++) {
        const int l = l0 + i;
        const ds4_u32 g2 = l < 2 ? t.h[0] : t.h[1];
        const ds4_u32 gi = (l & 1) ? g2 >> 8 : g2 & 0xff;
        gv[i] = ds4_ldg(ds4_iq2xxs_grid + gi);
        signs[i] = ds4_ldg(ds4_iq2xxs_ksigns + ((a1 >> (7 * l)) & 127));
    }
#pragma unroll
    for (int i = 0; i < N / 8; i++) {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float gf = ds4_u8f((ds4_u32)((gv[i] >> (8 * k)) & 0xff));
            v[8 * i + k] = db * gf * ((signs[i] >> k) & 1 ? -1.0f : 1.0f);
        }
    }
}

// MXFP4, block of 32 (17 bytes): an E8M0 scale byte e @0, then 16 bytes of E2M1 codes, value
// j < 16 the low nibble of byte 1 + j and j + 16 its high nibble; value 2^(e-128) kv (ggml's
// doubled E2M1 values kv, ds4_quant.h). A block starts at any byte, so the five aligned words
// that hold its 17 bytes are loaded and the bytes are picked out of them at decode; the host
// (tiles_ok) keeps the matrix 4-byte aligned and its rows a multiple of 4 bytes, so those
// words never leave the matrix. A piece of 16 values (the wide kernel) is all low or all
// high nibbles. Decoded by its ds4_tiles_store below.
template <int N> struct ds4_tw_mxfp4 {
    ds4_u32 w[5];
    ds4_u32 sh;  // the block's first byte in w[0] (0..3)
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_mxfp4<N>& t, const ds4_u8* row, int k0, int) {
    const ds4_u8* b = row + (ds4_size)((unsigned)k0 / 32u) * 17;
    t.sh = (ds4_u32)((ds4_size)b & 3u);
    const ds4_u32* p = (const ds4_u32*)(b - t.sh);
#pragma unroll
    for (int i = 0; i < 5; i++) t.w[i] = ds4_ldg(p + i);
}
// Any other type id (the host never launches one): every value NaN, so a mistake shows.
template <int N> struct ds4_tw_bad {
    ds4_u32 unused;
};
template <int N> __device__ __forceinline__ void ds4_wload(ds4_tw_bad<N>& t, const ds4_u8*, int, int) {
    t.unused = 0;
}
template <int N> __device__ __forceinline__ void ds4_wdec(const ds4_tw_bad<N>&, int, float* v) {
#pragma unroll
    for (int i = 0; i < N; i++) v[i] = __int_as_float(0x7fc00000);
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
// down projection's input in sorted order). Same expression as moe.cu's ds4_moe_act.
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

// Block shapes (both: 8 warps, acc[8][4] per thread, 128 registers, and both stages of both
// tiles (TR + TT) x 64 halves x 2 = 48 KB):
//   ds4_mm_tiles:      TR 128 rows x TT  64 tokens, warp tiles 32 x 32 (4 x 2 warps;
//                      see DS4_TILES_WM), 32 weights decoded per
//                      thread per K step
//   ds4_mm_tiles_wide: TR  64 rows x TT 128 tokens, warp tiles 32 x 32 (2 x 4 warps),
//                      16 weights decoded per thread per K step
// The wide shape decodes each weight once per 128 tokens instead of 64 (half the decode
// work per MMA). Its 32 x 32 warp tiles read 2 KB of fragments from shared memory per k16
// for their 8 MMAs, against 2.5 KB for 16 x 64 (shared-memory bandwidth, more than the
// tensor cores, bounds the MMA loop). The narrow kernel used 16 x 64 while 32 x 32 made
// ptxas spill ~100 bytes in the Q2_K / Q4_K / IQ2_XXS bodies at 128 registers (f32
// decode); see DS4_TILES_WM.

// acc += (this warp's WM rows of ws, from row wr) x (its 8 NJ tokens of xs, from token
// wt)^T over one K step, NJ = 128 / WM: acc[NJ mi + nj] is the 16 x 8 piece of rows
// wr + 16 mi, tokens wt + 8 nj.
// ws and xs are the stages' shared-memory addresses (ds4_saddr: 32-bit offsets on the GPU,
// so each fragment address is one add on a per-lane offset; docs/gpu.md §4).
template <int WM>
__device__ __forceinline__ void ds4_tiles_mma(float (*acc)[4], ds4_saddr ws, ds4_saddr xs, int wr, int wt,
                                              int lane) {
    constexpr int MI = WM / 16, NJ = 8 / MI;
#if defined(DS4_HAS_MMA)
    // ldmatrix addresses: lane l gives row l % 8 of 8x8 piece l / 8. A pieces: rows +0/+8
    // (bit 0 of the piece), k +0/+8 (bit 1) = fragment registers a[0..3]. B pieces (tokens
    // as rows, k contiguous): k +0/+8 (bit 0), tokens +0/+8 (bit 1) = b[0], b[1] of one
    // n-tile, then of the next.
    const int piece = lane >> 3;
    const int ar = wr + (lane & 7) + (piece & 1) * 8, ac = (piece >> 1) * 8;
    const int br = wt + (lane & 7) + (piece >> 1) * 8, bc = (piece & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < DS4_TK; ks += 16) {
        ds4_u32 a[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) ds4_ldmatrix_x4_at(a[mi], ws + 2 * ds4_tsw(ar + 16 * mi, ks + ac));
#pragma unroll
        for (int jj = 0; jj < NJ / 2; jj++) {
            ds4_u32 b[4];
            ds4_ldmatrix_x4_at(b, xs + 2 * ds4_tsw(br + 16 * jj, ks + bc));
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                ds4_mma_16816(acc[NJ * mi + 2 * jj], a[mi], b);
                ds4_mma_16816(acc[NJ * mi + 2 * jj + 1], a[mi], b + 2);
            }
        }
    }
#else
    // The same fragment elements as the tensor-core path, by plain FMAs (ds4_saddr is a
    // generic address here).
    const ds4_u16* const wsp = (const ds4_u16*)ws;
    const ds4_u16* const xsp = (const ds4_u16*)xs;
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int ks = 0; ks < DS4_TK; ks += 16) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int rr = wr + 16 * (j / NJ) + g + (q >> 1) * 8;
                const int tt = wt + 8 * (j % NJ) + 2 * t4 + (q & 1);
                float s = acc[j][q];
                for (int kk = 0; kk < 16; kk++)
                    s += ds4_h2f(wsp[ds4_tsw(rr, ks + kk)]) * ds4_h2f(xsp[ds4_tsw(tt, ks + kk)]);
                acc[j][q] = s;
            }
        }
    }
#endif
}

// Starts the copy of the x tile (TT tokens, halves k0 .. k0+63) into xs: TT * 8 pieces of
// 16 bytes, TT / 32 per thread (piece e = tid + 256 q: token row e / 8, halves 8 (e % 8)
// ..); `src[q]` is this thread's piece q at K 0, null past the group's tokens. Pieces past
// the tokens or `cols` are zeros.
template <int TT>
__device__ __forceinline__ void ds4_tiles_x(ds4_saddr xs, const ds4_u16* const* src, const ds4_u16* x,
                                            int cols, int k0, int tid) {
#pragma unroll
    for (int q = 0; q < TT / 32; q++) {
        const int e = tid + 256 * q, part = e & 7;
        const bool ok = src[q] != nullptr && k0 + part * 8 < cols;
        ds4_cp_async16_at(xs + 2 * ds4_tsw(e >> 3, part * 8), ok ? src[q] + k0 : x, ok);
    }
}

// Decodes this thread's raw weights (N values) into ws at row `row`, K offset koff; zeros
// where the row or the K position is past the matrix.
template <int N, class TW>
__device__ __forceinline__ void ds4_tiles_store(ds4_u16* ws, const TW& raw, int kg, bool ok, int row,
                                                int koff, ds4_saddr) {
    float v[N];
    ds4_wdec(raw, kg, v);
#pragma unroll
    for (int q = 0; q < N / 8; q++) {
        uint4 o;
        o.x = ok ? ds4_pack_h2(v[8 * q + 0], v[8 * q + 1]) : 0u;
        o.y = ok ? ds4_pack_h2(v[8 * q + 2], v[8 * q + 3]) : 0u;
        o.z = ok ? ds4_pack_h2(v[8 * q + 4], v[8 * q + 5]) : 0u;
        o.w = ok ? ds4_pack_h2(v[8 * q + 6], v[8 * q + 7]) : 0u;
        *(uint4*)(ws + ds4_tsw(row, koff + 8 * q)) = o;
    }
}

// The IQ2_XXS decode's two tables (6 KB) are read through L1 from global memory: copies in
// shared memory measured no faster (BENCHMARKS.md, session of 2026-12-06, 03:08–06:08).
#define DS4_TILES_GRID_BYTES (1024 * 4)

// The routed experts' types (IQ2_XXS gate/up, Q2_K down) decode straight into halves, with
// about half the instructions per weight of the f32 decode above and its conversions (the
// decode's issue slots, not the MMAs, were what bounded these kernels), each 8-value piece
// stored as soon as it is made (no array of the whole piece in registers). The halves are
// the same bits: tests/emulated_gpu.rs `emulated_tile_decode_is_the_dequantizer_rounded_once`.
// (Chosen by the K loop's static instruction count against the f32 decode: BENCHMARKS.md,
// the unmeasured sessions of 2026-12-05/06, "prefill (issue 21)".)

// The zeros of a piece past the matrix (its row or K position), on a branch: the decoders
// below do no decode work for it.
template <int N> __device__ __forceinline__ void ds4_tiles_zero(ds4_u16* ws, int row, int koff) {
#pragma unroll
    for (int q = 0; q < N / 8; q++) *(uint4*)(ws + ds4_tsw(row, koff + 8 * q)) = make_uint4(0u, 0u, 0u, 0u);
}

// IQ2_XXS: a lattice point's eight values come as halves from ds4_iq2xxs_grid_h, take
// their signs as half sign bits (ds4_iq2xxs_signs_h), are multiplied by (2 ls + 1) / 8 —
// exact: at most 43 x 31 = 1333 < 2^11 — and then by d: the one rounding, of the exact
// value d (0.5 + ls) 0.25 grid that ds4_wdec computes in f32 (22 bits) and rounds once.
template <int N>
__device__ __forceinline__ void ds4_tiles_store(ds4_u16* ws, const ds4_tw_iq2_xxs<N>& t, int kg, bool ok,
                                                int row, int koff, ds4_saddr tab) {
    if (!ok) return ds4_tiles_zero<N>(ws, row, koff);
    const ds4_u32 a1 = t.h[2] | (t.h[3] << 16);
    const ds4_u32 s = ds4_f2h((float)(2 * (a1 >> 28) + 1) * 0.125f);
    const ds4_u32 s2 = s | (s << 16), d2 = (t.d & 0xffffu) * 0x10001u;
    const int l0 = ds4_piece_off<N>(kg) / 8;
#pragma unroll
    for (int q = 0; q < N / 8; q++) {
        const int l = l0 + q;
        const ds4_u32 g2 = l < 2 ? t.h[0] : t.h[1];
        const ds4_u32 gi = (l & 1) ? g2 >> 8 : g2 & 0xff;
        (void)tab;
        const uint4 gv = ds4_ldg((const uint4*)ds4_iq2xxs_grid_h + gi);
        const uint4 sm = ds4_ldg((const uint4*)ds4_iq2xxs_signs_h + ((a1 >> (7 * l)) & 127));
        uint4 o;
        o.x = ds4_hmul2(ds4_hmul2(gv.x ^ sm.x, s2), d2);
        o.y = ds4_hmul2(ds4_hmul2(gv.y ^ sm.y, s2), d2);
        o.z = ds4_hmul2(ds4_hmul2(gv.z ^ sm.z, s2), d2);
        o.w = ds4_hmul2(ds4_hmul2(gv.w ^ sm.w, s2), d2);
        *(uint4*)(ws + ds4_tsw(row, koff + 8 * q)) = o;
    }
}

// Q2_K: a scale byte's 16 weights take one of four values (q = 0..3). Each is
// d sc q - dmin m with both products exact in f32 (11 + 4 + 2 and 11 + 4 significant
// bits), so it is rounded once whatever the compiler contracts — ds4_wdec's value — then
// once to half. The four halves are kept as two words, the low bytes of values 0..3 in one
// and the high bytes in the other, so that value q's half is bytes q and q + 4: with the
// 2-bit fields of four weights spread one per byte (x), x * 0x11 + 0x40404040 holds the
// byte-permute selectors of the first pair in its low 16 bits and of the second pair in its
// high 16 bits — one multiply for four weights.
template <int N>
__device__ __forceinline__ void ds4_tiles_store(ds4_u16* ws, const ds4_tw_q2_k<N>& t, int kg, bool ok,
                                                int row, int koff, ds4_saddr) {
    if (!ok) return ds4_tiles_zero<N>(ws, row, koff);
    const int g = (int)(((unsigned)kg % 128u) / 32u), w0 = ds4_piece_off<N>(kg) / 4;
    const float d = ds4_h2f((ds4_u16)(t.dm & 0xffff)), dmin = ds4_h2f((ds4_u16)(t.dm >> 16));
    ds4_u32 lut[2][2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const ds4_u8 sc = (ds4_u8)(j ? t.s >> 8 : t.s & 0xff);
        const float a = d * (float)(sc & 0xF), b = dmin * (float)(sc >> 4);
        const ds4_u32 v01 = ds4_pack_h2(a * 0.0f - b, a * 1.0f - b);
        const ds4_u32 v23 = ds4_pack_h2(a * 2.0f - b, a * 3.0f - b);
        lut[j][0] = ds4_byte_perm(v01, v23, 0x6420);  // low bytes of values 0, 1, 2, 3
        lut[j][1] = ds4_byte_perm(v01, v23, 0x7531);  // their high bytes
    }
#pragma unroll
    for (int q = 0; q < N / 8; q++) {
        // Words 2q and 2q + 1: 8 values, all under one scale byte (4 words per byte).
        const int j = w0 + 2 * q < 4 ? 0 : 1;
        const ds4_u32 sa = ((t.q[2 * q] >> (2 * g)) & 0x03030303u) * 0x11u + 0x40404040u;
        const ds4_u32 sb = ((t.q[2 * q + 1] >> (2 * g)) & 0x03030303u) * 0x11u + 0x40404040u;
        const ds4_u32 lo = lut[j][0], hi = lut[j][1];
        uint4 o;
        o.x = ds4_byte_perm(lo, hi, sa);
        o.y = ds4_byte_perm(lo, hi, sa >> 16);
        o.z = ds4_byte_perm(lo, hi, sb);
        o.w = ds4_byte_perm(lo, hi, sb >> 16);
        *(uint4*)(ws + ds4_tsw(row, koff + 8 * q)) = o;
    }
}

// MXFP4: each value is 2^(e-128) kv in f32 (exact: a power of two times a small integer,
// the CPU dequantizer's value) rounded once to half, each 8-value piece stored as soon as it
// is made (no array of the whole piece in registers). The block's code words come out of the
// five loaded words by byte permutes; |kv| is a byte permute of two words of the eight
// magnitudes by the code's low three bits (as an f32 through ds4_u8f, no int-to-float
// conversion), and the code's bit 3 is the sign bit (code 8 gives -0, which equals ggml's
// +0 as a value).
template <int N>
__device__ __forceinline__ void ds4_tiles_store(ds4_u16* ws, const ds4_tw_mxfp4<N>& t, int kg, bool ok,
                                                int row, int koff, ds4_saddr) {
    if (!ok) return ds4_tiles_zero<N>(ws, row, koff);
    // Bytes 1 + 4m .. 4 + 4m of the block (its codes) as word m; e is byte 0.
    const ds4_u32 sel = 0x3210u + 0x1111u * (t.sh + 1u);
    ds4_u32 q[4];
#pragma unroll
    for (int m = 0; m < 4; m++) q[m] = ds4_byte_perm(t.w[m], t.w[m + 1], sel);
    const float d = ds4_e8m0_half((t.w[0] >> (8u * t.sh)) & 0xffu);
    const int hi0 = ds4_piece_off<N>(kg) / 16;
#pragma unroll
    for (int p = 0; p < N / 8; p++) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int i = 8 * p + k, j = i % 16, hi = hi0 + i / 16;
            const ds4_u32 c = (q[j / 4] >> (8 * (j % 4) + 4 * hi)) & 15u;
            const float a = d * ds4_u8f(ds4_byte_perm(0x03020100u, 0x0C080604u, c & 7u));
            v[k] = __uint_as_float(__float_as_uint(a) ^ ((c & 8u) << 28));
        }
        uint4 o;
        o.x = ds4_pack_h2(v[0], v[1]);
        o.y = ds4_pack_h2(v[2], v[3]);
        o.z = ds4_pack_h2(v[4], v[5]);
        o.w = ds4_pack_h2(v[6], v[7]);
        *(uint4*)(ws + ds4_tsw(row, koff + 8 * p)) = o;
    }
}

// Warp tile rows of ds4_mm_tiles: 32 (32 x 32 warp tiles, as the wide kernel) reads 20 %
// fewer fragment bytes from shared memory per MMA than 16 (16 x 64). 16 was kept while the
// f32 decode made ptxas spill 90-140 B with 32; with the half decode of the experts' types
// the sm_90 K loop holds no local-memory access with 32 (IQ2_XXS 303 -> 283 instructions,
// 20 -> 16 ldmatrix per warp and step; BENCHMARKS.md, the unmeasured sessions of
// 2026-12-05/06, "prefill (issue 21)").
#define DS4_TILES_WM 32

// A call per weight type rather than eight inlined bodies in one function: ptxas then
// allocates registers per type (inlined, the sm_90 wide kernel spilled ~400 bytes that
// no single type needs). One call per block.
#if defined(DS4_HIP) || defined(DS4_CPU)
#define DS4_TILES_NOINLINE __forceinline__
#else
#define DS4_TILES_NOINLINE __noinline__
#endif

// One K step of ds4_tiles_run: the MMAs of stage ST while step kn's raw weights and x tile
// are in flight, then the weights decoded into stage ST ^ 1 (`wnext`). ST is a template
// argument (the caller runs the steps in pairs) so that each fragment address is a
// per-lane register plus a constant, with no per-step address arithmetic.
template <class TW, int TR, int TT, int WM, int ST>
__device__ __forceinline__ void ds4_tiles_kstep(float (*acc)[4], const ds4_u8* drow, const ds4_u16* const* xsrc,
                                                const ds4_u16* x, int cols, int kn, int koff, int drl,
                                                bool row_ok, ds4_u16* wnext, ds4_saddr wsa, ds4_saddr xsa,
                                                ds4_saddr tab, int wr, int wt, int tid) {
    constexpr int N = TR * DS4_TK / 256, WS_BYTES = TR * DS4_TK * 2, XS_BYTES = TT * DS4_TK * 2;
    const int kg = kn + koff;
    TW raw;
    ds4_wload(raw, drow, min(kg, cols - N), cols);
    ds4_tiles_x<TT>(xsa + (ST ^ 1) * XS_BYTES, xsrc, x, cols, kn, tid);
    ds4_cp_commit();
    ds4_tiles_mma<WM>(acc, wsa + ST * WS_BYTES, xsa + ST * XS_BYTES, wr, wt, tid & 31);
    ds4_tiles_store<N>(wnext, raw, kg, row_ok && kg < cols, drl, koff, tab);
    ds4_cp_wait_all();
    // Stage ST ^ 1 is complete for every thread, and every warp is done with stage ST
    // (which the next step overwrites).
    __syncthreads();
}

// The body of ds4_mm_tiles for one weight type TW<N> and block shape TR x TT. Two shared
// stages: while the tensor cores multiply stage s, the raw weights of the next K step are
// in flight into registers and its x tile into stage s ^ 1 (cp.async); after the MMAs the
// weights are decoded into stage s ^ 1, and one barrier per K step publishes it.
// Accumulation order per output is fixed (k ascending), as before.
template <class TW, int TR, int TT>
__device__ DS4_TILES_NOINLINE void ds4_tiles_run(const ds4_u8* wm, ds4_size row_bytes, int n_rows, int cols,
                                              const ds4_u16* x, int lo, int hi, float* ym,
                                              ds4_size y_stride, ds4_u16 (*ws)[TR * DS4_TK],
                                              ds4_u16 (*xs)[TT * DS4_TK], ds4_saddr tab) {
    // Weights decoded per thread per K step, and threads per row.
    constexpr int N = TR * DS4_TK / 256, TPR = DS4_TK / N;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Warp tile: WM rows from wr, 8 NJ tokens from wt (TR / WM warps along the rows).
    constexpr int WM = TR == 128 ? DS4_TILES_WM : 32, NJ = 128 / WM, WR = TR / WM;
    const int wr = (WR == 8 ? warp : warp % WR) * WM, wt = WR == 8 ? 0 : (warp / WR) * 8 * NJ;
    const int r0 = blockIdx.x * TR;
    // This thread decodes N values of row r0 + drl per K step, from K offset koff.
    const int drl = tid / TPR, koff = (tid % TPR) * N;
    const int dr = r0 + drl;
    const bool row_ok = dr < n_rows;
    const ds4_u8* drow = wm + (ds4_size)(row_ok ? dr : 0) * row_bytes;
    const int g = lane >> 2, t4 = lane & 3;
    // The stages' shared addresses for the fragment loads and the x copies.
    constexpr int WS_BYTES = TR * DS4_TK * 2, XS_BYTES = TT * DS4_TK * 2;
    const ds4_saddr wsa = ds4_saddr_of(ws[0]), xsa = ds4_saddr_of(xs[0]);
    for (int t0 = lo + (int)blockIdx.z * TT; t0 < hi; t0 += (int)gridDim.z * TT) {
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[j][q] = 0.0f;
        const ds4_u16* xsrc[TT / 32];
#pragma unroll
        for (int q = 0; q < TT / 32; q++) {
            const int e = tid + 256 * q, p = t0 + (e >> 3);
            xsrc[q] = p < hi ? x + (ds4_size)p * cols + (e & 7) * 8 : nullptr;
        }
        __syncthreads();  // the previous token tile's MMAs are done with both stages
        {
            // The first K step into stage 0 (nothing to overlap with yet). Loads stay at a
            // valid address: the K offset is clamped to the last piece of the row.
            TW raw;
            ds4_wload(raw, drow, min(koff, cols - N), cols);
            ds4_tiles_x<TT>(xsa, xsrc, x, cols, 0, tid);
            ds4_cp_commit();
            ds4_tiles_store<N>(ws[0], raw, koff, row_ok && koff < cols, drl, koff, tab);
            ds4_cp_wait_all();
            __syncthreads();
        }
        int k0 = 0;
        for (;;) {
            if (k0 + DS4_TK >= cols) {
                ds4_tiles_mma<WM>(acc, wsa, xsa, wr, wt, lane);
                break;
            }
            ds4_tiles_kstep<TW, TR, TT, WM, 0>(acc, drow, xsrc, x, cols, k0 + DS4_TK, koff, drl, row_ok,
                                               ws[1], wsa, xsa, tab, wr, wt, tid);
            k0 += DS4_TK;
            if (k0 + DS4_TK >= cols) {
                ds4_tiles_mma<WM>(acc, wsa + WS_BYTES, xsa + XS_BYTES, wr, wt, lane);
                break;
            }
            ds4_tiles_kstep<TW, TR, TT, WM, 1>(acc, drow, xsrc, x, cols, k0 + DS4_TK, koff, drl, row_ok,
                                               ws[0], wsa, xsa, tab, wr, wt, tid);
            k0 += DS4_TK;
        }
        // Fragment q of piece j: row wr + 16 (j / NJ) + g (+8 for q >= 2), token
        // wt + 8 (j % NJ) + 2t4 (+1 for odd q).
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = r0 + wr + 16 * (j / NJ) + g + (q >> 1) * 8;
                const int p = t0 + wt + 8 * (j % NJ) + 2 * t4 + (q & 1);
                if (r < n_rows && p < hi) ym[(ds4_size)p * y_stride + r] = acc[j][q];
            }
        }
    }
}

// This block's group of a tile launch (blockIdx.y: the group, in the upper half of gridDim.y
// for the second matrix): its matrix, its outputs and its tokens lo .. hi.
struct ds4_tiles_grp {
    const ds4_u8* wm;
    float* ym;
    int lo, hi;
};
__device__ __forceinline__ ds4_tiles_grp ds4_tiles_group(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes,
                                                         const int* offs, int n_tok, float* y, float* y2) {
    const int n_groups = w2 ? (int)gridDim.y / 2 : (int)gridDim.y;
    const int second = (int)blockIdx.y >= n_groups ? 1 : 0;
    const int grp = (int)blockIdx.y - second * n_groups;
    ds4_tiles_grp r;
    r.wm = (second ? w2 : w) + (ds4_size)grp * mat_bytes;
    r.ym = second ? y2 : y;
    r.lo = offs ? offs[grp] : 0;
    r.hi = offs ? offs[grp + 1] : n_tok;
    return r;
}

// The shared part of both kernels: this block's group and matrix, then the body for `ty`.
template <int TR, int TT>
__device__ __forceinline__ void ds4_tiles_block(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes,
                                                int ty, ds4_size row_bytes, int n_rows, int cols,
                                                const ds4_u16* x, const int* offs, int n_tok, float* y,
                                                float* y2, ds4_size y_stride,
                                                ds4_u16 (*ws)[TR * DS4_TK], ds4_u16 (*xs)[TT * DS4_TK],
                                                ds4_saddr tab) {
    constexpr int N = TR * DS4_TK / 256;
    const ds4_tiles_grp gr = ds4_tiles_group(w, w2, mat_bytes, offs, n_tok, y, y2);
    if (gr.lo >= gr.hi) return;
#define DS4_TILES_RUN(T) \
    ds4_tiles_run<T<N>, TR, TT>(gr.wm, row_bytes, n_rows, cols, x, gr.lo, gr.hi, gr.ym, y_stride, ws, xs, tab)
    switch (ty) {
    case DS4_T_F32: DS4_TILES_RUN(ds4_tw_f32); break;
    case DS4_T_F16: DS4_TILES_RUN(ds4_tw_f16); break;
    case DS4_T_BF16: DS4_TILES_RUN(ds4_tw_bf16); break;
    case DS4_T_Q8_0: DS4_TILES_RUN(ds4_tw_q8_0); break;
    case DS4_T_Q2_K: DS4_TILES_RUN(ds4_tw_q2_k); break;
    case DS4_T_Q4_K: DS4_TILES_RUN(ds4_tw_q4_k); break;
    case DS4_T_IQ2_XXS: DS4_TILES_RUN(ds4_tw_iq2_xxs); break;
    case DS4_T_MXFP4: DS4_TILES_RUN(ds4_tw_mxfp4); break;
    default: DS4_TILES_RUN(ds4_tw_bad);
    }
#undef DS4_TILES_RUN
}

// Y[p][r] = sum_k W_g[r][k] * X[p][k] for the tokens p of group g, every group in one
// launch: grid = (row tiles of 128, groups [x2 with a second matrix], token-tile stride).
// With `offs`, group g's tokens are offs[g] .. offs[g+1] and its matrix is at
// w + g * mat_bytes (routed experts in sorted order); without, one group of n_tok tokens.
// A second matrix (w2 / y2, same shape and type, e.g. gate and up) takes the upper half of
// gridDim.y. X is half precision, [tokens][cols], 16-byte aligned; cols is a multiple of 32.
// __launch_bounds__(256, 2): at most 128 registers, so that two blocks share an SM and one
// block's decode overlaps the other's MMAs.
extern "C" __global__ void __launch_bounds__(256, 2)
ds4_mm_tiles(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes, int ty, ds4_size row_bytes,
             int n_rows, int cols, const ds4_u16* x, const int* offs, int n_tok, float* y,
             float* y2, ds4_size y_stride) {
    ds4_grid_wait();
    __shared__ __align__(16) ds4_u16 ws[2][128 * DS4_TK];
    __shared__ __align__(16) ds4_u16 xs[2][64 * DS4_TK];
    const ds4_saddr tab = 0;
    ds4_tiles_block<128, 64>(w, w2, mat_bytes, ty, row_bytes, n_rows, cols, x, offs, n_tok, y, y2,
                             y_stride, ws, xs, tab);
}

// ds4_mm_tiles with blocks of 64 rows x 128 tokens: grid = (row tiles of 64, groups [x2],
// token-tile stride). For many tokens per group (dense matrices at prefill).
extern "C" __global__ void __launch_bounds__(256, 2)
ds4_mm_tiles_wide(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes, int ty, ds4_size row_bytes,
                  int n_rows, int cols, const ds4_u16* x, const int* offs, int n_tok, float* y,
                  float* y2, ds4_size y_stride) {
    ds4_grid_wait();
    __shared__ __align__(16) ds4_u16 ws[2][64 * DS4_TK];
    __shared__ __align__(16) ds4_u16 xs[2][128 * DS4_TK];
    const ds4_saddr tab = 0;
    ds4_tiles_block<64, 128>(w, w2, mat_bytes, ty, row_bytes, n_rows, cols, x, offs, n_tok, y, y2,
                             y_stride, ws, xs, tab);
}

// ---- Register tiles: IQ2_XXS weights decoded straight into the mma A fragments ----
//
// ds4_mm_tiles stores every decoded weight into shared memory and reads it back with
// ldmatrix: per 128 rows and K step, 16 KB stored and 64 KB of fragments read, all on the
// SM's one L1 / shared-memory data path (crates/ds4-gpu/NOTES.md, 2026-12-06). Here each
// warp decodes its own 32 rows into registers that are already the A fragments. The sum
// over K takes the K positions in any order applied to both operands; the order used gives
// lane (g, t) of every k16 MMA four consecutive values of one IQ2_XXS lattice group, so a
// decoded group (four words of two halves) is two MMAs' A registers, and the activations
// come from shared memory as one 16-byte load per lane, 8 tokens and group: for k16 step
// (sb, grp, h) of a 256-value block, fragment positions 2t + e and 2t + 8 + e (e = 0, 1)
// are block positions 32 (2t + sb) + 8 grp + 4 h + e and + 2 + e. Each lane thus decodes
// sub-blocks 2t and 2t + 1 of its rows' blocks (its raw loads are its own), and the output
// is the same sum of the same products in another order.
//
// Block: 256 threads; 256 rows (warp w: rows 32 w .. 32 w + 31, lane (g, t): rows g, g + 8,
// g + 16, g + 24) x one token tile of 64; K in blocks of 256 (cols a multiple of 256).
// Dynamic shared memory: two stages of the x tile (64 tokens x 256 halves, 32 KB each),
// then the two IQ2_XXS tables (6 KB) in DS4_RT_COPIES lane-private copies.
//
// Table copies (docs/gpu.md §22): every lane gathers two random 16-byte entries (lattice
// point, sign mask) per row and lattice group, as many shared-memory loads as the MMAs'
// activation loads, and a 16-byte load serves a quarter-warp per wavefront only when its
// eight lanes hit eight different 16-byte bank groups: random entries of one table took
// about 11 wavefronts per warp load instead of 4 (8 balls in 8 bins). Entry e of copy c sits
// at 16 (e C + c) and lane l reads copy l mod C: with C = 8 the quarter-warp's lanes always
// fall in eight different bank groups (48 KB of tables, 112 KB per block); where a block
// may not have that much (99 KB: sm_86/89/120-class parts) C = 4 halves the conflicts
// (94 KB; measured against one copy: BENCHMARKS.md, session of 2026-12-06, 09:18–12:18).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || (__CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200))
#define DS4_RT_COPIES 8
#else
#define DS4_RT_COPIES 4
#endif
#define DS4_RT_ROWS 256
#define DS4_RT_XS_BYTES (64 * 256 * 2)
#define DS4_RT_TAB_BYTES ((DS4_TILES_GRID_BYTES + 512 * 4) * DS4_RT_COPIES)
#define DS4_RT_SMEM (2 * DS4_RT_XS_BYTES + DS4_RT_TAB_BYTES)
// Dynamic shared memory and rows per block of ds4_mm_rtiles. Builds without mma.sync
// (before sm_80, HIP) compile a stub that writes NaN and advertise 0 bytes: the host
// (rtiles_for) reads that as "not in this build" and never launches it (a shared-memory
// test alone would admit it on a Volta's 96 KB).
#if defined(DS4_HAS_MMA)
extern "C" __device__ const int ds4_mm_rtiles_smem[2] = {DS4_RT_SMEM, DS4_RT_ROWS};
#else
extern "C" __device__ const int ds4_mm_rtiles_smem[2] = {0, DS4_RT_ROWS};
#endif

// Byte offset of chunk c (16 bytes, c = 0..31) of token row p in an x stage. Lanes (g, t)
// of a quarter warp read chunks 8 t + j of rows g and g + 1 (same j): the XOR with t and
// with bit 0 of the row spreads them over the eight 16-byte bank groups.
__device__ __forceinline__ ds4_u32 ds4_rt_xoff(int p, int c) {
    return (ds4_u32)(p * 512 + ((c ^ ((c >> 3) & 3) ^ ((p & 1) << 2)) << 4));
}

#if defined(DS4_HAS_MMA)

// The decoders of ds4_mm_rtiles: `load` fetches one lane's raw bytes of K block kb for its
// four rows, `group` decodes lattice group q (block positions 64 t + 8 q .. + 7) of row i
// into four words of two halves — the values ds4_tiles_store makes for those positions.
// IQ2_XXS: lane t's sub-blocks 2t and 2t + 1 (group q: sub-block 2t + q / 4, group q % 4):
// per row d, then per sub-block its grid index word and its signs / scale word.
struct ds4_rt_iq2 {
    ds4_u32 d[4];
    ds4_u32 idx[4][2], aux[4][2];
    DS4_METHOD void load(const ds4_u8* const* rowp, int kb, int t) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const ds4_u8* b = rowp[i] + (ds4_size)kb * 66;
            d[i] = ds4_ldg((const ds4_u16*)b);
#pragma unroll
            for (int sb = 0; sb < 2; sb++) {
                const ds4_u16* q = (const ds4_u16*)(b + 2 + 8 * (2 * t + sb));
                idx[i][sb] = (ds4_u32)ds4_ldg(q) | ((ds4_u32)ds4_ldg(q + 1) << 16);
                aux[i][sb] = (ds4_u32)ds4_ldg(q + 2) | ((ds4_u32)ds4_ldg(q + 3) << 16);
            }
        }
    }
    DS4_METHOD void prep(int) {}
    DS4_METHOD void group(int i, int q, bool ok, ds4_saddr tab, int, ds4_u32* w) const {
        const int sb = q >> 2, grp = q & 3;
        const ds4_u32 s = ds4_f2h((float)(2 * (aux[i][sb] >> 28) + 1) * 0.125f);
        const ds4_u32 s2 = s | (s << 16), d2 = ok ? (d[i] & 0xffffu) * 0x10001u : 0u;
        const ds4_u32 gi = (idx[i][sb] >> (8 * grp)) & 0xff;
        const ds4_u32 si = (aux[i][sb] >> (7 * grp)) & 127;
        // tab: this lane's copy (ds4_rt_tables); entries 16 C bytes apart.
        const uint4 gv = ds4_lds128(tab + 16 * DS4_RT_COPIES * gi);
        const uint4 sm = ds4_lds128(tab + DS4_TILES_GRID_BYTES * DS4_RT_COPIES + 16 * DS4_RT_COPIES * si);
        w[0] = ds4_hmul2(ds4_hmul2(gv.x ^ sm.x, s2), d2);
        w[1] = ds4_hmul2(ds4_hmul2(gv.y ^ sm.y, s2), d2);
        w[2] = ds4_hmul2(ds4_hmul2(gv.z ^ sm.z, s2), d2);
        w[3] = ds4_hmul2(ds4_hmul2(gv.w ^ sm.w, s2), d2);
    }
};

// Q2_K (block of 84 bytes, 4-byte aligned rows): lane t's positions 64 t .. 64 t + 63 lie
// in half n = t / 2 (its 32 qs bytes, 2-bit fields 2 (t % 2) and 2 (t % 2) + 1), under
// scale bytes 4 t .. 4 t + 3; group q: field 2 (t % 2) + q / 4 of qs bytes 8 (q % 4) .. + 7,
// scale byte 4 t + q / 2. The four values a scale byte allows, as in ds4_tiles_store.
// `prep` keeps only the lane's two fields, words 2j and 2j + 1 in one (low and high
// nibbles), so a block in use holds half the qs registers of one in flight.
struct ds4_rt_q2k {
    ds4_u32 qs[4][8], sc[4], dm[4];
    DS4_METHOD void load(const ds4_u8* const* rowp, int kb, int t) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const ds4_u8* b = rowp[i] + (ds4_size)kb * 84;
            const ds4_u32* q = (const ds4_u32*)(b + 16 + 32 * (t >> 1));
#pragma unroll
            for (int j = 0; j < 8; j++) qs[i][j] = ds4_ldg(q + j);
            sc[i] = ds4_ldg((const ds4_u32*)(b + 4 * t));
            dm[i] = ds4_ldg((const ds4_u32*)(b + 80));
        }
    }
    DS4_METHOD void prep(int t) {
        const int sh = 4 * (t & 1);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                qs[i][j] = ((qs[i][2 * j] >> sh) & 0x0f0f0f0fu) | (((qs[i][2 * j + 1] >> sh) & 0x0f0f0f0fu) << 4);
    }
    DS4_METHOD void group(int i, int q, bool ok, ds4_saddr, int, ds4_u32* w) const {
        const ds4_u32 sc8 = (sc[i] >> (8 * (q >> 1))) & 0xff;
        const float d = ds4_h2f((ds4_u16)(dm[i] & 0xffff)), dmin = ds4_h2f((ds4_u16)(dm[i] >> 16));
        const float a = d * (float)(sc8 & 0xF), b = dmin * (float)(sc8 >> 4);
        const ds4_u32 v01 = ds4_pack_h2(a * 0.0f - b, a * 1.0f - b);
        const ds4_u32 v23 = ds4_pack_h2(a * 2.0f - b, a * 3.0f - b);
        const ds4_u32 lo = ok ? ds4_byte_perm(v01, v23, 0x6420) : 0u;
        const ds4_u32 hi = ok ? ds4_byte_perm(v01, v23, 0x7531) : 0u;
        const int sh = 2 * (q >> 2);
        const ds4_u32 sa = ((qs[i][q & 3] >> sh) & 0x03030303u) * 0x11u + 0x40404040u;
        const ds4_u32 sbb = ((qs[i][q & 3] >> (sh + 4)) & 0x03030303u) * 0x11u + 0x40404040u;
        w[0] = ds4_byte_perm(lo, hi, sa);
        w[1] = ds4_byte_perm(lo, hi, sa >> 16);
        w[2] = ds4_byte_perm(lo, hi, sbb);
        w[3] = ds4_byte_perm(lo, hi, sbb >> 16);
    }
};

// The MMAs of one K block from x stage `xs`: for each group q, the four rows' decoded words
// (A fragments of both m16 tiles), then per 8 tokens one 16-byte load of the activations
// (B fragments of two k16 steps) and four MMAs.
template <class D>
__device__ __forceinline__ void ds4_rt_block(float (*acc)[8][4], const D& r, const bool* ok, ds4_saddr xs,
                                             ds4_saddr tab, int g, int t) {
#pragma unroll
    for (int q = 0; q < 8; q++) {
        ds4_u32 w[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) r.group(i, q, ok[i], tab, t, w[i]);
#pragma unroll
        for (int nj = 0; nj < 8; nj++) {
            const uint4 xb = ds4_lds128(xs + ds4_rt_xoff(8 * nj + g, 8 * t + q));
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const ds4_u32 b[2] = {h ? xb.z : xb.x, h ? xb.w : xb.y};
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const ds4_u32 a[4] = {w[2 * mi][2 * h], w[2 * mi + 1][2 * h], w[2 * mi][2 * h + 1],
                                          w[2 * mi + 1][2 * h + 1]};
                    ds4_mma_16816(acc[mi][nj], a, b);
                }
            }
        }
    }
}

// Starts the copy of K block kb of tokens t0 .. t0 + 63 (zeros from hi on) into the x stage
// at `xs`: this thread's chunks c = tid % 32 of token rows 8 q + tid / 32.
__device__ __forceinline__ void ds4_rt_x(ds4_saddr xs, const ds4_u16* x, int t0, int hi, int cols, int kb,
                                         int tid) {
    const int c = tid & 31;
#pragma unroll
    for (int q = 0; q < 8; q++) {
        const int p = 8 * q + (tid >> 5);
        const bool v = t0 + p < hi;
        ds4_cp_async16_at(xs + ds4_rt_xoff(p, c), v ? x + (ds4_size)(t0 + p) * cols + (ds4_size)kb * 256 + c * 8 : x,
                          v);
    }
}

// Fills DS4_RT_COPIES interleaved copies of the lattice and sign tables at `at` (entry e
// of copy c at 16 (e C + c); the lattice's 256 entries, then the signs' 128) and returns the
// address of this thread's copy; the token loop's first barrier publishes them.
__device__ __forceinline__ ds4_saddr ds4_rt_tables(unsigned char* sm, int at) {
    constexpr int C = DS4_RT_COPIES;
    uint4* tb = (uint4*)(sm + at);
    const uint4* g = (const uint4*)ds4_iq2xxs_grid_h;
    const uint4* sg = (const uint4*)ds4_iq2xxs_signs_h;
    for (int i = threadIdx.x; i < (256 + 128) * C; i += blockDim.x) {
        const int e = i / C;
        tb[i] = e < 256 ? g[e] : sg[e - 256];
    }
    return ds4_saddr_of(sm + at) + 16 * (ds4_u32)(threadIdx.x & (C - 1));
}

// The token loop of ds4_mm_rtiles for decoder D (rows rw .. rw + 31 of this warp; `bad`:
// an unsupported type, every output NaN).
template <class D>
__device__ DS4_TILES_NOINLINE void ds4_rt_run(const ds4_u8* wm, ds4_size row_bytes, int n_rows, int cols,
                                           const ds4_u16* x, int lo, int hi, float* ym, ds4_size y_stride,
                                           ds4_saddr xsa, ds4_saddr tab, bool bad) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int rw = (int)blockIdx.x * DS4_RT_ROWS + warp * 32;
    const ds4_u8* rowp[4];
    bool ok[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = rw + g + 8 * i;
        ok[i] = r < n_rows;
        rowp[i] = wm + (ds4_size)(r < n_rows ? r : 0) * row_bytes;
    }
    const int nkb = cols / 256;
    for (int t0 = lo + (int)blockIdx.z * 64; t0 < hi; t0 += (int)gridDim.z * 64) {
        float acc[2][8][4];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nj = 0; nj < 8; nj++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[mi][nj][q] = 0.0f;
        __syncthreads();  // the previous token tile is done with both stages (and the tables are in)
        D raw;
        raw.load(rowp, 0, t);
        ds4_rt_x(xsa, x, t0, hi, cols, 0, tid);
        ds4_cp_commit();
        for (int kb = 0; kb < nkb; kb++) {
            const int st = kb & 1;
            D nxt = raw;
            if (kb + 1 < nkb) {
                nxt.load(rowp, kb + 1, t);
                ds4_rt_x(xsa + (st ^ 1) * DS4_RT_XS_BYTES, x, t0, hi, cols, kb + 1, tid);
            }
            ds4_cp_commit();
            ds4_cp_wait<1>();  // stage st has landed (only the copies just issued may be in flight)
            __syncthreads();
            raw.prep(t);
            ds4_rt_block<D>(acc, raw, ok, xsa + st * DS4_RT_XS_BYTES, tab, g, t);
            __syncthreads();  // every warp is done with stage st before the next block refills it
            raw = nxt;
        }
        // acc[mi][nj][q]: row rw + 16 mi + g (+ 8 for q >= 2), token t0 + 8 nj + 2 t (+ 1 for odd q).
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
#pragma unroll
            for (int nj = 0; nj < 8; nj++) {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int r = rw + 16 * mi + g + (q >> 1) * 8;
                    const int p = t0 + 8 * nj + 2 * t + (q & 1);
                    const float v = bad ? __int_as_float(0x7fc00000) : acc[mi][nj][q];
                    if (r < n_rows && p < hi) ym[(ds4_size)p * y_stride + r] = v;
                }
            }
        }
    }
}

// Y[p][r] = sum_k W_g[r][k] X[p][k] as ds4_mm_tiles (same arguments and grid: row tiles of
// DS4_RT_ROWS, groups [x2], token-tile stride), for IQ2_XXS and Q2_K weights (any other
// type: NaN) with cols a multiple of 256 (the host checks both). __launch_bounds__(256, 1):
// up to 255 registers (64 accumulators, a block of raw weights in flight beside the one in
// use).
extern "C" __global__ void __launch_bounds__(256, 1)
ds4_mm_rtiles(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes, int ty, ds4_size row_bytes,
              int n_rows, int cols, const ds4_u16* x, const int* offs, int n_tok, float* y,
              float* y2, ds4_size y_stride) {
    ds4_grid_wait();
    DS4_DYN_SHARED(rsm, DS4_RT_SMEM);
    const ds4_saddr tab = ds4_rt_tables(rsm, 2 * DS4_RT_XS_BYTES);
    const ds4_tiles_grp gr = ds4_tiles_group(w, w2, mat_bytes, offs, n_tok, y, y2);
    if (gr.lo >= gr.hi) return;
    const ds4_saddr xsa = ds4_saddr_of(rsm);
    if (ty == DS4_T_Q2_K)
        ds4_rt_run<ds4_rt_q2k>(gr.wm, row_bytes, n_rows, cols, x, gr.lo, gr.hi, gr.ym, y_stride, xsa, tab,
                               false);
    else
        ds4_rt_run<ds4_rt_iq2>(gr.wm, row_bytes, n_rows, cols, x, gr.lo, gr.hi, gr.ym, y_stride, xsa, tab,
                               ty != DS4_T_IQ2_XXS);
}
#else
// Targets without mma.sync (HIP, NVIDIA before sm_80): a stub, every output it covers NaN.
// The host never launches it there (it needs more shared memory than those devices allow
// a block, and the tensor cores); unrolled over shuffles it cost NVRTC minutes per build.
extern "C" __global__ void __launch_bounds__(256, 1)
ds4_mm_rtiles(const ds4_u8* w, const ds4_u8* w2, ds4_size mat_bytes, int ty, ds4_size row_bytes,
              int n_rows, int cols, const ds4_u16* x, const int* offs, int n_tok, float* y,
              float* y2, ds4_size y_stride) {
    ds4_grid_wait();
    (void)w; (void)w2; (void)mat_bytes; (void)ty; (void)row_bytes; (void)cols; (void)x; (void)offs;
    (void)y2;
    const ds4_size total = (ds4_size)n_tok * y_stride;
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && n_rows > 0)
        for (ds4_size e = threadIdx.x; e < total; e += blockDim.x) y[e] = __int_as_float(0x7fc00000);
}
#endif  // DS4_HAS_MMA
