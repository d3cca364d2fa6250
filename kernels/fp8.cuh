// Block-FP8 weights (DeepSeek-V3's checkpoint layout: e4m3 bytes with one f32 scale_inv per
// 128x128 block of an [n, k] matrix, edge blocks partial): conversions shared by the kernels that
// read them (gemv_fp8.cu, moe_gemv.cu, grouped_gemm.cu).
#pragma once
#include <cuda_fp8.h>

#include "common.cuh"

constexpr int FP8_SCALE_BLOCK = 128;

// 16 e4m3 values (one 16-byte load) to f32, exactly.
DEVICE_INLINE void fp8x16_to_f32(const uint4& v, float* f) {
    const __nv_fp8x4_e4m3* q = reinterpret_cast<const __nv_fp8x4_e4m3*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 t = static_cast<float4>(q[i]);
        f[4 * i] = t.x;
        f[4 * i + 1] = t.y;
        f[4 * i + 2] = t.z;
        f[4 * i + 3] = t.w;
    }
}

// 16 bf16 values at p (16-byte aligned) to f32.
DEVICE_INLINE void bf16x16_to_f32(const __nv_bfloat16* p, float* f) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(p)), b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    const __nv_bfloat162* h0 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* h1 = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p0 = __bfloat1622float2(h0[i]), p1 = __bfloat1622float2(h1[i]);
        f[2 * i] = p0.x;
        f[2 * i + 1] = p0.y;
        f[8 + 2 * i] = p1.x;
        f[8 + 2 * i + 1] = p1.y;
    }
}

// 8 e4m3 values (one 8-byte load) dequantized with their block's scale, each rounded once to bf16:
// bf16(float(e4m3) * scale), what a host dequantization to bf16 gives. Packed as 8 bf16.
DEVICE_INLINE uint4 fp8x8_dequant_bf16(const uint2& v, float scale) {
    const __nv_fp8x4_e4m3* q = reinterpret_cast<const __nv_fp8x4_e4m3*>(&v);
    const float4 lo = static_cast<float4>(q[0]), hi = static_cast<float4>(q[1]);
    return make_uint4(pack_bf16(__fmul_rn(lo.x, scale), __fmul_rn(lo.y, scale)),
                      pack_bf16(__fmul_rn(lo.z, scale), __fmul_rn(lo.w, scale)),
                      pack_bf16(__fmul_rn(hi.x, scale), __fmul_rn(hi.y, scale)),
                      pack_bf16(__fmul_rn(hi.z, scale), __fmul_rn(hi.w, scale)));
}
