// What the FP8 streaming kernels share (gemv_fp8.cu's dense GEMV, moe_gate_up_stream.cu's
// expert gate/up): e4m3 pairs to bf16x2 without the conversion pipe (gemv_fp8.cu says how and
// why), and the cp.async copies of their per-lane shared-memory rings.
#pragma once
#include "fp8.cuh"

DEVICE_INLINE uint32_t prmt(uint32_t a, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(r) : "r"(a), "r"(sel));
    return r;
}

// Bytes 0, 1 (SEL 0x9180) or 2, 3 (SEL 0xB3A2) of `word`, two e4m3 codes, as bf16x2, exactly.
template <uint32_t SEL>
DEVICE_INLINE uint32_t e4m3x2_to_bf16x2_int(uint32_t word) {
    const uint32_t v = (prmt(word, SEL) << 4) & 0x87f087f0u;  // bf16 bits of w * 2^-120
    const uint32_t k = 0x7b807b80u;                           // 2^120, twice
    const __nv_bfloat162 r =
        __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v), *reinterpret_cast<const __nv_bfloat162*>(&k));
    return *reinterpret_cast<const uint32_t*>(&r);
}

DEVICE_INLINE void cp_async_16_l2(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0));
}
DEVICE_INLINE void cp_async_16_ca(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0));
}
DEVICE_INLINE void cp_async_4_ca(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
