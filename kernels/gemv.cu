// gemv.cu: batch-1 matrix-vector products y = W x for every ds4 weight type.
//
// W is a row-major [n_out][n_in] matrix in ggml layout: one row of n_in elements is n_in/BE
// consecutive blocks of the row's type. x and y are f32. Accumulation is f32 throughout.
//
// Work split. A block of 256 threads holds 8 logical warps. One warp computes R
// consecutive rows (R = T::ROWS per block format, DS4_GEMV_PLAIN_ROWS for F16/F32),
// so each x value it loads serves R rows. `wpr` warps (1, 2, 4 or 8, chosen by the host so
// that small-n_out matrices still fill the GPU) share one group of R rows: the rows are cut
// into chunks and warp `part` takes chunks part, part+wpr, ... . Partial sums are reduced
// with warp shuffles, then across the group's warps through shared memory, and exactly one
// thread writes each y[row]. Every row < n_out is written on every launch, also when its
// inputs are invalid (then with NaN), so a poisoned output buffer shows any row missed.
//
// Memory access. Rows of the block formats are streamed in chunks of CB blocks whose byte
// size is a multiple of 16: each lane issues 16-byte loads (consecutive lanes, consecutive
// addresses), the chunk is staged in the warp's slice of shared memory, and lanes decode
// "units" (8 or 16 consecutive elements of one block) from there. The next chunk's loads
// are issued before the current chunk is decoded, so a warp keeps ~2 KB in flight. F16
// and F32 rows need no staging: a 16-byte vector holds whole elements.
//
// Host contract (checked in Rust before every launch): n_in is a multiple of the type's
// block size and the row size in bytes is a multiple of 16; W, x and y are 16-byte aligned
// and hold n_out rows, n_in and n_out floats.
//
// This file is the GEMV module: the one program (NVRTC, hiprtc, the CPU emulation) made of
// the files it includes, in this order, and of the entry points below, which instantiate
// their engines. Each included file also compiles alone; what they share lives in
// ds4_gemv.h, whose constants reach all of them.
#include "ds4_gemv.h"
#include "gemv_plain.cu"
#include "gemv_quant.cu"
#include "gemv_q8.cu"

// Launch configuration compiled into this module, read by the host after loading:
// {rows per warp, blocks per chunk (plain types: vectors per lane pass = 32)}.
#define DS4_GEMV_CONFIG(NAME, ROWS, CB) \
    extern "C" __device__ const int ds4_gemv_config_##NAME[2] = {ROWS, CB};
DS4_GEMV_CONFIG(f32, DS4_GEMV_PLAIN_ROWS, 32)
DS4_GEMV_CONFIG(f16, DS4_GEMV_PLAIN_ROWS, 32)
DS4_GEMV_CONFIG(q8_0, Ds4Q8S::ROWS, 16)
DS4_GEMV_CONFIG(q2_k, Ds4Q2K::ROWS, Ds4Q2K::cb(Ds4Q2K::ROWS))
DS4_GEMV_CONFIG(q4_k, Ds4Q4K::ROWS, Ds4Q4K::cb(Ds4Q4K::ROWS))
DS4_GEMV_CONFIG(iq2_xxs, Ds4Iq2Xxs::ROWS, Ds4Iq2Xxs::cb(Ds4Iq2Xxs::ROWS))
DS4_GEMV_CONFIG(mxfp4, Ds4Mxfp4::ROWS, Ds4Mxfp4::cb(Ds4Mxfp4::ROWS))

// ---------------------------------------------------------------------------------------
// Entry points. Grid: x = ceil(n_out / (R * 8 / wpr)) blocks of 256 threads, R the
// rows per warp of ds4_gemv_config_<t>.
//
// ds4_gemv_<t>(W, x, y, n_in, n_out, wpr): y[n_out] = W[n_out][n_in] · x[n_in].
//
// ds4_gemv_grouped_<t>(W0, W1, expert_bytes, ids, n_experts, x, x_stride, y0, y1, n_in,
// n_out, wpr): routed experts. Grid y = selection s (n_sel), grid z = matrix m (1 or 2).
// Expert e of matrix m starts at (m ? W1 : W0) + e·expert_bytes; with e = ids[s]:
// (m ? y1 : y0)[s·n_out + r] = row r of that expert · x[s·x_stride ..]. x_stride = 0
// shares one x (gate and up); x_stride = n_in gives each selection its own input (down).
// An id outside [0, n_experts) makes that selection's outputs NaN instead of reading out
// of bounds.
// ---------------------------------------------------------------------------------------

