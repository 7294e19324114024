// moe_rows.cu: part of the GEMV module (gemv.cu includes it; it also compiles alone).
//
// The routed experts' matmuls at decode (docs/gpu.md §41): one warp per row, each lane
// holding the int8 codes of a fixed slice of the input in registers for all the rows it
// computes, the rows streamed into a per-warp ring of shared memory with asynchronous
// copies. The staged row engine of gemv_q8.cu reads a row's bytes and the input's codes from
// shared memory per unit (five 2-byte loads and two 16-byte input loads per IQ2_XXS group
// and row); here a lane reads its 32 row bytes as nine aligned words and never reloads the
// input, so a row costs about half the shared-memory wavefronts.
//
// Lane unit: the slice of a row one lane decodes, VALS values (IQ2_XXS: half a block, four
// groups of 32; Q2_K: the four sub-blocks sharing 16 code bytes). A row holds at most 32
// lane units (IQ2_XXS rows of at most 4096 values, Q2_K rows of at most 2048: the routed
// gate/up and down of DeepSeek V4 Flash); the host uses the staged engine for wider rows.
// Each unit's term is the staged engine's expression; a lane adds its unit's terms in order
// and the warp's lanes are summed by ds4_warp_sum, whichever block or warp takes the row,
// so a batched step's rows equal the rows of the token decoded alone bit for bit.
#pragma once
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_gemv.h"
#include "gemv_q8.cu"

// Routed-expert jobs: job p is selection p / mats, matrix p % mats (gate and up of one
// selection follow each other and share its input); expert ids[selection] of matrix m
// starts at (m ? W1 : W0) + id · expert_bytes.
struct Ds4Experts {
    const ds4_u8* W0;
    const ds4_u8* W1;
    ds4_size expert_bytes;
    const ds4_i32* ids;  // written by the router: plain loads after the grid wait
    int n_experts, n_sel, mats;
    float* y0;
    float* y1;
    int n_out;
    static constexpr bool FLAT = true;
    __device__ int count() const { return n_sel * mats; }
    __device__ int sel(int p) const { return p / mats; }
    __device__ bool ok(int p) const {
        const int id = ids[sel(p)];
        return id >= 0 && id < n_experts;
    }
    __device__ const ds4_u8* w(int p) const {
        const ds4_u8* base = p % mats ? W1 : W0;
        return base + (ok(p) ? (ds4_size)ids[sel(p)] * expert_bytes : 0);
    }
    __device__ float* y(int p) const { return (p % mats ? y1 : y0) + (ds4_size)sel(p) * n_out; }
};
// Gate and up: selection s reads row s / x_div of x (x_stride floats apart): x_div = the
// selections per token gives each token's row to its selections without copying it.
struct Ds4JobsExperts : Ds4Experts {
    const float* x;
    ds4_size x_stride;
    int x_div;
    __device__ long long key(int p) const { return sel(p) / x_div; }
    __device__ const float* input(int p) const { return x + (ds4_size)key(p) * x_stride; }
};
// Down: selection s's input is route_w[s] · SwiGLU(g, u) of its own rows (Ds4XSwiglu).
struct Ds4JobsExpertsSwiglu : Ds4Experts {
    const float* g;
    const float* u;
    const float* route_w;
    float c;
    int n_in;
    __device__ long long key(int p) const { return sel(p); }
    __device__ Ds4XSwiglu input(int p) const {
        const ds4_size off = (ds4_size)sel(p) * n_in;
        return Ds4XSwiglu{g + off, u + off, c, ds4_ld_act(route_w + sel(p))};
    }
};

// Rows each warp keeps in flight: the ring's slots (one is being computed).
#define DS4_MROWS_STAGES 4
// Widest input of this engine: 32 lane units of the widest format (IQ2_XXS, 128 values).
#define DS4_MROWS_MAX_IN 4096

// The input's int8 codes in input order (ds4_quantize_x4), at most DS4_MROWS_MAX_IN values.
struct Ds4XQRows {
    __align__(16) ds4_i8 q[DS4_MROWS_MAX_IN];
    float d[DS4_MROWS_MAX_IN / 32];
    int s16[DS4_MROWS_MAX_IN / 16];
};

// Four row bytes at a 4-byte aligned shared-memory address.
__device__ __forceinline__ ds4_u32 ds4_lds_u32(const ds4_u8* p) { return *(const ds4_u32*)p; }

