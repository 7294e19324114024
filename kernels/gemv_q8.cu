// gemv_q8.cu: part of the GEMV module (gemv.cu includes it; it also compiles alone).
//
// Int8 activations: the quantization of x, the block formats' int8 units and row engines
// (single, grouped, job lists), the several-column Q8_0 kernel and the any-alignment
// kernel (the other entry points: gemv.cu).
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_gemv.h"

// ---------------------------------------------------------------------------------------
// Int8 activations (docs: int8 activations). The block's threads first quantize the input
// vector into shared memory (every block does it, identically, so no extra launch and no
// ordering between blocks), then the rows are streamed as above and each unit multiplies
// int8 codes with dp4a: integer sums are exact, so the CPU backend's integer part is
// bit-equal, and only the per-unit float scaling and the order of the float sum differ.
// Which matmuls take this path is the engine's rule (one-token matmuls of block-quantized
// weights when the backend's activation mode is q8); the host never mixes the two paths
// inside one op.
// ---------------------------------------------------------------------------------------

// Widest input the shared-memory quantization holds (DeepSeek V4 Flash's widest
// block-quantized matmul input is 8192: the attention output projection).
#define DS4_Q8_MAX_IN 8192
extern "C" __device__ const int ds4_gemvq_max_in[2] = {DS4_Q8_MAX_IN, 32};

// The shared-memory home of a quantized input (Ds4XQ points into it), one per block of the
// int8-activation kernels.
struct Ds4XQBuf {
    __align__(16) ds4_i8 q[DS4_Q8_MAX_IN];
    float d[DS4_Q8_MAX_IN / 32];
    int s16[DS4_Q8_MAX_IN / 16];
};

// max(|a|, |b|) that propagates NaN (fmaxf would drop it and hide a poisoned input).
__device__ __forceinline__ float ds4_nanmax(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

// Quantizes x[0..n) (n a multiple of 32, <= DS4_Q8_MAX_IN) into q/d/s16 with all threads of
// the block; ends with a barrier. Per block of 32: amax over the block (NaN propagates),
// d = amax / 127, q = round-half-away(x · (1 / d)) (0 when d is 0 or NaN, so that NaN shows
// in the output through d).
__device__ __forceinline__ void ds4_quantize_x(const float* __restrict__ x, int n, ds4_i8* q,
                                               float* d, int* s16) {
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int nthreads_warps = blockDim.x / DS4_WARP;
    for (int b = warp; b < n / 32; b += nthreads_warps) {
        const float v = x[b * 32 + lane];
        float amax = fabsf(v);
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) amax = ds4_nanmax(amax, ds4_shfl_xor(amax, m));
        const float db = amax / 127.0f;
        const int qi = db > 0.0f ? (int)roundf(v * (1.0f / db)) : 0;
        q[b * 32 + lane] = (ds4_i8)qi;
        int s = qi;
#pragma unroll
        for (int m = 8; m > 0; m >>= 1) s += ds4_shfl_xor_i(s, m);
        if (lane == 0) d[b] = db;
        if ((lane & 15) == 0) s16[b * 2 + (lane >> 4)] = s;
    }
    __syncthreads();
}

// Where code i of an n-code input goes in the split layout (docs/gpu.md §27): each run of 32
// 32-code units holds the first 16 codes of its units together, then their last 16 (a short
// last run of m units keeps the halves m·16 bytes apart), so lane l reading unit 32k + l
// reads consecutive 16-byte pieces. i a multiple of 4 (4 codes never straddle a half).
__device__ __forceinline__ int ds4_xsplit_at(int i, int n) {
    const int u = i >> 5, run = u >> 5, m = min(32, (n >> 5) - (run << 5));
    return (run << 10) + ((i >> 4) & 1) * (m << 4) + ((u & 31) << 4) + (i & 15);
}

