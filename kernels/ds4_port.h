// ds4_port.h: the one place where CUDA and HIP differ for ds4-rs kernels.
//
// Every kernels/*.cu file is written in the CUDA dialect and includes this header first, so
// that the same file compiles with NVRTC (CUDA 12/13), hiprtc (ROCm 6/7) and Debian's hipcc
// (ROCm 5.2, clang 15). Kernels never call a warp intrinsic directly: they use the ds4_*
// wrappers below.
//
// Warps: kernels are written for a *logical* warp of 32 lanes (DS4_WARP). On NVIDIA and on
// RDNA (wave32) that is the hardware warp. On CDNA (wave64) a wavefront holds two logical
// warps; shuffles take an explicit width of 32 so they stay inside one logical warp, and
// ds4_syncwarp() is a wavefront barrier, which is a superset of what a logical warp needs.
#pragma once

#if defined(__HIP__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define DS4_HIP 1
#endif

#if defined(DS4_HIP) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

// A device member function (the CPU emulation's port defines it without `static`).
#define DS4_METHOD __device__ __forceinline__

typedef unsigned char ds4_u8;
typedef signed char ds4_i8;
typedef unsigned short ds4_u16;
typedef unsigned int ds4_u32;
typedef int ds4_i32;
typedef unsigned long long ds4_u64;
typedef unsigned long long ds4_size;

#define DS4_WARP 32
#define DS4_FULL_MASK 0xffffffffu

#if defined(DS4_HIP)

// ROCm 5.2 has no __shfl_xor_sync; later ROCm has it only behind a macro and with 64-bit
// masks. __shfl_xor with an explicit width exists in every version.
__device__ __forceinline__ float ds4_shfl_xor(float v, int lane_mask) {
    return __shfl_xor(v, lane_mask, DS4_WARP);
}

// Orders shared-memory writes of one lane before reads by another lane of the same
// wavefront: a compiler/memory fence at wavefront scope plus a wave barrier.
__device__ __forceinline__ void ds4_syncwarp() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}

// IEEE binary16 bits to f32 through clang's _Float16 (exact, subnormals included).
__device__ __forceinline__ float ds4_h2f(ds4_u16 h) {
    _Float16 v;
    __builtin_memcpy(&v, &h, 2);
    return (float)v;
}

// Read-only global loads: plain loads on AMD (the compiler picks scalar/vector caches).
template <class T> __device__ __forceinline__ T ds4_ldg(const T* p) { return *p; }
template <class T> __device__ __forceinline__ T ds4_ld_act(const T* p) { return *p; }
// A hint that *p is read soon (ds4_prefetch_l1 on CUDA); nothing here.
__device__ __forceinline__ void ds4_prefetch_l1(const void* p) { (void)p; }

// f32 to IEEE binary16 bits, round to nearest even (through clang's _Float16).
__device__ __forceinline__ ds4_u16 ds4_f2h(float f) {
    _Float16 v = (_Float16)f;
    ds4_u16 h;
    __builtin_memcpy(&h, &v, 2);
    return h;
}

__device__ __forceinline__ float ds4_shfl_up(float v, int delta) {
    return __shfl_up(v, delta, DS4_WARP);
}

// v of lane `src` of this logical warp.
__device__ __forceinline__ float ds4_shfl_idx(float v, int src) {
    return __shfl(v, src, DS4_WARP);
}

// Two f32 to two IEEE binary16 in one register (`lo` in bits 0..15), round to nearest even.
__device__ __forceinline__ ds4_u32 ds4_f2h2(float lo, float hi) {
    return (ds4_u32)ds4_f2h(lo) | ((ds4_u32)ds4_f2h(hi) << 16);
}

