// ds4_port.h for the CPU emulation of the kernels (crates/ds4-gpu/src/emu.rs): the same
// interface as kernels/ds4_port.h, implemented in C++20 on the host, so that every
// kernels/*.cu file compiles with a host C++ compiler and runs block by block, each GPU
// thread a fiber (runtime.cpp). Used by tests only: it checks the kernels' logic (indexing,
// decoding, barriers, warp exchanges, fragment layouts) against the CPU backend without a
// GPU; it says nothing about speed or about a GPU's memory model.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#define DS4_CPU 1

typedef unsigned char ds4_u8;
typedef signed char ds4_i8;
typedef unsigned short ds4_u16;
typedef unsigned int ds4_u32;
typedef int ds4_i32;
typedef unsigned long long ds4_u64;
typedef unsigned long long ds4_size;

#define DS4_WARP 32
#define DS4_FULL_MASK 0xffffffffu

// CUDA keywords: device code is ordinary host code here. `static` on __forceinline__ gives
// every translation unit its own helpers (two .cu files may define helpers of one name);
// __shared__ variables become function statics, shared by the fibers of the one block that
// runs at a time.
#define __device__
#ifndef __global__  // the build's kernel-listing pass defines it as a marker
#define __global__
#endif
#define __host__
#define __forceinline__ static inline
// A device member function (kernels/ds4_port.h): no `static` on a method.
#define DS4_METHOD inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct ds4emu_dim3 {
    unsigned x, y, z;
};
struct ds4emu_fiber_id {
    ds4emu_dim3 tid;
    int lane, warp;
};
extern "C" const ds4emu_fiber_id* ds4emu_self();
extern "C" void ds4emu_block_barrier();
extern "C" void ds4emu_warp_barrier();
extern "C" float* ds4emu_warp_slots(int n);  // this warp's exchange area, n floats per lane
extern ds4emu_dim3 blockIdx, blockDim, gridDim;
#define threadIdx (ds4emu_self()->tid)

static inline void __syncthreads() { ds4emu_block_barrier(); }

struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
    unsigned x, y;
};
struct __attribute__((aligned(8))) float2 {
    float x, y;
};
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static inline int __float_as_int(float v) { int i; memcpy(&i, &v, 4); return i; }
static inline unsigned __float_as_uint(float v) { unsigned i; memcpy(&i, &v, 4); return i; }
// Built with -ffp-contract=off: a product and a sum are each rounded once, as _rn asks.
static inline long long __double_as_longlong(double v) { long long i; memcpy(&i, &v, 8); return i; }
static inline double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline ds4_size min(ds4_size a, ds4_size b) { return a < b ? a : b; }
static inline ds4_size max(ds4_size a, ds4_size b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }

// Fibers never run at the same time, so plain read-modify-writes are atomic here.
static inline int atomicOr(int* p, int v) { int o = *p; *p = o | v; return o; }
static inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
static inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }

static inline float ds4_shfl_xor(float v, int lane_mask) {
    float* s = ds4emu_warp_slots(1);
    const int lane = ds4emu_self()->lane;
    s[lane] = v;
    ds4emu_warp_barrier();
    const float r = s[lane ^ lane_mask];
    ds4emu_warp_barrier();
    return r;
}

static inline float ds4_shfl_idx(float v, int src) {
    float* s = ds4emu_warp_slots(1);
    const int lane = ds4emu_self()->lane;
    s[lane] = v;
    ds4emu_warp_barrier();
    const float r = s[src & (DS4_WARP - 1)];
    ds4emu_warp_barrier();
    return r;
}

static inline float ds4_shfl_up(float v, int delta) {
    float* s = ds4emu_warp_slots(1);
    const int lane = ds4emu_self()->lane;
    s[lane] = v;
    ds4emu_warp_barrier();
    const float r = lane >= delta ? s[lane - delta] : v;
    ds4emu_warp_barrier();
    return r;
}

static inline void ds4_syncwarp() { ds4emu_warp_barrier(); }
// Dynamic shared memory: a block's static array of the kernel's largest size.
#define DS4_DYN_SHARED(name, bytes) static __attribute__((aligned(16))) unsigned char name[bytes]
// Every dynamic shared array is its full static size here, whatever the launch asked.
static inline unsigned ds4_dynamic_smem_bytes() { return 0xffffffffu; }
// Programmatic dependent launch: kernels run one after another here, nothing to wait for.
static inline void ds4_grid_wait() {}

static inline float ds4_h2f(ds4_u16 h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline ds4_u16 ds4_f2h(float f) {
    _Float16 v = (_Float16)f;
    ds4_u16 h;
    memcpy(&h, &v, 2);
    return h;
}

template <class T> static inline T ds4_ldg(const T* p) { return *p; }
template <class T> static inline T ds4_ld_act(const T* p) { return *p; }
static inline void ds4_prefetch_l1(const void*) {}

static inline ds4_u32 ds4_f2h2(float lo, float hi) {
    return (ds4_u32)ds4_f2h(lo) | ((ds4_u32)ds4_f2h(hi) << 16);
}

// The IEEE binary16 product of each half: the exact f32 product of two halves rounded
// once (mul.rn.f16x2).
static inline ds4_u32 ds4_hmul2(ds4_u32 a, ds4_u32 b) {
    const float lo = ds4_h2f((ds4_u16)(a & 0xffffu)) * ds4_h2f((ds4_u16)(b & 0xffffu));
    const float hi = ds4_h2f((ds4_u16)(a >> 16)) * ds4_h2f((ds4_u16)(b >> 16));
    return (ds4_u32)ds4_f2h(lo) | ((ds4_u32)ds4_f2h(hi) << 16);
}

// prmt without the sign-replicate mode: byte i = byte (s >> 4i) & 7 of y:x.
static inline ds4_u32 ds4_byte_perm(ds4_u32 x, ds4_u32 y, ds4_u32 s) {
    const ds4_u64 v = ((ds4_u64)y << 32) | x;
    ds4_u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (ds4_u32)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}

static inline int ds4_popc(ds4_u32 x) { return __builtin_popcount(x); }
static inline int ds4_dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(ds4_i8)((a >> (8 * i)) & 0xff) * (int)(ds4_i8)((b >> (8 * i)) & 0xff);
    return c;
}