// The same quantization, fast: x 16-byte aligned. Each thread owns 4 consecutive values of
// every 1024 (8 threads per block of 32) and issues all its loads before any arithmetic,
// so the whole prologue costs about one trip to L2 instead of one per block of 32.
// x: a 16-byte aligned float array, or a Ds4XSwiglu (g and u 16-byte aligned).
template <bool SPLIT = false, class XIn>
__device__ __forceinline__ void ds4_quantize_x4(const XIn& xin, int n, ds4_i8* q, float* d,
                                                int* s16) {
    constexpr int MAXIT = DS4_Q8_MAX_IN / (4 * DS4_GEMV_THREADS);
    const int t = threadIdx.x;
    const int lane = t & (DS4_WARP - 1);
    const auto x = ds4_xin_begin(xin, n);
    float4 v[MAXIT];
#pragma unroll
    for (int it = 0; it < MAXIT; ++it) {
        const int i = 4 * (t + it * DS4_GEMV_THREADS);
        v[it] = i < n ? ds4_xin4(x, i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int it = 0; it < MAXIT; ++it) {
        const int i = 4 * (t + it * DS4_GEMV_THREADS);
        if (i < n) ds4_xin_keep(x, i, v[it]);
    }
#pragma unroll
    for (int it = 0; it < MAXIT; ++it) {
        const int i = 4 * (t + it * DS4_GEMV_THREADS);
        if (4 * (it * DS4_GEMV_THREADS) >= n) break;  // uniform across the block
        const float4 f = v[it];
        float amax = ds4_nanmax(ds4_nanmax(fabsf(f.x), fabsf(f.y)),
                                ds4_nanmax(fabsf(f.z), fabsf(f.w)));
#pragma unroll
        for (int m = 4; m > 0; m >>= 1) amax = ds4_nanmax(amax, ds4_shfl_xor(amax, m));
        const float db = amax / 127.0f;
        int q0 = 0, q1 = 0, q2 = 0, q3 = 0;
        if (db > 0.0f) {
            const float id = 1.0f / db;
            q0 = (int)roundf(f.x * id);
            q1 = (int)roundf(f.y * id);
            q2 = (int)roundf(f.z * id);
            q3 = (int)roundf(f.w * id);
        }
        int sum = (q0 + q1) + (q2 + q3);
        sum += ds4_shfl_xor_i(sum, 2);
        sum += ds4_shfl_xor_i(sum, 1);
        if (i < n) {
            *(int*)(q + (SPLIT ? ds4_xsplit_at(i, n) : i)) =
                (int)(((ds4_u32)q0 & 0xff) | (((ds4_u32)q1 & 0xff) << 8) |
                                   (((ds4_u32)q2 & 0xff) << 16) | ((ds4_u32)q3 << 24));
            if ((lane & 7) == 0) d[i / 32] = db;
            if ((lane & 3) == 0) s16[i / 16] = sum;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ int ds4_ld_i32s(const ds4_i8* p) { return *(const int*)p; }
// Four weight bytes at a 2-byte aligned address (blocks of 34 and 66 bytes).
__device__ __forceinline__ int ds4_ld_w4(const ds4_u8* p) {
    return (int)((ds4_u32)ds4_ld_u16(p) | ((ds4_u32)ds4_ld_u16(p + 2) << 16));
}

// Q2_K unit with int8 activations. A sub-block of 16 values is four dp4a on its 2-bit codes
// (bit plane j of 16 code bytes); the min term uses the precomputed code sum of those 16
// activations. A unit is the four sub-blocks that share their 16 code bytes (planes
// j = 0..3 of (h, half); docs/gpu.md §33): the bytes, the scale bytes and d/dmin are read
// once for the four, where one unit per sub-block read the same 16 bytes four times (24
// shared-memory loads per row and 64 values, now 7; no faster, but no slower either:
// BENCHMARKS.md, session of 2026-12-07, 04:20–07:20). Each sub-block's term is the same
// expression in a fixed order, and the batched and one-token kernels share the unit, so they
// agree bit for bit.
struct Ds4Q2Kx : Ds4Q2K {
    static constexpr bool XSPLIT = false;
    // Units of 64 values, 4 per block; a chunk must hold a multiple of 32 units (8 blocks:
    // the routed down projection's 2048 inputs in one chunk). The host sizes warps per row
    // by the f32 chunk (ds4_gemv_config_q2_k, 12 blocks), never more parts than these.
    static constexpr int UPB = 4;
    __host__ __device__ static constexpr int cb(int R) { return R == 1 ? 16 : 8; }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 2, h = (u >> 1) & 1, half = u & 1;
        ds4_u32 q[R][4], scw[R][2];
        float d[R], dmin[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk + 80);
            d[r] = ds4_h2f((ds4_u16)(dd & 0xffff));
            dmin[r] = ds4_h2f((ds4_u16)(dd >> 16));
            // Scale bytes 8h .. 8h + 7: sub-block 8h + 2j + half is byte 2j + half.
            scw[r][0] = ds4_ld_u32(blk + 8 * h);
            scw[r][1] = ds4_ld_u32(blk + 8 * h + 4);
            const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
#pragma unroll
            for (int i = 0; i < 4; ++i) q[r][i] = ds4_ld_u32(qs + 4 * i);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int sb = 8 * h + 2 * j + half;
            const ds4_i8* xq = xc.q + b * BE + 16 * sb;
            const int x0 = ds4_ld_i32s(xq), x1 = ds4_ld_i32s(xq + 4);
            const int x2 = ds4_ld_i32s(xq + 8), x3 = ds4_ld_i32s(xq + 12);
            const float dx = xc.d[b * 8 + (sb >> 1)];
            const int xs = xc.s16[b * 16 + sb];
            // Planes 0..2 are masked in place: byte value 4^j · code (at most 48, a positive
            // signed byte), so the dp4a sum is 4^j · Σ code · x exactly and one shift of the
            // sum (exact: a multiple of 4^j) replaces a shift per word. Plane 3 (192 would not
            // fit a signed byte) is shifted down. The same integer as shifting every word.
            const ds4_u32 pm = 0x03030303u << (2 * (j < 3 ? j : 0));
            auto plane = [&](ds4_u32 w) {
                return (int)(j < 3 ? (w & pm) : ((w >> 6) & 0x03030303u));
            };
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int sc = (int)((scw[r][j >> 1] >> (8 * (2 * (j & 1) + half))) & 255u);
                int is = ds4_dp4a(plane(q[r][0]), x0, 0);
                is = ds4_dp4a(plane(q[r][1]), x1, is);
                is = ds4_dp4a(plane(q[r][2]), x2, is);
                is = ds4_dp4a(plane(q[r][3]), x3, is);
                if (j == 1 || j == 2) is >>= 2 * j;
                acc[r] += dx * (d[r] * (float)((sc & 15) * is) - dmin[r] * (float)((sc >> 4) * xs));
            }
        }
    }
};

// Q4_K unit (16 values of sub-block j): four dp4a on the 4-bit codes.
struct Ds4Q4Kx : Ds4Q4K {
    static constexpr bool XSPLIT = false;
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables,
                                float (&acc)[R]) {
        const int b = u >> 4, t = u & 15, j = t >> 1, half = t & 1;
        const ds4_i8* xq = xc.q + b * BE + 16 * t;
        const int x0 = ds4_ld_i32s(xq), x1 = ds4_ld_i32s(xq + 4);
        const int x2 = ds4_ld_i32s(xq + 8), x3 = ds4_ld_i32s(xq + 12);
        const float dx = xc.d[b * 8 + j];
        const int xs = xc.s16[b * 16 + t];
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const ds4_u32 dd = ds4_ld_u32(blk);
            const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
            const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
            const ds4_u8* sp = blk + 4;
            int sc, mn;
            ds4_q4k_scale_min(sp, j, &sc, &mn);
            const uint4 qv = *(const uint4*)(blk + 16 + 32 * (j >> 1) + 16 * half);
            const int m = 0x0f0f0f0f;
            int is = ds4_dp4a((int)(qv.x >> shift) & m, x0, 0);
            is = ds4_dp4a((int)(qv.y >> shift) & m, x1, is);
            is = ds4_dp4a((int)(qv.z >> shift) & m, x2, is);
            is = ds4_dp4a((int)(qv.w >> shift) & m, x3, is);
            acc[r] += dx * (d * (float)(sc * is) - dmin * (float)(mn * xs));
        }
    }
};

// MXFP4 unit with int8 activations: one block of 32, the CPU's q8act term
// (2^(e-128) · dx) · Σ kv · q_x exactly (docs/gpu.md §8). Four codes at a time become four
// int8 values for one dp4a through the 16-entry E2M1 table held in two byte permutes:
// the code's low 3 bits select the magnitude's byte (0, 1, 2, 3 | 4, 6, 8, 12) from one pair
// of words and the negated byte from another; bit 3 (the sign) picks between the two per
// byte. A byte's selector nibble keeps bit 3 clear (prmt would read it as sign replication).
__device__ __forceinline__ int ds4_mxfp4_kv4(ds4_u32 c) {
    const ds4_u32 m = c & 0x07070707u;
    const ds4_u32 sel = (m & 0x7u) | ((m >> 4) & 0x70u) | ((m >> 8) & 0x700u) | ((m >> 12) & 0x7000u);
    const ds4_u32 pos = ds4_byte_perm(0x03020100u, 0x0C080604u, sel);
    const ds4_u32 neg = ds4_byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);
    const ds4_u32 sign = ((c >> 3) & 0x01010101u) * 0xFFu;
    return (int)((pos & ~sign) | (neg & sign));
}
struct Ds4Mxfp4x : Ds4Mxfp4 {
    static constexpr bool XSPLIT = false;
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables,
                                float (&acc)[R]) {
        const ds4_i8* xq = xc.q + u * BE;
        int xv[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) xv[k] = ds4_ld_i32s(xq + 4 * k);
        const float dx = xc.d[u];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + u * BB;
            int is = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const ds4_u8* q = blk + 1 + 4 * k;
                const ds4_u32 w = (ds4_u32)q[0] | ((ds4_u32)q[1] << 8) | ((ds4_u32)q[2] << 16) |
                                  ((ds4_u32)q[3] << 24);
                // Low nibbles: values 4k .. 4k+3; high nibbles: values 16 + 4k ...
                is = ds4_dp4a(ds4_mxfp4_kv4(w & 0x0F0F0F0Fu), xv[k], is);
                is = ds4_dp4a(ds4_mxfp4_kv4((w >> 4) & 0x0F0F0F0Fu), xv[k + 4], is);
            }
            acc[r] += (ds4_e8m0_half(blk[0]) * dx) * (float)is;
        }
    }
};