// IQ2_XXS lane unit u: half h = u & 1 of block b = u >> 1, groups 4h .. 4h + 3. The unit's 32
// bytes (each group's four grid indices, then its sign word) start 2 bytes into a 4-byte word
// in even blocks (blocks are 66 bytes): read nine aligned words and shift. The values come by
// byte permutes from the selector tables (docs/gpu.md §32).
struct Ds4Iq2Lanes {
    using Tab = Ds4Iq2XxsxT<true>;
    static constexpr int BE = 256, BB = 66, VALS = 128;
    static constexpr int XW = VALS / 4;  // input code words per lane
    static constexpr int ND = 4, NS = 1;
    __device__ static Ds4Tables tables() { return Tab::prologue(); }
    __device__ static void load_x(const Ds4XQRows& x, int u, int (&xw)[XW], float (&dx)[ND],
                                  int (&)[NS]) {
        const uint4* p = (const uint4*)(x.q + VALS * u);
#pragma unroll
        for (int i = 0; i < XW / 4; ++i) {
            const uint4 v = p[i];
            xw[4 * i] = (int)v.x;
            xw[4 * i + 1] = (int)v.y;
            xw[4 * i + 2] = (int)v.z;
            xw[4 * i + 3] = (int)v.w;
        }
#pragma unroll
        for (int k = 0; k < ND; ++k) dx[k] = x.d[ND * u + k];
    }
    __device__ static float row(const ds4_u8* r, int u, const int (&xw)[XW], const float (&dx)[ND],
                                const int (&)[NS], const Ds4Tables& tb) {
        const int b = u >> 1, h = u & 1;
        const int s = BB * b + 2 + 32 * h;
        const ds4_u8* wp = r + (s & ~3);
        const unsigned sh = (unsigned)(s & 2) * 8u;
        ds4_u32 w[9];
#pragma unroll
        for (int i = 0; i < 9; ++i) w[i] = ds4_lds_u32(wp + 4 * i);
        ds4_u32 q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (ds4_u32)((((ds4_u64)w[i + 1] << 32) | w[i]) >> sh);
        const int bd = BB * b;
        const float d =
            ds4_h2f((ds4_u16)(ds4_lds_u32(r + (bd & ~3)) >> ((unsigned)(bd & 2) * 8u)));
        const unsigned es = 4u * (unsigned)tb.gstride;
        const ds4_u8* gs = (const ds4_u8*)tb.gsel;
        const ds4_u8* ss = (const ds4_u8*)tb.ssel;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const ds4_u32 aux = q[2 * k], w1 = q[2 * k + 1];
            const float db = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
            int is = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const ds4_u32 sel = *(const ds4_u32*)(gs + ((aux >> (8 * e)) & 255u) * es) |
                                    *(const ds4_u32*)(ss + ((w1 >> (7 * e)) & 127u) * es);
                const int vlo = (int)ds4_byte_perm(tb.lv_lo, tb.lv_hi, sel);
                const int vhi = (int)ds4_byte_perm(tb.lv_lo, tb.lv_hi, sel >> 16);
                is = ds4_dp4a(vhi, xw[8 * k + 2 * e + 1], ds4_dp4a(vlo, xw[8 * k + 2 * e], is));
            }
            acc += (db * dx[k]) * (float)is;
        }
        return acc;
    }
};

// Q2_K lane unit u: the four sub-blocks 8h + 2j + half (j = 0..3) of block b = u >> 2 that
// keep their codes in the same 16 bytes (h = (u >> 1) & 1, half = u & 1): Ds4Q2Kx's unit.
// Blocks are 84 bytes, so every field is 4-byte aligned.
struct Ds4Q2KLanes {
    static constexpr int BE = 256, BB = 84, VALS = 64;
    static constexpr int XW = VALS / 4;
    static constexpr int ND = 4, NS = 4;
    __device__ static Ds4Tables tables() { return Ds4Tables{nullptr, nullptr}; }
    __device__ static void load_x(const Ds4XQRows& x, int u, int (&xw)[XW], float (&dx)[ND],
                                  int (&xs)[NS]) {
        const int b = u >> 2, h = (u >> 1) & 1, half = u & 1;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int sb = 8 * h + 2 * j + half;
            const uint4 v = *(const uint4*)(x.q + BE * b + 16 * sb);
            xw[4 * j] = (int)v.x;
            xw[4 * j + 1] = (int)v.y;
            xw[4 * j + 2] = (int)v.z;
            xw[4 * j + 3] = (int)v.w;
            dx[j] = x.d[8 * b + (sb >> 1)];
            xs[j] = x.s16[16 * b + sb];
        }
    }
    __device__ static float row(const ds4_u8* r, int u, const int (&xw)[XW], const float (&dx)[ND],
                                const int (&xs)[NS], const Ds4Tables&) {
        const int b = u >> 2, h = (u >> 1) & 1, half = u & 1;
        const ds4_u8* blk = r + BB * b;
        const ds4_u32 dd = ds4_lds_u32(blk + 80);
        const float d = ds4_h2f((ds4_u16)(dd & 0xffff));
        const float dmin = ds4_h2f((ds4_u16)(dd >> 16));
        const ds4_u32 scw[2] = {ds4_lds_u32(blk + 8 * h), ds4_lds_u32(blk + 8 * h + 4)};
        const ds4_u8* qs = blk + 16 + 32 * h + 16 * half;
        ds4_u32 q[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = ds4_lds_u32(qs + 4 * i);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int sc = (int)((scw[j >> 1] >> (8 * (2 * (j & 1) + half))) & 255u);
            const int m = 0x03030303;
            int is = ds4_dp4a((int)(q[0] >> (2 * j)) & m, xw[4 * j], 0);
            is = ds4_dp4a((int)(q[1] >> (2 * j)) & m, xw[4 * j + 1], is);
            is = ds4_dp4a((int)(q[2] >> (2 * j)) & m, xw[4 * j + 2], is);
            is = ds4_dp4a((int)(q[3] >> (2 * j)) & m, xw[4 * j + 3], is);
            acc += dx[j] * (d * (float)((sc & 15) * is) - dmin * (float)((sc >> 4) * xs[j]));
        }
        return acc;
    }
};