#define DS4_GEMV_ENTRY(NAME, ENGINE, FMT, MINB)                                                 \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                   \
        ds4_gemv_##NAME(const ds4_u8* __restrict__ W, const float* __restrict__ x,          \
                        float* __restrict__ y, int n_in, int n_out, int wpr) {              \
        ENGINE<FMT>(W, x, y, n_in, n_out, wpr, true);                                       \
    }                                                                                       \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                   \
        ds4_gemv_grouped_##NAME(const ds4_u8* __restrict__ W0, const ds4_u8* __restrict__ W1, \
                                ds4_size expert_bytes, const ds4_i32* __restrict__ ids,     \
                                int n_experts, const float* __restrict__ x,                 \
                                ds4_size x_stride, float* __restrict__ y0,                  \
                                float* __restrict__ y1, int n_in, int n_out, int wpr) {     \
        ds4_grid_wait(); /* the ids come from the router */                                 \
        const int sel = blockIdx.y;                                                         \
        const int id = ids[sel];                                                            \
        const bool ok = id >= 0 && id < n_experts;                                          \
        const ds4_u8* base = blockIdx.z ? W1 : W0;                                          \
        const ds4_u8* W = base + (ok ? (ds4_size)id * expert_bytes : 0);                    \
        float* y = (blockIdx.z ? y1 : y0) + (ds4_size)sel * n_out;                          \
        ENGINE<FMT>(W, x + (ds4_size)sel * x_stride, y, n_in, n_out, wpr, ok);              \
    }

DS4_GEMV_ENTRY(f32, ds4_gemv_plain, Ds4F32, DS4_MINB_PLAIN)
DS4_GEMV_ENTRY(f16, ds4_gemv_plain, Ds4F16, DS4_MINB_PLAIN)

// The router's matmul and the router for one token in one launch (docs/gpu.md §17): the F16
// GEMV of ds4_gemv_f16 writes the logits row y, then every block fences and counts itself in
// *counter; the block that completes the count resets it for the next launch and runs the
// router (ds4_router_token, what ds4_router_warp runs) on y with its first warp.
extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_PLAIN)
    ds4_gemv_router_f16(const ds4_u8* __restrict__ W, const float* __restrict__ x, float* y,
                        int n_in, int n_out, int wpr, int k, float rscale, int mode,
                        const float* bias, const ds4_u8* table, int table_rows,
                        const int* tokens, int* ids, float* weights, int* fault, int* counter) {
    ds4_gemv_plain<Ds4F16>(W, x, y, n_in, n_out, wpr, true);
    __shared__ int s_last;
    ds4_fence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(counter, 1);
        s_last = done == (int)gridDim.x - 1;
        if (s_last) *counter = 0;
    }
    __syncthreads();
    if (!s_last) return;
    ds4_fence();
    if (threadIdx.x < DS4_WARP)
        ds4_router_token(y, 0, n_out, k, rscale, mode, bias, table, table_rows, tokens, ids,
                         weights, fault, threadIdx.x);
}
// Several columns (batched decode): y[c * y_stride + r] = row r · x[c * x_stride ..] for
// c < n_cols <= DS4_Q8M_COLS; warps per row as ds4_gemv_<t>, DS4_PLAIN_COLS_ROWS rows per warp
// (grid: kernels::cols_grid_x). More than four rows per warp hold 8·R column sums and R weight
// vectors per step: one block
// per multiprocessor (up to 255 registers) rather than spilling at two.
#define DS4_MINB_PLAIN_COLS (DS4_PLAIN_COLS_ROWS > 4 ? 1 : 2)
#define DS4_GEMV_COLS_ENTRY(NAME, FMT)                                                          \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_PLAIN_COLS)        \
        ds4_gemv_cols_##NAME(const ds4_u8* __restrict__ W, const float* __restrict__ x,        \
                             ds4_size x_stride, float* __restrict__ y, ds4_size y_stride,      \
                             int n_in, int n_out, int n_cols, int wpr) {                       \
        ds4_gemv_plain_cols<FMT>(W, x, x_stride, y, y_stride, n_in, n_out, n_cols, wpr);       \
    }