// IQ2_XXS unit with int8 activations: one 32-value group (4 grid entries sharing the
// group's scale), the CPU's q8act term (db · dx) · Σ ±grid · q_x exactly. One unit per entry
// (8 values) read the group's scale and sign word once per 8 values (the routed gate/up
// GEMV issue-bound, ncu: BENCHMARKS.md); here once per 32. Signs are applied by linearity
// (m = 0xFF in a negated byte): Σ ±g·x = Σ g·x − 2 Σ (g & m)·x, two dp4a and one AND per
// four values (docs/gpu.md §20); the flat kernels permute signed bytes instead (§32).
//
// Tables (docs/gpu.md §20). A warp's 32 grid lookups hit random entries of one 2 KB table:
// a 64-bit shared load then replays over colliding bank pairs (≈ 6 wavefronts instead of
// 2), and ncu put the routed gate/up GEMV's L1/shared pipe far busier than its DRAM
// (BENCHMARKS.md, session of 2026-12-06, 09:18–12:18). So each table is kept in C lane-private copies interleaved entry by
// entry (entry e of copy c at e·C + c) and lane l reads copy l mod C: the 16 lanes of a
// half-warp touch 16 different bank pairs whatever entries they want, and with C = 16 every
// lookup is conflict-free. That also makes a 64-bit byte-mask table (128 sign patterns)
// cheaper than forming the masks from the 128-byte sign table with two multiplies per four
// bytes (in one shared copy it had measured slower, conflicts: docs/gpu.md §20). The
// copies live in dynamic shared memory (48 KB with C = 16: grid, then masks), which the host
// passes at launch (ds4_gemvq_iq2_smem); a launch given less reads no table and writes NaN
// rows (one kernel body: a pointer chosen between a static and a dynamic table turned every
// table load into a generic one). HIP keeps one static table and forms the masks from the
// sign table (its runtime here passes no dynamic shared memory); the CPU emulation builds that
// form too with -DDS4_EMU_ONE_TABLE, to test it. (Masks from the sign index's bits with
// integer ops only measured slower: docs/gpu.md §20.)
#if defined(DS4_HIP) || defined(DS4_EMU_ONE_TABLE)
#define DS4_IQ2_GRID_COPIES 1
#else
#define DS4_IQ2_GRID_COPIES 16
#endif
#define DS4_IQ2_MASK_TABLE (DS4_IQ2_GRID_COPIES > 1)
// The int8 unit's values by byte permutes (docs/gpu.md §32): each table entry is a 32-bit
// selector (one shared-memory wavefront per warp where a 64-bit entry took two), the
// point's levels OR the signs' bits pick each signed value out of the eight level bytes.
// Lane-private copies as above, 32 of them (a 32-bit entry's copies then fill the banks).
// Measured (BENCHMARKS.md, session of 2026-12-07, 04:20–07:20): the batched step's flat
// kernels gain, the one-token kernels lose a little, so only the flat kernels take it (the
// one-token and grouped kernels keep the 64-bit lattice and masks). Both give the same values.
#if DS4_IQ2_GRID_COPIES > 1
#define DS4_IQ2_SEL_COPIES 32
#else
#define DS4_IQ2_SEL_COPIES 1
#endif
// Dynamic shared memory of the 64-bit tables and of the selector tables; the host passes
// the larger to every int8 IQ2_XXS launch.
#define DS4_IQ2_U64_SMEM \
    (DS4_IQ2_GRID_COPIES > 1 ? (256 + (DS4_IQ2_MASK_TABLE ? 128 : 0)) * 8 * DS4_IQ2_GRID_COPIES : 0)
#define DS4_IQ2_SEL_SMEM (DS4_IQ2_GRID_COPIES > 1 ? DS4_IQ2_SEL_ENTRIES * 4 * DS4_IQ2_SEL_COPIES : 0)
#define DS4_IQ2_GRID_SMEM \
    (DS4_IQ2_U64_SMEM > DS4_IQ2_SEL_SMEM ? DS4_IQ2_U64_SMEM : DS4_IQ2_SEL_SMEM)
static_assert((DS4_IQ2_GRID_COPIES & (DS4_IQ2_GRID_COPIES - 1)) == 0 &&
                  DS4_IQ2_GRID_COPIES <= DS4_WARP,
              "grid copies: a power of two, at most a warp");