// The tensor-core product of kernels/ds4_port.h, computed from the documented PTX
// m16n8k16 fragment layouts: every lane publishes its fragments, then computes its own
// four outputs from the whole tiles (f32 sums in k order). Built with -DDS4_EMU_NO_MMA the
// kernels take their HIP path instead (no matrix instructions).
#ifndef DS4_EMU_NO_MMA
#define DS4_HAS_MMA 1
#endif
static inline float ds4emu_half(ds4_u32 reg, int hi) { return ds4_h2f((ds4_u16)(hi ? reg >> 16 : reg & 0xffff)); }
static inline void ds4_mma_16816(float* c, const ds4_u32* a, const ds4_u32* b) {
    float* s = ds4emu_warp_slots(6);  // per lane: a[4], b[2] (bit patterns)
    const int lane = ds4emu_self()->lane;
    for (int i = 0; i < 4; i++) memcpy(&s[lane * 6 + i], &a[i], 4);
    for (int i = 0; i < 2; i++) memcpy(&s[lane * 6 + 4 + i], &b[i], 4);
    ds4emu_warp_barrier();
    auto reg = [&](int l, int i) { ds4_u32 r; memcpy(&r, &s[l * 6 + i], 4); return r; };
    // A[row][col]: lane (row % 8) * 4 + (col % 8) / 2, register (row >= 8) + 2 (col >= 8).
    auto A = [&](int row, int col) {
        return ds4emu_half(reg((row % 8) * 4 + (col % 8) / 2, (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0)), col % 2);
    };
    // B[k][n]: lane n * 4 + (k % 8) / 2, register 4 + (k >= 8).
    auto B = [&](int k, int n) { return ds4emu_half(reg(n * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0)), k % 2); };
    const int g = lane / 4, t = lane % 4;
    float out[4];
    for (int q = 0; q < 4; q++) {
        const int row = g + (q >> 1) * 8, col = 2 * t + (q & 1);
        float acc = c[q];
        for (int k = 0; k < 16; k++) acc += A(row, k) * B(k, col);
        out[q] = acc;
    }
    ds4emu_warp_barrier();
    for (int q = 0; q < 4; q++) c[q] = out[q];
}

// kernels/ds4_port.h's ldmatrix .x4: every lane publishes its row address, then gathers
// its two halves of each of the four 8x8 matrices (row lane / 4, halves 2 (lane % 4) and
// 2 (lane % 4) + 1 of matrix m from the row address of lane 8 m + lane / 4).
static inline void ds4_ldmatrix_x4(ds4_u32* r, const ds4_u16* p) {
    float* s = ds4emu_warp_slots(2);  // per lane: its row address (8 bytes)
    const int lane = ds4emu_self()->lane;
    memcpy(&s[lane * 2], &p, sizeof p);
    ds4emu_warp_barrier();
    for (int m = 0; m < 4; m++) {
        const ds4_u16* row;
        memcpy(&row, &s[(m * 8 + lane / 4) * 2], sizeof row);
        memcpy(&r[m], row + 2 * (lane % 4), 4);
    }
    ds4emu_warp_barrier();
}

// cp.async: here a plain copy, done at once (fibers see one another's stores only across
// barriers, as on the GPU after the wait and __syncthreads).
static inline void ds4_cp_async16(void* dst, const void* src, bool valid) {
    if (valid) memcpy(dst, src, 16);
    else memset(dst, 0, 16);
}
static inline void ds4_cp_commit() {}
static inline void ds4_cp_wait_all() {}
template <int N> static inline void ds4_cp_wait() {}

// kernels/ds4_port.h's shared-memory offsets: here the generic address itself.
typedef uintptr_t ds4_saddr;
static inline ds4_saddr ds4_saddr_of(const void* p) { return (ds4_saddr)p; }
static inline void ds4_cp_async16_at(ds4_saddr dst, const void* src, bool valid) {
    ds4_cp_async16((void*)dst, src, valid);
}
static inline void ds4_ldmatrix_x4_at(ds4_u32* r, ds4_saddr a) { ds4_ldmatrix_x4(r, (const ds4_u16*)a); }
static inline uint4 ds4_lds128(ds4_saddr a) {
    uint4 v;
    memcpy(&v, (const void*)a, sizeof v);
    return v;
}

// Sum of v over the 32 lanes of a logical warp; every lane receives the total.
static inline float ds4_warp_sum(float v) {
    for (int m = DS4_WARP / 2; m > 0; m >>= 1) v += ds4_shfl_xor(v, m);
    return v;
}

// Blocks run one after another here: every earlier block's writes are already visible.
static inline void ds4_fence() {}

static inline int ds4_shfl_xor_i(int v, int lane_mask) {
    return __float_as_int(ds4_shfl_xor(__int_as_float(v), lane_mask));
}
static inline int ds4_shfl_up_i(int v, int delta) {
    return __float_as_int(ds4_shfl_up(__int_as_float(v), delta));
}
