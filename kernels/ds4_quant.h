// ds4_quant.h: block-format pieces shared by the kernel files (included after ds4_port.h).
#pragma once

// GGML type ids (the GGUF numbering).
#define DS4_T_F32 0
#define DS4_T_F16 1
#define DS4_T_Q8_0 8
#define DS4_T_Q2_K 10
#define DS4_T_Q4_K 12
#define DS4_T_IQ2_XXS 16
#define DS4_T_BF16 30

// Q4_K / Q5_K 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes `sp`
// (ggml's get_scale_min_k4): sub-blocks 0..3 keep theirs in the low 6 bits of bytes j and
// j+4; 4..7 split theirs over the low/high nibbles of byte j+4 and the top 2 bits of bytes
// j-4 and j.
__device__ __forceinline__ void ds4_q4k_scale_min(const ds4_u8* sp, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = sp[j] & 63;
        *mn = sp[j + 4] & 63;
    } else {
        *sc = (sp[j + 4] & 0xF) | ((sp[j - 4] >> 6) << 4);
        *mn = (sp[j + 4] >> 4) | ((sp[j] >> 6) << 4);
    }
}

// Little-endian loads at any alignment (block fields are not aligned).
__device__ __forceinline__ ds4_u16 ds4_b16(const ds4_u8* p) {
    return (ds4_u16)p[0] | ((ds4_u16)p[1] << 8);
}
__device__ __forceinline__ ds4_u32 ds4_b32(const ds4_u8* p) {
    return (ds4_u32)p[0] | ((ds4_u32)p[1] << 8) | ((ds4_u32)p[2] << 16) | ((ds4_u32)p[3] << 24);
}

// The routed experts' activation (docs/forward.md §6 step 4), one expression for every kernel
// that applies it so their roundings agree: SiLU(min(g, c)) · clamp(u, −c, c).
__device__ __forceinline__ float ds4_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float ds4_silu(float x) { return x * ds4_sigmoid(x); }
__device__ __forceinline__ float ds4_swiglu1(float g, float u, float c) {
    return ds4_silu(fminf(g, c)) * fminf(fmaxf(u, -c), c);
}