// {dynamic shared bytes the int8-activation IQ2_XXS GEMVs want, copies}, read by the host
// after loading.
extern "C" __device__ const int ds4_gemvq_iq2_smem[2] = {DS4_IQ2_GRID_SMEM, DS4_IQ2_GRID_COPIES};
// Four sign bits (bit e: negate byte e) to the byte mask 0x00/0xFF per byte: the multiply
// by 1 + 2^7 + 2^14 + 2^21 moves bit e to bit 8e with no two partial products meeting.
__device__ __forceinline__ ds4_u32 ds4_sign_mask4(ds4_u32 bits4) {
    return ((bits4 * 0x00204081u) & 0x01010101u) * 0xffu;
}
__device__ __forceinline__ ds4_u64 ds4_sign_mask8(ds4_u32 sg) {
    return (ds4_u64)ds4_sign_mask4(sg & 15u) | ((ds4_u64)ds4_sign_mask4(sg >> 4) << 32);
}
// The activation codes in the split layout (ds4_xsplit_at, docs/gpu.md §27; measured against
// input order: BENCHMARKS.md, session of 2026-12-06, 12:16–15:16).
// P: the values by byte permutes (docs/gpu.md §32), else the 64-bit lattice and masks.
template <bool P>
struct Ds4Iq2XxsxT : Ds4Iq2Xxs {
    static constexpr int UPB = 8;
    static constexpr bool XSPLIT = true;
    __device__ static Ds4Tables prologue() {
        __shared__ ds4_u8 signs[128];
        if constexpr (P) {
            return prologue_sel(signs);
        } else {
#if DS4_IQ2_GRID_COPIES > 1
            constexpr int C = DS4_IQ2_GRID_COPIES;
            DS4_DYN_SHARED(ds4_iq2_tables, DS4_IQ2_GRID_SMEM);
            ds4_u64* grid = (ds4_u64*)ds4_iq2_tables;
            ds4_u64* smask = grid + 256 * C;
            const bool given = ds4_dynamic_smem_bytes() >= (unsigned)DS4_IQ2_U64_SMEM;
            if (given) {
                for (int i = threadIdx.x; i < 256 * C; i += DS4_GEMV_THREADS)
                    grid[i] = ds4_iq2xxs_grid[i / C];
                if (DS4_IQ2_MASK_TABLE)
                    for (int i = threadIdx.x; i < 128 * C; i += DS4_GEMV_THREADS)
                        smask[i] = ds4_sign_mask8(ds4_iq2xxs_ksigns[i / C]);
            }
            for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS)
                signs[i] = (ds4_u8)ds4_iq2xxs_ksigns[i];
            __syncthreads();
            const int c = threadIdx.x & (C - 1);
            return Ds4Tables{grid + c, signs, smask + c, C, given};
#else
            __shared__ ds4_u64 grid[256];
            __shared__ ds4_u64 smask[DS4_IQ2_MASK_TABLE ? 128 : 1];
            for (int i = threadIdx.x; i < 256; i += DS4_GEMV_THREADS) grid[i] = ds4_iq2xxs_grid[i];
            for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS) {
                const ds4_u32 sg = ds4_iq2xxs_ksigns[i];
                signs[i] = (ds4_u8)sg;
                if (DS4_IQ2_MASK_TABLE) smask[i] = ds4_sign_mask8(sg);
            }
            __syncthreads();
            return Ds4Tables{grid, signs, smask, 1};
#endif
        }
    }
    // The selector tables (DS4_IQ2_PRMT): grid selectors then sign selectors, entry e's C
    // copies side by side, written four copies per 16-byte store.
    __device__ static Ds4Tables prologue_sel(ds4_u8* signs) {
        constexpr int C = DS4_IQ2_SEL_COPIES;
        for (int i = threadIdx.x; i < 128; i += DS4_GEMV_THREADS)
            signs[i] = (ds4_u8)ds4_iq2xxs_ksigns[i];
#if DS4_IQ2_SEL_COPIES > 1
        DS4_DYN_SHARED(ds4_iq2_tables, DS4_IQ2_GRID_SMEM);
        ds4_u32* gsel = (ds4_u32*)ds4_iq2_tables;
        const bool given = ds4_dynamic_smem_bytes() >= (unsigned)DS4_IQ2_SEL_SMEM;
        if (given) {
            for (int i = threadIdx.x; i < DS4_IQ2_SEL_ENTRIES * C / 4; i += DS4_GEMV_THREADS) {
                const ds4_u32 v = ds4_iq2_sel_entry(4 * i / C);
                ((uint4*)gsel)[i] = make_uint4(v, v, v, v);
            }
        }
        __syncthreads();
        const int c = threadIdx.x & (C - 1);
        const ds4_u32* lv = gsel + 384 * C + c;
        return Ds4Tables{nullptr, signs, nullptr, C, given, gsel + c, gsel + 256 * C + c,
                         given ? lv[0] : 0u, given ? lv[C] : 0u};
#else
        __shared__ ds4_u32 gsel[DS4_IQ2_SEL_ENTRIES];
        for (int i = threadIdx.x; i < DS4_IQ2_SEL_ENTRIES; i += DS4_GEMV_THREADS)
            gsel[i] = ds4_iq2_sel_entry(i);
        __syncthreads();
        return Ds4Tables{nullptr,
                         signs,
                         nullptr,
                         1,
                         true,
                         gsel,
                         gsel + 256,
                         gsel[384],
                         gsel[385]};
#endif
    }
    template <int R, int CB>
    __device__ static void unit(const ds4_u8* s, int u, const Ds4XQ xc, Ds4Tables tb,
                                float (&acc)[R]) {
        const int b = u >> 3, g = u & 7;
        // Full runs only: IQ2_XXS rows are multiples of 2048 values, and a chunk starts a run.
        const ds4_i8* xq = xc.q + ((u >> 5) << 10) + ((u & 31) << 4);
        const uint4 xa = *(const uint4*)xq, xb = *(const uint4*)(xq + 512);
        const int xv[8] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w,
                           (int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
        const float dx = xc.d[b * 8 + g];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* blk = s + r * (CB * BB) + b * BB;
            const float d = ds4_h2f(ds4_ld_u16(blk));
            const ds4_u8* gp = blk + 2 + 8 * g;
            const ds4_u32 aux = (ds4_u32)ds4_ld_w4(gp);
            const ds4_u32 w1 = (ds4_u32)ds4_ld_w4(gp + 4);
            const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
            int is = 0;
            if constexpr (P) {
                // Signed values by permuting the levels +8, +25, +43, 0 | −8, −25, −43, 0 with
                // the point's selector OR its signs' (docs/gpu.md §32): exactly the values below.
                // Entries are 4 · gstride bytes apart (this lane's copy; a stride the compiler
                // cannot fold into the lane's offset keeps the address at shift, mask, add).
                const unsigned es = 4u * (unsigned)tb.gstride;
                const ds4_u8* gs = (const ds4_u8*)tb.gsel;
                const ds4_u8* ss = (const ds4_u8*)tb.ssel;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const ds4_u32 sel = *(const ds4_u32*)(gs + ((aux >> (8 * k)) & 255u) * es) |
                                        *(const ds4_u32*)(ss + ((w1 >> (7 * k)) & 127u) * es);
                    const int vlo = (int)ds4_byte_perm(tb.lv_lo, tb.lv_hi, sel);
                    const int vhi = (int)ds4_byte_perm(tb.lv_lo, tb.lv_hi, sel >> 16);
                    is = ds4_dp4a(vhi, xv[2 * k + 1], ds4_dp4a(vlo, xv[2 * k], is));
                }
            } else {
                // Entries are 8 · gstride bytes apart (this lane's copy, docs/gpu.md §20).
                // Signs by linearity: a value is g − 2·(g & m) (m = 0xFF in a negated byte), so
                // Σ v·x = Σ g·x − 2 Σ (g & m)·x: one AND and two dp4a per four values where
                // forming the signed bytes took an XOR, an AND and an add before one dp4a.
                // The integer sum is the same, so the row is the same bits.
                const unsigned es = 8u * (unsigned)tb.gstride;
                int ns = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const ds4_u64 gv =
                        *(const ds4_u64*)((const ds4_u8*)tb.grid + ((aux >> (8 * k)) & 255u) * es);
                    const ds4_u32 si = (w1 >> (7 * k)) & 127u;
                    ds4_u32 mlo, mhi;
                    if (DS4_IQ2_MASK_TABLE) {
                        const ds4_u64 m = *(const ds4_u64*)((const ds4_u8*)tb.smask + si * es);
                        mlo = (ds4_u32)m;
                        mhi = (ds4_u32)(m >> 32);
                    } else {
                        const ds4_u32 sg = tb.signs[si];
                        mlo = ds4_sign_mask4(sg & 15u);
                        mhi = ds4_sign_mask4(sg >> 4);
                    }
                    const ds4_u32 glo = (ds4_u32)gv, ghi = (ds4_u32)(gv >> 32);
                    is = ds4_dp4a((int)ghi, xv[2 * k + 1], ds4_dp4a((int)glo, xv[2 * k], is));
                    ns = ds4_dp4a((int)(ghi & mhi), xv[2 * k + 1],
                                  ds4_dp4a((int)(glo & mlo), xv[2 * k], ns));
                }
                is -= 2 * ns;
            }
            acc[r] += (db * dx) * (float)is;
        }
    }
};
// The one-token and grouped kernels' unit, and the flat (batched) kernels'.
using Ds4Iq2XxsxOne = Ds4Iq2XxsxT<false>;
using Ds4Iq2XxsxFlat = Ds4Iq2XxsxT<true>;