DS4_GEMV_COLS_ENTRY(f32, Ds4F32)
DS4_GEMV_COLS_ENTRY(f16, Ds4F16)
// The register-staged Q8_0 engine: it measured faster than a cp.async ring of any depth
// (crates/ds4-gpu/NOTES.md), so bytes in flight were
// not what bounded it, and the ring was removed.
DS4_GEMV_ENTRY(q8_0, ds4_gemv_q8s, Ds4Q8S, DS4_MINB_Q8_0)
DS4_GEMV_ENTRY(q2_k, ds4_gemv_quant, Ds4Q2K, DS4_MINB_Q2_K)
DS4_GEMV_ENTRY(q4_k, ds4_gemv_quant, Ds4Q4K, DS4_MINB_Q4_K)
DS4_GEMV_ENTRY(iq2_xxs, ds4_gemv_quant, Ds4Iq2Xxs, DS4_MINB_IQ2_XXS)
DS4_GEMV_ENTRY(mxfp4, ds4_gemv_quant, Ds4Mxfp4, DS4_MINB_MXFP4)

// Int8-activation entry points: same arguments as ds4_gemv_<t> / ds4_gemv_grouped_<t>,
// persistent grids (any number of blocks along x); n_in <= DS4_Q8_MAX_IN (else the
// outputs are NaN).
DS4_GEMV_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)
DS4_GEMV_ENTRY(q_q2_k, ds4_gemvq_quant, Ds4Q2Kx, DS4_MINB_Q2_K)
DS4_GEMV_ENTRY(q_q4_k, ds4_gemvq_quant, Ds4Q4Kx, DS4_MINB_Q4_K)
DS4_GEMV_ENTRY(q_iq2_xxs, ds4_gemvq_quant, Ds4Iq2XxsxOne, DS4_MINB_IQ2_XXS)
DS4_GEMV_ENTRY(q_mxfp4, ds4_gemvq_quant, Ds4Mxfp4x, DS4_MINB_MXFP4)

// The same with the input computed from SwiGLU on the way (Ds4XSwiglu, docs/gpu.md §17):
// ds4_gemv_swiglu_q_<t>(W, g, u, c, y, n_in, n_out, wpr): y = W · swiglu(g, u, c) (the shared
// expert's down projection); ds4_gemv_grouped_swiglu_q_<t>(W, expert_bytes, ids, n_experts,
// g, u, route_w, c, y, n_in, n_out, wpr, fault): selection s = blockIdx.y, expert ids[s]:
// y[s·n_out ..] = that expert's W · (route_w[s] · swiglu(g[s·n_in ..], u[s·n_in ..], c)) (the
// routed experts' down projection after ds4_moe_act, whose id check it takes over: a bad id
// gives NaN rows and sets the fault bit). g, u 16-byte aligned, n_in a multiple of 32.
#define DS4_GEMV_SWIGLU_ENTRY(NAME, ENGINE, FMT, MINB)                                           \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                     \
        ds4_gemv_swiglu_##NAME(const ds4_u8* __restrict__ W, const float* g, const float* u,   \
                               float c, float* __restrict__ y, int n_in, int n_out, int wpr) { \
        ENGINE<FMT>(W, Ds4XSwiglu{g, u, c, 1.0f}, y, n_in, n_out, wpr, true);                \
    }