// Signed 4x8-bit dot product plus c, as CUDA's __dp4a (no saturation). RDNA3/3.5/4
// (gfx11xx, Strix Halo's gfx1151, gfx12xx) have it as v_dot4_i32_iu8 (sudot4 with both
// operands signed); GCN5.1/CDNA and RDNA2 as v_dot4_i32_i8 (sdot4). Other targets get the
// byte-by-byte form, which every ROCm version compiles.
__device__ __forceinline__ int ds4_dp4a(int a, int b, int c) {
#if defined(__gfx1100__) || defined(__gfx1101__) || defined(__gfx1102__) || \
    defined(__gfx1103__) || defined(__gfx1150__) || defined(__gfx1151__) || \
    defined(__gfx1152__) || defined(__gfx1200__) || defined(__gfx1201__)
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || \
    defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
    defined(__gfx1030__) || defined(__gfx1031__) || defined(__gfx1032__) || \
    defined(__gfx1033__) || defined(__gfx1034__) || defined(__gfx1035__) || defined(__gfx1036__)
    return __builtin_amdgcn_sdot4(a, b, c, false);
#else
    c += (int)(ds4_i8)(a & 0xff) * (int)(ds4_i8)(b & 0xff);
    c += (int)(ds4_i8)((a >> 8) & 0xff) * (int)(ds4_i8)((b >> 8) & 0xff);
    c += (int)(ds4_i8)((a >> 16) & 0xff) * (int)(ds4_i8)((b >> 16) & 0xff);
    c += (int)(ds4_i8)((a >> 24) & 0xff) * (int)(ds4_i8)((b >> 24) & 0xff);
    return c;
#endif
}

// Set bits of x (HIP and CUDA both have __popc).
__device__ __forceinline__ int ds4_popc(ds4_u32 x) { return __popc(x); }

// As the CUDA versions below: two binary16 products (the exact f32 product rounded once,
// which is the IEEE half product), and a byte select from y:x.
__device__ __forceinline__ ds4_u32 ds4_hmul2(ds4_u32 a, ds4_u32 b) {
    const float lo = ds4_h2f((ds4_u16)(a & 0xffffu)) * ds4_h2f((ds4_u16)(b & 0xffffu));
    const float hi = ds4_h2f((ds4_u16)(a >> 16)) * ds4_h2f((ds4_u16)(b >> 16));
    return (ds4_u32)ds4_f2h(lo) | ((ds4_u32)ds4_f2h(hi) << 16);
}
__device__ __forceinline__ ds4_u32 ds4_byte_perm(ds4_u32 x, ds4_u32 y, ds4_u32 s) {
    const ds4_u64 v = ((ds4_u64)y << 32) | x;
    ds4_u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (ds4_u32)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}

#else  // CUDA (NVRTC)

__device__ __forceinline__ float ds4_shfl_xor(float v, int lane_mask) {
    return __shfl_xor_sync(DS4_FULL_MASK, v, lane_mask, DS4_WARP);
}

__device__ __forceinline__ void ds4_syncwarp() { __syncwarp(); }