// The staged row engine with int8 activations: quantize x, then as ds4_gemv_quant, but
// persistent: the host may launch fewer blocks than row groups (one wave: the routed
// experts' 12 x 128 blocks ran in ~6 waves of short-lived blocks, each paying the x
// quantization, the IQ2 tables and a full load latency with nothing to overlap), and each
// block walks row-group steps; a warp issues the loads of its next step's first chunk
// before it computes its current last chunk, so the load latency of one step hides behind
// the arithmetic of the previous one. Every row is still summed by one warp in a fixed
// order (deterministic, and the same sums as one block per step).
//
// The launch's matrices are "jobs" (J below): one for a plain GEMV, a selection x matrix
// each for the routed experts. Two ways to hand out the steps:
// - strided (J::FLAT false): grid y and z pick the job, and block b of grid x takes steps
//   b, b + gridDim.x, ... of it; the weights are known before the grid wait.
// - flat (J::FLAT true, docs/gpu.md §25): every step of every job in one sequence, and block
//   b takes a contiguous, equal share of it. A batched decode step's 96 gate/up matrices
//   on one wave of resident blocks then cost what their work costs, where the strided grid
//   (a whole number of blocks per matrix) overfilled the wave by up to a third. The input
//   is quantized again where the block's steps enter a job with another input (J::key).
// Which warp sums which row is the same either way, so the rows are the same bits.
// J gives FLAT, count(), and per job ok (valid expert), w (weights), y (outputs), input and
// key (jobs with equal keys share one quantized input).
template <class T, class J>
__device__ __forceinline__ void ds4_gemvq_jobs(const J& jobs, int n_in, int n_out, int wpr) {
    constexpr int R = T::ROWS;
    constexpr int CB = T::cb(R);
    constexpr int VEC = CB * T::BB / 16;
    constexpr int V = (VEC + DS4_WARP - 1) / DS4_WARP;
    static_assert((CB * T::BB) % 16 == 0, "chunk must be whole 16-byte vectors");
    static_assert((CB * T::UPB) % DS4_WARP == 0, "full chunk must split evenly");
    __shared__ uint4 stage[DS4_GEMV_WARPS][R * VEC];
    __shared__ Ds4XQBuf xbuf;
    ds4_i8* const xq = xbuf.q;
    float* const xd = xbuf.d;
    int* const xs = xbuf.s16;
    const Ds4Tables tb = T::prologue();
    const bool fits =
        n_in <= DS4_Q8_MAX_IN && n_in % 32 == 0 && (!T::XSPLIT || n_in % 1024 == 0);
    const bool ok = fits && tb.ok;  // each job's own validity is jobs.ok(job)
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int gpb = DS4_GEMV_WARPS / wpr;  // row groups per block step
    const int nsteps = (n_out + R * gpb - 1) / (R * gpb);
    const ds4_size row_bytes = (ds4_size)(n_in / T::BE) * T::BB;
    const int nblocks = n_in / T::BE;
    const int nchunks = (nblocks + CB - 1) / CB;
    const ds4_u8* sbytes = (const ds4_u8*)stage[warp];
    const Ds4XQ xqv{xq, xd, xs};
    // This block's steps: gs = first, first + inc, ... while gs < last (flat: job gs /
    // nsteps, row step gs % nsteps; strided: the one job's row step gs).
    int first, last, inc;
    if (J::FLAT) {
        const ds4_size total = (ds4_size)jobs.count() * nsteps;
        first = (int)(total * blockIdx.x / gridDim.x);
        last = (int)(total * (blockIdx.x + 1) / gridDim.x);
        inc = 1;
        ds4_grid_wait();  // the jobs' expert ids come from the router
    } else {
        first = blockIdx.x;
        last = nsteps;
        inc = gridDim.x;
    }
    auto job_of = [&](int gs) { return J::FLAT ? gs / nsteps : 0; };
    // Rows of step gs for this warp; false when it has none there.
    auto rows_of = [&](int gs, const ds4_u8* (&rows)[R], int& row0) -> bool {
        const int job = gs < last ? job_of(gs) : 0;
        row0 = ((J::FLAT ? gs % nsteps : gs) * gpb + warp / wpr) * R;
        const bool act = ok && gs < last && jobs.ok(job) && row0 < n_out;
        const int nvalid = act ? min(R, n_out - row0) : 1;
        const ds4_u8* W = jobs.w(job);
#pragma unroll
        for (int r = 0; r < R; ++r)
            rows[r] = W + (act ? (ds4_size)(row0 + min(r, nvalid - 1)) * row_bytes : 0);
        return act;
    };
    uint4 regs[R][V];
    int gs = first;
    const ds4_u8* rows[R];
    int row0;
    bool act = rows_of(gs, rows, row0);
    if (act && part < nchunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) ds4_load_chunk<T, CB, V>(rows[r], part, nblocks, lane, regs[r]);
    }
    // Only weights were read so far (overlapped launches, docs/gpu.md §6); the first
    // chunk's loads are in flight while x is quantized.
    ds4_grid_wait();
    long long key = -1;  // the input now in xbuf (flat grids)
    if (!J::FLAT) {
        // One input: quantized before the loop (keeps the loop's registers free).
        if (fits) ds4_quantize_x4<T::XSPLIT>(jobs.input(0), n_in, xq, xd, xs);
        else __syncthreads();
    }
    for (; gs < last; gs += inc) {
        const int job = job_of(gs);
        if (J::FLAT && fits && jobs.key(job) != key) {
            // Block-uniform: every thread is at the same step. The last step's readers of
            // xbuf passed the barrier after its rows were written.
            key = jobs.key(job);
            ds4_quantize_x4<T::XSPLIT>(jobs.input(job), n_in, xq, xd, xs);
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
        const ds4_u8* nrows[R];
        int nrow0;
        const bool nact = rows_of(gs + inc, nrows, nrow0);
        if (act) {
            for (int c = part; c < nchunks; c += wpr) {
                const int b0 = c * CB;
                const int nb = min(CB, nblocks - b0);
                ds4_stage_chunk<R, V, VEC>(stage[warp], regs, nb * T::BB / 16, lane);
                ds4_syncwarp();
                if (c + wpr < nchunks) {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        ds4_load_chunk<T, CB, V>(rows[r], c + wpr, nblocks, lane, regs[r]);
                } else if (nact) {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        ds4_load_chunk<T, CB, V>(nrows[r], part, nblocks, lane, regs[r]);
                }
                ds4_chunk_units<T, R, CB>(sbytes, nb, lane, ds4_x_at(xqv, (ds4_size)b0 * T::BE),
                                          tb, acc);
                ds4_syncwarp();
            }
        } else if (nact && part < nchunks) {
#pragma unroll
            for (int r = 0; r < R; ++r) ds4_load_chunk<T, CB, V>(nrows[r], part, nblocks, lane, regs[r]);
        }
        ds4_finish_rows<R>(acc, jobs.y(job), row0, n_out, wpr, ok && jobs.ok(job));
        // part_sums of ds4_finish_rows (several warps per row) and the flat grids' input
        // (J::key) are rewritten by the next step. With one warp per row and one input (the
        // routed experts at one token: a row of 2048 or 4096 inputs is one chunk) the warps
        // share nothing in the loop, so none waits for the block's slowest at every step.
        if (J::FLAT || wpr > 1) __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = nrows[r];
        row0 = nrow0;
        act = nact;
    }
}

// One matrix (grid y and z, if any, chosen by the entry point).
template <class XIn>
struct Ds4JobMatrix {
    static constexpr bool FLAT = false;
    const ds4_u8* W;
    XIn x;
    float* yp;
    bool okj;
    __device__ int count() const { return 1; }
    __device__ bool ok(int) const { return okj; }
    __device__ const ds4_u8* w(int) const { return W; }
    __device__ float* y(int) const { return yp; }
    __device__ const XIn& input(int) const { return x; }
    __device__ long long key(int) const { return 0; }
};
template <class T, class XIn>
__device__ __forceinline__ void ds4_gemvq_quant(const ds4_u8* __restrict__ W, const XIn& x,
                                                float* __restrict__ y, int n_in, int n_out,
                                                int wpr, bool ok) {
    ds4_gemvq_jobs<T>(Ds4JobMatrix<XIn>{W, x, y, ok}, n_in, n_out, wpr);
}

// ---------------------------------------------------------------------------------------
// Split-layout Q8_0 rows with int8 activations (docs/gpu.md §7, §8). Profiled (ncu:
// docs/history/gpu-2026-12.md), the f32-activation engine above ran its largest matrices
// with the L1/TEX pipe nearly saturated and DRAM well below the copy bandwidth: every lane
// reads 64 bytes of f32 x from L1 per 16 bytes of weights. Here each block quantizes x once into shared memory (16 bytes of
// int8 codes per 32 weights, shared by the warp's R rows) and multiplies with dp4a.
// Persistent like ds4_gemvq_quant: a block walks row-group steps blockIdx.x, +gridDim.x, ...;
// the warp's work is a flat sequence of items (a step's row group, U units of 32 codes per
// lane and row), and the loads of item j+1 are issued before item j is computed (two
// register buffers, swapped by unrolling the loop twice: copying a buffer whose loads are
// still in flight would wait for them). Unit u of a row: its 32 codes at 32·u, its f16
// scale at n_in + 2·u; the term is (d · dx) · Σ q_w q_x, the CPU backend's expression
// (ds4_gguf::quant::q8act), and each row is summed by its warps in a fixed order.
// ---------------------------------------------------------------------------------------
// Units of 32 codes per lane and row in one item: 1 measured faster than 2 (BENCHMARKS.md,
// decode program of 2026-12-03/04).
#define DS4_Q8Q_UNITS 1
#define DS4_MINB_Q_Q8_0 2
struct Ds4Q8Sx {
    static constexpr int ROWS = DS4_ROWS_Q8_0;
    static constexpr int UNITS = DS4_Q8Q_UNITS;
};