// Row bytes of the widest row a format takes here (a ring slot), a multiple of 16.
template <class L>
__host__ __device__ constexpr int ds4_mrows_slot() {
    return (32 * L::VALS / L::BE * L::BB + 15) / 16 * 16;
}

// The engine. Rows are handed out in steps of one row per warp: step gs is rows
// (gs % nsteps)·W + warp of job gs / nsteps, and block b takes a contiguous, equal share of
// all the jobs' steps (a persistent grid of any size). Each warp copies the rows of its next
// DS4_MROWS_STAGES − 1 steps into its ring while it computes the current one. Where a share
// enters a job with another input (J::key), the block quantizes that input into shared
// memory and every lane loads its slice's codes into registers. A row whose expert id is
// out of range, or a launch outside the engine's limits, writes NaN.
template <class L, class J>
__device__ __forceinline__ void ds4_moe_rows(const J& jobs, int n_in, int n_out) {
    constexpr int S = DS4_MROWS_STAGES, SLOT = ds4_mrows_slot<L>();
    static_assert((S & (S - 1)) == 0, "stages: a power of two");
    __shared__ __align__(16) ds4_u8 ring[DS4_GEMV_WARPS][S][SLOT];
    __shared__ Ds4XQRows xbuf;
    const Ds4Tables tb = L::tables();
    const int warp = threadIdx.x / DS4_WARP;
    const int lane = threadIdx.x & (DS4_WARP - 1);
    const int nunits = n_in / L::VALS;
    const int row_bytes = n_in / L::BE * L::BB;
    const int rvec = row_bytes / 16;
    const bool fits = n_in > 0 && n_in % L::VALS == 0 && nunits <= DS4_WARP &&
                      row_bytes % 16 == 0 && tb.ok;
    const int nsteps = (n_out + DS4_GEMV_WARPS - 1) / DS4_GEMV_WARPS;
    ds4_grid_wait();  // expert ids, and the inputs, come from earlier kernels
    const ds4_size total = (ds4_size)jobs.count() * nsteps;
    const int first = (int)(total * blockIdx.x / gridDim.x);
    const int last = (int)(total * (blockIdx.x + 1) / gridDim.x);
    // Steps are walked with counters (job, row step) in two places, the copies S − 1 steps
    // ahead and the computation; a job's values (expert, validity, output) are looked up
    // where a walk enters it, so no step pays the divisions that locate a job.
    int ijob = first / nsteps, ist = first % nsteps, icur = -1, ileft = last - first;
    const ds4_u8* iw = nullptr;
    bool iok = false;
    // Queues the next step's row into the next slot; always commits a group, so that group
    // j is the j-th this thread committed.
    unsigned islot = 0;
    auto issue_next = [&]() {
        if (fits && ileft > 0) {
            if (ijob != icur) {
                icur = ijob;
                iok = jobs.ok(ijob);
                iw = jobs.w(ijob);
            }
            const int row = ist * DS4_GEMV_WARPS + warp;
            if (iok && row < n_out) {
                const ds4_u8* src = iw + (ds4_size)row * row_bytes;
                ds4_u8* dst = ring[warp][islot];
                for (int v = lane; v < rvec; v += DS4_WARP)
                    ds4_cp_async16(dst + 16 * v, src + 16 * v, true);
            }
            if (++ist == nsteps) {
                ist = 0;
                ++ijob;
            }
            --ileft;
        }
        islot = (islot + 1) & (S - 1);
        ds4_cp_commit();
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue_next();
    int xw[L::XW];
    float dx[L::ND];
    int xs[L::NS];
#pragma unroll
    for (int i = 0; i < L::XW; ++i) xw[i] = 0;
#pragma unroll
    for (int i = 0; i < L::ND; ++i) dx[i] = 0.f;
#pragma unroll
    for (int i = 0; i < L::NS; ++i) xs[i] = 0;
    long long key = -1;  // the input whose codes the lanes hold
    int mjob = first / nsteps, mst = first % nsteps, mcur = -1;
    bool mok = false;
    float* my = nullptr;
    unsigned slot = 0;
    for (int left = last - first; left > 0; --left) {
        if (mjob != mcur) {
            mcur = mjob;
            mok = fits && jobs.ok(mjob);
            my = jobs.y(mjob);
            if (fits && jobs.key(mjob) != key) {
                // Block-uniform: every warp is at the same step. The barrier keeps a warp
                // that still loads the previous codes from seeing them rewritten.
                key = jobs.key(mjob);
                __syncthreads();
                ds4_quantize_x4<false>(jobs.input(mjob), n_in, xbuf.q, xbuf.d, xbuf.s16);
                if (lane < nunits) L::load_x(xbuf, lane, xw, dx, xs);
            }
        }
        issue_next();
        ds4_cp_wait<S - 1>();
        ds4_syncwarp();  // the row bytes other lanes copied
        const int row = mst * DS4_GEMV_WARPS + warp;
        const bool act = mok && row < n_out;
        float p = 0.f;
        if (act && lane < nunits) p = L::row(ring[warp][slot], lane, xw, dx, xs, tb);
        p = ds4_warp_sum(p);
        if (lane == 0 && row < n_out) my[row] = act ? p : __int_as_float(0x7fc00000);
        ds4_syncwarp();  // this slot is refilled by a later issue
        slot = (slot + 1) & (S - 1);
        if (++mst == nsteps) {
            mst = 0;
            ++mjob;
        }
    }
    ds4_cp_wait_all();
}

// ds4_moe_rows_<t>(W0, W1, expert_bytes, ids, n_experts, n_sel, mats, x, x_stride, x_div, y0,
// y1, n_in, n_out): ds4_gemv_flat_q_<t>'s outputs (matrix m of selection s into
// (m ? y1 : y0)[s·n_out ..], selection s reading x row s / x_div) by this engine, on a
// persistent grid of any size along x. ds4_moe_rows_swiglu_<t>(W0, expert_bytes, ids,
// n_experts, n_sel, g, u, route_w, c, y0, n_in, n_out, fault): the down projection, selection
// s reading route_w[s] · SwiGLU(g, u) of its rows; a bad expert id also sets the fault bit.
// Two blocks per multiprocessor: the IQ2_XXS selector tables, the rings and the codes take
// 94 KB of shared memory per block.
#define DS4_MOE_ROWS_ENTRY(NAME, LANES)                                                          \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, 2) ds4_moe_rows_##NAME(        \
        const ds4_u8* __restrict__ W0, const ds4_u8* __restrict__ W1, ds4_size expert_bytes,    \
        const ds4_i32* ids, int n_experts, int n_sel, int mats, const float* x,                 \
        ds4_size x_stride, int x_div, float* y0, float* y1, int n_in, int n_out) {              \
        const Ds4Experts e{W0, W1, expert_bytes, ids, n_experts, n_sel, mats, y0, y1, n_out};   \
        ds4_moe_rows<LANES>(Ds4JobsExperts{e, x, x_stride, max(1, x_div)}, n_in, n_out);        \
    }                                                                                           \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, 2) ds4_moe_rows_swiglu_##NAME( \
        const ds4_u8* __restrict__ W0, ds4_size expert_bytes, const ds4_i32* ids, int n_experts, \
        int n_sel, const float* g, const float* u, const float* route_w, float c, float* y0,    \
        int n_in, int n_out, int* fault) {                                                      \
        const Ds4Experts e{W0, W0, expert_bytes, ids, n_experts, n_sel, 1, y0, y0, n_out};      \
        ds4_grid_wait();                                                                        \
        if (blockIdx.x == 0)                                                                    \
            for (int s = threadIdx.x; s < n_sel; s += blockDim.x)                               \
                if (!e.ok(s)) atomicOr(fault, DS4_FAULT_EXPERT);                          \
        ds4_moe_rows<LANES>(Ds4JobsExpertsSwiglu{e, g, u, route_w, c, n_in}, n_in, n_out);      \
    }
DS4_MOE_ROWS_ENTRY(iq2_xxs, Ds4Iq2Lanes)
DS4_MOE_ROWS_ENTRY(q2_k, Ds4Q2KLanes)
// {widest input of the IQ2_XXS lanes, of the Q2_K lanes}, read by the host after loading.
extern "C" __device__ const int ds4_moe_rows_max_in[2] = {32 * Ds4Iq2Lanes::VALS,
                                                          32 * Ds4Q2KLanes::VALS};