// cvt.f32.f16 is exact; inline PTX avoids needing cuda_fp16.h (and so the toolkit's
// include directory) at run time.
__device__ __forceinline__ float ds4_h2f(ds4_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

template <class T> __device__ __forceinline__ T ds4_ldg(const T* p) { return __ldg(p); }
// Loads of activations (anything a kernel of this pass may have written): ld.global.cg,
// coherent at L2 and an ordinary load to the compiler. Never ds4_ldg for them: __ldg is a
// non-coherent load the compiler may treat as invariant and move above ds4_grid_wait(),
// which with overlapped launches read the previous kernel's output before it was written
// (found as nondeterministic decode at real dimensions, docs/gpu.md §6).
template <class T> __device__ __forceinline__ T ds4_ld_act(const T* p) { return __ldcg(p); }
// Start bringing the 128-byte line of p into L1 (a hint: no register, no wait), so a load
// issued later finds it there instead of paying the L2 round trip.
__device__ __forceinline__ void ds4_prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// f32 to IEEE binary16 bits, round to nearest even (inline PTX, as ds4_h2f).
__device__ __forceinline__ ds4_u16 ds4_f2h(float f) {
    ds4_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float ds4_shfl_up(float v, int delta) {
    return __shfl_up_sync(DS4_FULL_MASK, v, delta, DS4_WARP);
}

// v of lane `src` of this logical warp.
__device__ __forceinline__ float ds4_shfl_idx(float v, int src) {
    return __shfl_sync(DS4_FULL_MASK, v, src, DS4_WARP);
}

// Two f32 to two IEEE binary16 in one register (`lo` in bits 0..15), round to nearest
// even: one cvt.rn.f16x2.f32 on sm_80 and later, two ds4_f2h (the same bits) before.
__device__ __forceinline__ ds4_u32 ds4_f2h2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    ds4_u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (ds4_u32)ds4_f2h(lo) | ((ds4_u32)ds4_f2h(hi) << 16);
#endif
}

// Signed 4x8-bit dot product plus c: one dp4a instruction (sm_61 and later).
__device__ __forceinline__ int ds4_dp4a(int a, int b, int c) { return __dp4a(a, b, c); }
__device__ __forceinline__ int ds4_popc(ds4_u32 x) { return __popc(x); }

// Two IEEE binary16 products in one register (each half times the same half of b), round
// to nearest even, subnormals kept: one mul.rn.f16x2.
__device__ __forceinline__ ds4_u32 ds4_hmul2(ds4_u32 a, ds4_u32 b) {
    ds4_u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// Byte i of the result = byte (s >> 4i) & 7 of the eight bytes y:x (x = bytes 0..3): one
// prmt. The callers never set a selector nibble's sign-replicate bit 3, so the instruction
// is issued as it is; `__byte_perm` keeps only bits 0..2 of each nibble and so clears bit 3
// first, an AND and a constant move per permute (cuobjdump, sm_90; docs/gpu.md §32;
// measured against `__byte_perm`: BENCHMARKS.md, session of 2026-12-07, 04:20–07:20).
__device__ __forceinline__ ds4_u32 ds4_byte_perm(ds4_u32 x, ds4_u32 y, ds4_u32 s) {
    ds4_u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
    return r;
}

// Tensor-core product (sm_80 and later): c += A * B for one 16x16 half tile A (row-major
// fragment a[4]) and one 16x8 half tile B (column fragment b[2]), f32 accumulator c[4]; the
// PTX m16n8k16 fragment layouts (g = lane / 4, t = lane % 4): a[0] = A[g][2t..2t+1],
// a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]; b[0] = B[2t..2t+1][g],
// b[1] = B[2t+8..][g]; c = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
// Only sm_80 and later have this shape; older GPUs (Volta, Turing, Pascal) compile the
// kernels' plain-FMA fallbacks instead, which read the same fragment elements.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DS4_HAS_MMA 1
__device__ __forceinline__ void ds4_mma_16816(float* c, const ds4_u32* a, const ds4_u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The 32-bit shared-window address of a generic pointer into shared memory (the operand
// form ldmatrix and cp.async take).
__device__ __forceinline__ ds4_u32 ds4_smem_addr(const void* p) {
    ds4_u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 half matrices from shared memory in one instruction (sm_75 and later): lane l
// gives the address of row l % 8 of matrix l / 8 (16 contiguous, 16-byte aligned bytes);
// r[m] receives, in every lane l, the halves (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1)
// of matrix m, i.e. exactly one register of an mma fragment. Replaces four (A) or two
// per n-tile (B) 32-bit shared loads, each its own instruction, by one.
__device__ __forceinline__ void ds4_ldmatrix_x4(ds4_u32* r, const ds4_u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(ds4_smem_addr(p))
                 : "memory");
}
#endif  // __CUDA_ARCH__ >= 800

#endif

// Dynamic shared memory: `bytes` (at most) sized at launch, so a kernel may use more than
// the 48 KB of static shared memory (the host raises the function's limit first).
#define DS4_DYN_SHARED(name, bytes) extern __shared__ __align__(16) unsigned char name[]
// Bytes of dynamic shared memory this launch was given (0 where the runtime gives none),
// so that a kernel can fall back instead of reading past them.
#if !defined(DS4_HIP) && defined(__CUDA_ARCH__)
__device__ __forceinline__ unsigned ds4_dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
#else
__device__ __forceinline__ unsigned ds4_dynamic_smem_bytes() { return 0; }
#endif

// Programmatic dependent launch (docs/gpu.md, "Overlapped launches"). On sm_90 the host may
// launch a kernel while the previous one in the stream is still running; the kernel must
// then call ds4_grid_wait() before it reads anything an earlier kernel wrote or writes
// anything at all (only read-only weights may be loaded before it). After its own wait a
// kernel lets the next one start launching (ds4_grid_wait does both), so the next kernel's
// blocks become resident and issue their weight loads during this kernel's tail. Without
// the launch attribute (older GPUs, HIP, prefill-sized passes) both instructions are no-ops.
#if !defined(DS4_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void ds4_grid_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#else
__device__ __forceinline__ void ds4_grid_wait() {}
#endif

// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80 and later): the
// copy proceeds while the thread computes; ds4_cp_commit() closes a group of copies and
// ds4_cp_wait_all() waits for every group this thread committed (a __syncthreads() after it
// makes the data visible to the block). `valid` false stores 16 zero bytes and reads
// nothing (src must still be a mapped address). HIP and older NVIDIA targets: a plain copy,
// done at once, and the commit/wait are no-ops. Both pointers 16-byte aligned.
#if !defined(DS4_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ds4_cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(ds4_smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void ds4_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void ds4_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void ds4_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Shared-memory addresses as 32-bit offsets (ds4_saddr): a kernel converts a shared array's
// pointer once (ds4_saddr_of) and does its per-fragment address arithmetic on the offset.
// Pointer arithmetic on a generic pointer that is only converted at each ldmatrix costs a
// 64-bit add and a move per instruction (three per ldmatrix in the sm_90 tile loops, where
// the function receives its tiles as generic pointers); an offset is one add, or none when
// ptxas folds it into the instruction's address. Elsewhere ds4_saddr is a generic address.
typedef ds4_u32 ds4_saddr;
__device__ __forceinline__ ds4_saddr ds4_saddr_of(const void* p) { return ds4_smem_addr(p); }
__device__ __forceinline__ void ds4_ldmatrix_x4_at(ds4_u32* r, ds4_saddr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void ds4_cp_async16_at(ds4_saddr dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// 16 bytes from shared memory at `a` (16-byte aligned).
__device__ __forceinline__ uint4 ds4_lds128(ds4_saddr a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
#else
__device__ __forceinline__ void ds4_cp_async16(void* dst, const void* src, bool valid) {
    *(uint4*)dst = valid ? *(const uint4*)src : make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ void ds4_cp_commit() {}
__device__ __forceinline__ void ds4_cp_wait_all() {}
template <int N> __device__ __forceinline__ void ds4_cp_wait() {}
typedef ds4_size ds4_saddr;
__device__ __forceinline__ ds4_saddr ds4_saddr_of(const void* p) { return (ds4_saddr)p; }
__device__ __forceinline__ void ds4_cp_async16_at(ds4_saddr dst, const void* src, bool valid) {
    ds4_cp_async16((void*)dst, src, valid);
}
__device__ __forceinline__ uint4 ds4_lds128(ds4_saddr a) { return *(const uint4*)a; }
#endif

// A device-wide memory fence: a block's global writes before it are seen by any block that
// sees its writes after it (the "last block finishes" pattern: write, fence, count).
__device__ __forceinline__ void ds4_fence() { __threadfence(); }

// Integer shuffle through the float one (bit pattern preserved).
__device__ __forceinline__ int ds4_shfl_xor_i(int v, int lane_mask) {
    return __float_as_int(ds4_shfl_xor(__int_as_float(v), lane_mask));
}
__device__ __forceinline__ int ds4_shfl_up_i(int v, int delta) {
    return __float_as_int(ds4_shfl_up(__int_as_float(v), delta));
}

// Sum of v over the 32 lanes of a logical warp; every lane receives the total.
__device__ __forceinline__ float ds4_warp_sum(float v) {
#pragma unroll
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) {
        v += ds4_shfl_xor(v, m);
    }
    return v;
}