// Σ of 32 int8 weight codes (lo, hi) times 32 int8 activation codes (xa, xb): eight dp4a in
// code order (exact integer sums, as the CPU's q8act).
__device__ __forceinline__ int ds4_dot32_i8(uint4 lo, uint4 hi, uint4 xa, uint4 xb) {
    int is = ds4_dp4a((int)lo.x, (int)xa.x, 0);
    is = ds4_dp4a((int)lo.y, (int)xa.y, is);
    is = ds4_dp4a((int)lo.z, (int)xa.z, is);
    is = ds4_dp4a((int)lo.w, (int)xa.w, is);
    is = ds4_dp4a((int)hi.x, (int)xb.x, is);
    is = ds4_dp4a((int)hi.y, (int)xb.y, is);
    is = ds4_dp4a((int)hi.z, (int)xb.z, is);
    return ds4_dp4a((int)hi.w, (int)xb.w, is);
}

template <int R, int U>
struct Ds4Q8Item {
    uint4 lo[R][U], hi[R][U];
    ds4_u16 sc[R][U];
};

template <class T, class XIn>
__device__ __forceinline__ void ds4_gemvq_q8s(const ds4_u8* __restrict__ W, const XIn& x,
                                              float* __restrict__ y, int n_in, int n_out,
                                              int wpr, bool ok) {
    constexpr int R = T::ROWS, U = T::UNITS;
    __shared__ Ds4XQBuf xbuf;
    ds4_i8* const xq = xbuf.q;
    float* const xd = xbuf.d;
    int* const xs = xbuf.s16;
    const bool fits = n_in <= DS4_Q8_MAX_IN && n_in % 32 == 0;
    ok = ok && fits;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int gpb = DS4_GEMV_WARPS / wpr;  // row groups per block step
    const int nsteps = (n_out + R * gpb - 1) / (R * gpb);
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nunits = n_in / 32;
    const int stride = DS4_WARP * wpr;  // units between a lane's consecutive units
    const int nit = max(1, (nunits + U * stride - 1) / (U * stride));  // items per step
    const int my_steps = (int)blockIdx.x < nsteps ? (nsteps - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int nj = my_steps * nit;
    auto row0_of = [&](int j) { return (((int)blockIdx.x + (j / nit) * (int)gridDim.x) * gpb + warp / wpr) * R; };
    auto load = [&](int j, Ds4Q8Item<R, U>& b) {
        const int row0 = row0_of(j);
        const int it = j % nit;
        const bool act = ok && j < nj && row0 < n_out;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const ds4_u8* row = W + (act ? (ds4_size)min(row0 + r, n_out - 1) * row_bytes : 0);
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int u = part * DS4_WARP + lane + (it * U + k) * stride;
                if (act && u < nunits) {
                    b.lo[r][k] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u));
                    b.hi[r][k] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u + 16));
                    b.sc[r][k] = ds4_ldg((const ds4_u16*)(row + n_in) + u);
                }
            }
        }
    };
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    // Item j's units times the shared codes; the step's rows are written after its last item.
    auto compute = [&](int j, const Ds4Q8Item<R, U>& b) {
        const int it = j % nit;
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = part * DS4_WARP + lane + (it * U + k) * stride;
            if (u < nunits) {
                const uint4 xa = *(const uint4*)(xq + 32 * u);
                const uint4 xb = *(const uint4*)(xq + 32 * u + 16);
                const float dx = xd[u];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int is = ds4_dot32_i8(b.lo[r][k], b.hi[r][k], xa, xb);
                    acc[r] += (ds4_h2f(b.sc[r][k]) * dx) * (float)is;
                }
            }
        }
        if (it == nit - 1) {
            ds4_finish_rows<R>(acc, y, row0_of(j), n_out, wpr, ok);
            __syncthreads();  // part_sums of ds4_finish_rows are rewritten by the next step
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.f;
        }
    };
    Ds4Q8Item<R, U> b0, b1;
    load(0, b0);
    // Only weights were read so far (overlapped launches, docs/gpu.md §6); the first
    // item's loads are in flight while x is quantized.
    ds4_grid_wait();
    if (fits) ds4_quantize_x4(x, n_in, xq, xd, xs);
    else __syncthreads();
    if (!ok && my_steps > 0) {
        // A bad expert id or an input too wide: NaN rows, as the other engines.
        for (int s = 0; s < my_steps; ++s) {
            ds4_finish_rows<R>(acc, y, row0_of(s * nit), n_out, wpr, false);
            __syncthreads();
        }
        return;
    }
    for (int j = 0; j < nj; j += 2) {
        load(j + 1, b1);
        compute(j, b0);
        if (j + 1 >= nj) break;
        load(j + 2, b0);
        compute(j + 1, b1);
    }
}

// ---------------------------------------------------------------------------------------
// Split-layout Q8_0 with int8 activations for a few independent columns at once (batched
// decode: M <= DS4_Q8M_COLS tokens of different sequences, each its own one-token matmul).
// Each weight unit is loaded once and multiplied with every column's codes, so M tokens
// read the matrix once instead of M times; each column's sum is the one-token kernel's
// (same unit terms, same per-lane order, same reduction, given the same warps per row and
// DS4_Q8Q_UNITS = 1), so a batched row equals the row computed alone.
//
// The inputs arrive quantized (ds4_quantize_q8_rows, once per step: the one-token kernel's
// ds4_quantize_x4, so the same codes): each block copies its columns' codes and scales into
// shared memory instead of quantizing every column itself — with the quantization in each
// block, a launch cost the same at 8 columns whatever the matrix (BENCHMARKS.md).
// Grid y = group g (matmul_grouped's out_a: matrix g at W0 + g·w_group_bytes, writing
// y0 + g·n_out): column c of group g reads quantized row c·q_col + g (q_col = the groups).
// y holds M rows y_stride apart. Shared memory holds M * n_in <= DS4_Q8M_CODES codes.
// ---------------------------------------------------------------------------------------
// CUDA stages the codes in dynamic shared memory (docs/gpu.md §28): 64 K codes hold eight
// columns of 8192 (out_b's input), which 32 K of static memory split into two launches
// that each read the whole matrix. The host passes n_cols · n_in + 4 · n_cols · n_in / 32
// bytes; a launch given less writes NaN rows. HIP keeps the static 32 K (its runtime here
// passes no dynamic shared memory).
#if defined(DS4_HIP)
#define DS4_Q8M_DYN 0
#else
#define DS4_Q8M_DYN 1
#endif
#if DS4_Q8M_DYN
#define DS4_Q8M_CODES 65536
#else
#define DS4_Q8M_CODES 32768
#endif
extern "C" __device__ const int ds4_gemvq_cols_max[2] = {DS4_Q8M_COLS, DS4_Q8M_CODES};
// {1 when the host passes the codes' dynamic shared memory, 0}.
extern "C" __device__ const int ds4_gemvq_cols_dyn[2] = {DS4_Q8M_DYN, 0};

// Where a column's codes sit in shared memory (docs/gpu.md §24). Lane l of a warp reads unit
// u = 32·k + l, 32 codes, as two 16-byte loads; with the codes in input order the lanes' loads
// are 32 bytes apart, so each load instruction spans 1 KB and costs 8 shared wavefronts for
// 512 useful bytes. Split: ds4_xsplit_at's layout, where the lanes of one load read 512
// consecutive bytes (4 wavefronts; measured against input order: BENCHMARKS.md, session of
// 2026-12-06, 12:16–15:16). Offsets are in 16-byte vectors from the column's start.
__device__ __forceinline__ int ds4_q8m_vec(int u, int half, int nunits) {
    return ds4_xsplit_at(32 * u + 16 * half, 32 * nunits) >> 4;
}