#define DS4_GEMV_GROUPED_SWIGLU_ENTRY(NAME, ENGINE, FMT, MINB)                                   \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                     \
        ds4_gemv_grouped_swiglu_##NAME(                                                       \
            const ds4_u8* __restrict__ W0, ds4_size expert_bytes, const ds4_i32* __restrict__ ids, \
            int n_experts, const float* g, const float* u, const float* route_w, float c,     \
            float* __restrict__ y0, int n_in, int n_out, int wpr, int* fault) {                \
        ds4_grid_wait(); /* ids, g, u and the route weights come from earlier kernels */      \
        const int sel = blockIdx.y;                                                           \
        const int id = ids[sel];                                                              \
        const bool ok = id >= 0 && id < n_experts;                                            \
        if (!ok && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(fault, DS4_GEMV_FAULT_EXPERT); \
        const ds4_u8* W = W0 + (ok ? (ds4_size)id * expert_bytes : 0);                       \
        const ds4_size off = (ds4_size)sel * n_in;                                            \
        const Ds4XSwiglu xin{g + off, u + off, c, ds4_ld_act(route_w + sel)};                 \
        ENGINE<FMT>(W, xin, y0 + (ds4_size)sel * n_out, n_in, n_out, wpr, ok);               \
    }
// ds4_quant.h's DS4_FAULT_EXPERT (the bit ds4_moe_act sets for a bad expert id).
#define DS4_GEMV_FAULT_EXPERT 2
// The shared expert's down projection is Q8_0 in every ds4 layout; the routed experts' down
// is Q2_K, Q4_K, IQ2_XXS or MXFP4. (Each entry point costs NVRTC compile time at first start.)
DS4_GEMV_SWIGLU_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_q2_k, ds4_gemvq_quant, Ds4Q2Kx, DS4_MINB_Q2_K)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_q4_k, ds4_gemvq_quant, Ds4Q4Kx, DS4_MINB_Q4_K)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_iq2_xxs, ds4_gemvq_quant, Ds4Iq2XxsxOne, DS4_MINB_IQ2_XXS)
DS4_GEMV_GROUPED_SWIGLU_ENTRY(q_mxfp4, ds4_gemvq_quant, Ds4Mxfp4x, DS4_MINB_MXFP4)

// Flat grouped launches (docs/gpu.md §25): the routed experts' matrices of a batched decode
// step as the jobs of one flat grid. Job p is selection p / mats, matrix p % mats (gate and
// up of one selection follow each other and share its input).
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
// ds4_gemv_flat_q_<t>(W0, W1, expert_bytes, ids, n_experts, n_sel, mats, x, x_stride, x_div,
// y0, y1, n_in, n_out, wpr): ds4_gemv_grouped_q_<t>'s outputs (matrix m of selection s into
// (m ? y1 : y0)[s·n_out ..]) on a flat grid of any size along x, selection s reading x row
// s / x_div. ds4_gemv_flat_swiglu_q_<t>(W0, expert_bytes, ids, n_experts, n_sel, g, u,
// route_w, c, y0, n_in, n_out, wpr, fault): ds4_gemv_grouped_swiglu_q_<t>'s.
#define DS4_GEMV_FLAT_ENTRY(NAME, FMT, MINB)                                                    \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB) ds4_gemv_flat_##NAME(  \
        const ds4_u8* __restrict__ W0, const ds4_u8* __restrict__ W1, ds4_size expert_bytes,    \
        const ds4_i32* ids, int n_experts, int n_sel, int mats, const float* x,                 \
        ds4_size x_stride, int x_div, float* y0, float* y1, int n_in, int n_out, int wpr) {     \
        const Ds4Experts e{W0, W1, expert_bytes, ids, n_experts, n_sel, mats, y0, y1, n_out};   \
        ds4_gemvq_jobs<FMT>(Ds4JobsExperts{e, x, x_stride, max(1, x_div)}, n_in, n_out, wpr);   \
    }                                                                                           \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                        \
        ds4_gemv_flat_swiglu_##NAME(const ds4_u8* __restrict__ W0, ds4_size expert_bytes,       \
                                    const ds4_i32* ids, int n_experts, int n_sel, const float* g, \
                                    const float* u, const float* route_w, float c, float* y0,   \
                                    int n_in, int n_out, int wpr, int* fault) {                 \
        const Ds4Experts e{W0, W0, expert_bytes, ids, n_experts, n_sel, 1, y0, y0, n_out};      \
        ds4_grid_wait();                                                                        \
        if (blockIdx.x == 0)                                                                    \
            for (int s = threadIdx.x; s < n_sel; s += blockDim.x)                               \
                if (!e.ok(s)) atomicOr(fault, DS4_GEMV_FAULT_EXPERT);                           \
        ds4_gemvq_jobs<FMT>(Ds4JobsExpertsSwiglu{e, g, u, route_w, c, n_in}, n_in, n_out, wpr); \
    }