// Item i = c·n + k of a block-strided copy as (c, k), advanced by the block size per item:
// one division at the start instead of one per item.
struct Ds4ColIdx {
    int c, k, n, dc, dk;
    __device__ Ds4ColIdx(int i, int n_, int step)
        : c(i / n_), k(i % n_), n(n_), dc(step / n_), dk(step % n_) {}
    __device__ void next() {
        c += dc;
        k += dk;
        if (k >= n) {
            k -= n;
            ++c;
        }
    }
};

// One block (DS4_GEMV_THREADS) per row r of x (n_in values, rows x_stride floats apart; n_in
// a multiple of 32, at most DS4_Q8_MAX_IN): its codes, 32-value scales and 16-code sums as
// ds4_quantize_x4 makes them inside a GEMV block, at q + r·n_in, d + r·n_in/32, s16 + r·n_in/16.
extern "C" __global__ void __launch_bounds__(DS4_GEMV_THREADS)
    ds4_quantize_q8_rows(const float* __restrict__ x, ds4_size x_stride, int n_in,
                         ds4_i8* __restrict__ q, float* __restrict__ d, int* __restrict__ s16) {
    ds4_grid_wait();
    const ds4_size r = blockIdx.x;
    if (n_in % 32 != 0 || n_in > DS4_Q8_MAX_IN) return;  // the host checks first
    ds4_quantize_x4(x + r * x_stride, n_in, q + r * (ds4_size)n_in, d + r * (ds4_size)(n_in / 32),
                    s16 + r * (ds4_size)(n_in / 16));
}

// Rows per warp of the several-column kernel (4 measured no faster than the one-token
// kernel's 2: BENCHMARKS.md, "Spreading reduction in the several-column GEMVs"): each column's
// codes, read from shared memory once per unit, serve that many rows, so more rows cut the
// shared-memory reads per weight byte (at 8 columns and two rows the kernel reads 4 bytes
// of codes from shared memory per byte of weights; docs/gpu.md §30). Rows do not change any
// row's sum (its lanes, units, order and warps' parts are the same), only which rows a warp
// takes together.
#define DS4_Q8M_ROWS DS4_ROWS_Q8_0
// Loads per thread in flight while the several-column kernel stages its codes (see there;
// 4 measured against 1: BENCHMARKS.md, session of 2026-12-07, 07:30–10:30).
#define DS4_Q8M_STAGE 4
#define DS4_MINB_Q8M DS4_MINB_Q_Q8_0
extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_Q8M)
    ds4_gemv_cols_q_q8_0(const ds4_u8* __restrict__ W0, ds4_size w_group_bytes,
                         const ds4_i8* __restrict__ xq_g, const float* __restrict__ xd_g,
                         int q_col, float* __restrict__ y0, ds4_size y_stride, int n_in,
                         int n_out, int n_cols, int wpr) {
    constexpr int R = DS4_Q8M_ROWS, MC = DS4_Q8M_COLS;
#if DS4_Q8M_DYN
    DS4_DYN_SHARED(ds4_q8m_smem, DS4_Q8M_CODES + DS4_Q8M_CODES / 8);
    ds4_i8* const xq = (ds4_i8*)ds4_q8m_smem;
    // Codes, then one f32 scale per 32 (n_cols · n_in a multiple of 32: aligned).
    const ds4_size ncodes = (ds4_size)max(0, n_cols) * (ds4_size)max(0, n_in);
    float* const xd = (float*)(ds4_q8m_smem + ncodes);
    const bool given = (ds4_size)ds4_dynamic_smem_bytes() >= ncodes + ncodes / 8;
#else
    __shared__ __align__(16) ds4_i8 xq[DS4_Q8M_CODES];
    __shared__ float xd[DS4_Q8M_CODES / 32];
    const bool given = true;
#endif
    const int g = blockIdx.y;
    const ds4_u8* const W = W0 + (ds4_size)g * w_group_bytes;
    float* const y = y0 + (ds4_size)g * n_out;
    const bool ok = n_in % 32 == 0 && n_in <= DS4_Q8_MAX_IN && n_cols >= 1 && n_cols <= MC &&
                    (ds4_size)n_cols * n_in <= DS4_Q8M_CODES && given;
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int part = warp % wpr;
    const int gpb = DS4_GEMV_WARPS / wpr;
    const int nsteps = (n_out + R * gpb - 1) / (R * gpb);
    const ds4_size row_bytes = (ds4_size)(n_in / 32) * 34;
    const int nunits = n_in / 32;
    const int stride = DS4_WARP * wpr;
    const int nit = max(1, (nunits + stride - 1) / stride);
    const int my_steps =
        (int)blockIdx.x < nsteps ? (nsteps - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int nj = ok ? my_steps * nit : 0;
    auto row0_of = [&](int j) {
        return (((int)blockIdx.x + (j / nit) * (int)gridDim.x) * gpb + warp / wpr) * R;
    };
    auto load = [&](int j, Ds4Q8Item<R, 1>& b) {
        const int row0 = row0_of(j);
        const int u = part * DS4_WARP + lane + (j % nit) * stride;
        const bool act = j < nj && row0 < n_out && u < nunits;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (act) {
                const ds4_u8* row = W + (ds4_size)min(row0 + r, n_out - 1) * row_bytes;
                b.lo[r][0] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u));
                b.hi[r][0] = ds4_ldg((const uint4*)(row + 32 * (ds4_size)u + 16));
                b.sc[r][0] = ds4_ldg((const ds4_u16*)(row + n_in) + u);
            }
        }
    };
    float acc[MC][R];
#pragma unroll
    for (int c = 0; c < MC; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[c][r] = 0.f;
    auto compute = [&](int j, const Ds4Q8Item<R, 1>& b) {
        const int u = part * DS4_WARP + lane + (j % nit) * stride;
        if (u < nunits) {
            const int vlo = ds4_q8m_vec(u, 0, nunits), vhi = ds4_q8m_vec(u, 1, nunits);
#pragma unroll
            for (int c = 0; c < MC; ++c) {
                if (c < n_cols) {
                    const uint4* xc = (const uint4*)(xq + (ds4_size)c * n_in);
                    const uint4 xa = xc[vlo];
                    const uint4 xb = xc[vhi];
                    const float dx = xd[c * (n_in / 32) + u];
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const int is = ds4_dot32_i8(b.lo[r][0], b.hi[r][0], xa, xb);
                        acc[c][r] += (ds4_h2f(b.sc[r][0]) * dx) * (float)is;
                    }
                }
            }
        }
        if (j % nit == nit - 1) {
            ds4_finish_cols<R, MC>(acc, y, y_stride, row0_of(j), n_out, wpr, n_cols);
            __syncthreads();  // the parts are rewritten by the next step
#pragma unroll
            for (int c = 0; c < MC; ++c)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[c][r] = 0.f;
        }
    };
    Ds4Q8Item<R, 1> b0, b1;
    load(0, b0);
    ds4_grid_wait();  // only weights were read so far (docs/gpu.md §6)
    if (ok) {
        // The columns' codes and scales, written by the previous launch (coherent loads),
        // DS4_Q8M_STAGE loads per thread in flight before the first store: a loop of one
        // load and one store waited one L2 round trip per 4 KB of codes (8 codes trips and
        // 4 scale trips per block at 8 columns of 4096), with only the first weights in
        // flight meanwhile (docs/gpu.md §35).
        const int v16 = n_in / 16, nb = n_in / 32;
        const int ncv = n_cols * v16, ncs = n_cols * nb;
        // (column, index) of the thread's items, stepped without a division per item.
        const int bd = blockDim.x;
        Ds4ColIdx cv{(int)threadIdx.x, v16, bd}, cs{(int)threadIdx.x, nb, bd};
        for (int i0 = threadIdx.x; i0 < ncv; i0 += DS4_Q8M_STAGE * bd) {  // ncs = ncv / 2
            uint4 v[DS4_Q8M_STAGE];
            float f[DS4_Q8M_STAGE];
            Ds4ColIdx lv = cv, ls = cs;
#pragma unroll
            for (int k = 0; k < DS4_Q8M_STAGE; ++k) {
                const int i = i0 + k * bd;
                if (i < ncv)
                    v[k] = ds4_ld_act((const uint4*)xq_g + ((ds4_size)lv.c * q_col + g) * v16 + lv.k);
                if (i < ncs) f[k] = ds4_ld_act(xd_g + ((ds4_size)ls.c * q_col + g) * nb + ls.k);
                lv.next();
                ls.next();
            }
#pragma unroll
            for (int k = 0; k < DS4_Q8M_STAGE; ++k) {
                const int i = i0 + k * bd;
                if (i < ncv) ((uint4*)xq)[cv.c * v16 + ds4_q8m_vec(cv.k >> 1, cv.k & 1, nb)] = v[k];
                if (i < ncs) xd[i] = f[k];
                cv.next();
                cs.next();
            }
        }
        __syncthreads();
    } else {
        // Unsupported shape: NaN rows (the host checks first), as the other engines.
        for (int s = 0; s < my_steps; ++s)
            for (int c = 0; c < max(1, min(n_cols, MC)); ++c) {
                float z[R] = {};
                ds4_finish_rows<R>(z, y + (ds4_size)c * y_stride, row0_of(s * nit), n_out, wpr,
                                   false);
                __syncthreads();
            }
        return;
    }
    for (int j = 0; j < nj; j += 2) {
        load(j + 1, b1);
        compute(j, b0);
        if (j + 1 >= nj) break;
        load(j + 2, b0);
        compute(j + 1, b1);
    }
}

// ---------------------------------------------------------------------------------------
// Int8 activations for any row alignment (the tiny models' rows are not 16-byte
// multiples): one warp per row, each lane one 32-value unit at a time read byte-wise from
// global memory. The per-unit terms are written exactly as the CPU backend's
// (ds4_gguf::quant::q8act): same integer sums, same float expression.
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ float ds4_f16_at(const ds4_u8* p) {
    return ds4_h2f((ds4_u16)((ds4_u32)p[0] | ((ds4_u32)p[1] << 8)));
}

// Term of 32-value unit u of a row of n_in values of type `ty` (DS4_T_Q8_0 in the split
// layout, DS4_T_Q2_K, DS4_T_Q4_K, DS4_T_MXFP4 or IQ2_XXS; the types
// ds4_gguf::quant::q8act::applies names).
__device__ float ds4_q8_unit_term(int ty, const ds4_u8* row, int n_in, int u, const ds4_i8* xq,
                                  const float* xd, const ds4_u64* grid, const ds4_u8* ksigns) {
    const float dx = xd[u];
    const ds4_i8* x = xq + 32 * u;
    const int b = u >> 3, i = u & 7;
    if (ty == DS4_T_Q8_0) {
        const ds4_u8* c = row + 32 * u;
        int is = 0;
        for (int m = 0; m < 32; ++m) is += (int)(ds4_i8)c[m] * (int)x[m];
        return (ds4_f16_at(row + n_in + 2 * u) * dx) * (float)is;
    }
    if (ty == DS4_T_Q2_K) {
        const ds4_u8* blk = row + 84 * b;
        const float d = ds4_f16_at(blk + 80), dmin = ds4_f16_at(blk + 82);
        int A = 0, B = 0;
        for (int half = 0; half < 2; ++half) {
            const int sb = 2 * i + half;
            const int h = sb >> 3, j = (sb >> 1) & 3;
            const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
            int is = 0, xs = 0;
            for (int m = 0; m < 16; ++m) {
                is += (int)((qs[m] >> (2 * j)) & 3) * (int)x[16 * half + m];
                xs += (int)x[16 * half + m];
            }
            A += (int)(blk[sb] & 15) * is;
            B += (int)(blk[sb] >> 4) * xs;
        }
        return dx * (d * (float)A - dmin * (float)B);
    }
    if (ty == DS4_T_Q4_K) {
        const ds4_u8* blk = row + 144 * b;
        const float d = ds4_f16_at(blk), dmin = ds4_f16_at(blk + 2);
        const ds4_u8* sp = blk + 4;
        const int j = i;
        int sc, mn;
        ds4_q4k_scale_min(sp, j, &sc, &mn);
        const ds4_u8* qs = blk + 16 + 32 * (j >> 1);
        int is = 0, xs = 0;
        for (int m = 0; m < 32; ++m) {
            is += (int)((qs[m] >> (4 * (j & 1))) & 15) * (int)x[m];
            xs += (int)x[m];
        }
        return dx * (d * (float)(sc * is) - dmin * (float)(mn * xs));
    }
    if (ty == DS4_T_MXFP4) {
        const ds4_u8* blk = row + 17 * u;
        int is = 0;
        for (int m = 0; m < 16; ++m)
            is += ds4_mxfp4_kv(blk[1 + m] & 15u) * (int)x[m] + ds4_mxfp4_kv(blk[1 + m] >> 4) * (int)x[16 + m];
        return (ds4_e8m0_half(blk[0]) * dx) * (float)is;
    }
    // IQ2_XXS: group i of block b.
    const ds4_u8* blk = row + 66 * b;
    const float d = ds4_f16_at(blk);
    const ds4_u8* gp = blk + 2 + 8 * i;
    const ds4_u32 w1 = (ds4_u32)gp[4] | ((ds4_u32)gp[5] << 8) | ((ds4_u32)gp[6] << 16) |
                       ((ds4_u32)gp[7] << 24);
    const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
    int is = 0;
    for (int k = 0; k < 4; ++k) {
        const ds4_u64 g = grid[gp[k]];
        const ds4_u32 sg = ksigns[(w1 >> (7 * k)) & 127];
        for (int e = 0; e < 8; ++e) {
            const int v = (int)((g >> (8 * e)) & 0xff);
            is += (((sg >> e) & 1u) ? -v : v) * (int)x[8 * k + e];
        }
    }
    return (db * dx) * (float)is;
}

// y[n_out] = W · q8(x): grid x = ceil(n_out / 8) blocks of 256 threads, one warp per row.
extern "C" __global__ void __launch_bounds__(DS4_GEMV_THREADS)
    ds4_gemvq_generic(const ds4_u8* __restrict__ W, int ty, ds4_size row_bytes,
                      const float* __restrict__ x, float* __restrict__ y, int n_in, int n_out) {
    ds4_grid_wait();
    __shared__ Ds4XQBuf xbuf;
    ds4_i8* const xq = xbuf.q;
    float* const xd = xbuf.d;
    int* const xs = xbuf.s16;
    __shared__ ds4_u64 grid[256];
    __shared__ ds4_u8 ksigns[128];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) grid[i] = ds4_iq2xxs_grid[i];
    for (int i = threadIdx.x; i < 128; i += blockDim.x) ksigns[i] = ds4_iq2xxs_ksigns[i];
    const bool ok = n_in <= DS4_Q8_MAX_IN && n_in % 32 == 0;
    if (ok) ds4_quantize_x(x, n_in, xq, xd, xs);
    else __syncthreads();
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int row = blockIdx.x * DS4_GEMV_WARPS + warp;
    if (row >= n_out) return;
    float acc = 0.f;
    if (ok) {
        const ds4_u8* r = W + (ds4_size)row * row_bytes;
        for (int u = lane; u < n_in / 32; u += DS4_WARP)
            acc += ds4_q8_unit_term(ty, r, n_in, u, xq, xd, grid, ksigns);
    }
    acc = ds4_warp_sum(acc);
    if (lane == 0) y[row] = ok ? acc : __int_as_float(0x7fc00000);
}