DS4_GEMV_FLAT_ENTRY(q_q2_k, Ds4Q2Kx, DS4_MINB_Q2_K)
DS4_GEMV_FLAT_ENTRY(q_q4_k, Ds4Q4Kx, DS4_MINB_Q4_K)
DS4_GEMV_FLAT_ENTRY(q_iq2_xxs, Ds4Iq2XxsxFlat, DS4_MINB_IQ2_XXS)
DS4_GEMV_FLAT_ENTRY(q_mxfp4, Ds4Mxfp4x, DS4_MINB_MXFP4)

// ds4_gemv_rmsnorm_q_<t>(W, x, norm_w, eps, y, n_in, n_out, wpr, h): y = W · (rms_norm(x) ·
// norm_w) (Ds4XNorm; the query path's low-rank norm before q_b), and block 0 writes the
// normalized vector to h (for the indexer's up-projection, which reads it later); x, norm_w
// and h 16-byte aligned, n_in a multiple of 32.
#define DS4_GEMV_RMSNORM_ENTRY(NAME, ENGINE, FMT, MINB)                                          \
    extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, MINB)                     \
        ds4_gemv_rmsnorm_##NAME(const ds4_u8* __restrict__ W, const float* x, const float* nw, \
                                float eps, float* __restrict__ y, int n_in, int n_out, int wpr, \
                                float* h) {                                                   \
        const Ds4XNorm xin{x, nw, eps, blockIdx.x == 0 ? h : nullptr, 0.0f};                  \
        ENGINE<FMT>(W, xin, y, n_in, n_out, wpr, true);                                       \
    }
// q_b is Q8_0 in every ds4 layout.
DS4_GEMV_RMSNORM_ENTRY(q_q8_0, ds4_gemvq_q8s, Ds4Q8Sx, DS4_MINB_Q_Q8_0)

// ds4_gemv_grouped_rope_q_q8_0(W, group_bytes, x, freqs, head_dim, rope_dim, p, inverse, y,
// n_in, n_out, wpr): out_a, one group per blockIdx.y: y[g·n_out ..] = group g's rows ·
// (x[g·n_in ..] with every head's last rope_dim dims rotated at position p: Ds4XRope);
// n_in a multiple of head_dim (groups start at head boundaries), x 16-byte aligned. out_a is
// Q8_0 in every ds4 layout.
extern "C" __global__ void DS4_LAUNCH_BOUNDS(DS4_GEMV_THREADS, DS4_MINB_Q_Q8_0)
    ds4_gemv_grouped_rope_q_q8_0(const ds4_u8* __restrict__ W0, ds4_size group_bytes,
                                 const float* x, const float* freqs, int head_dim, int rope_dim,
                                 float p, int inverse, float* __restrict__ y0, int n_in, int n_out,
                                 int wpr) {
    const int g = blockIdx.y;
    const Ds4XRope xin{x + (ds4_size)g * n_in, freqs, head_dim, rope_dim, p, inverse};
    ds4_gemvq_q8s<Ds4Q8Sx>(W0 + (ds4_size)g * group_bytes, xin, y0 + (ds4_size)g * n_out, n_in,
                           n_out, wpr, true);
}
