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

// A stage of a lane's ring holds 16-byte chunks, chunk c of lane l at (c * 32 + l) * 16. Per
// 128-wide scale block a lane (g, t) copies columns kbase + h * 64 .. + 16 (kbase = block * 128 +
// 16 t) for the two 64-wide halves h: of its MMA tile's rows g and g + 8 (weight chunk
// w0 + 2 h + r for row g + 8 r) and of token g's inputs (chunks x0 + 2 h and x0 + 2 h + 1).

// The weight chunks of one 16-row tile; zeros past k_len.
DEVICE_INLINE void stream_issue_w(uint8_t* stage, int w0, const uint8_t* const (&rows)[2], int kbase, int k_len,
                                  int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int k = kbase + h * 64;
            const bool ok = k < k_len;
            cp_async_16_l2(stage + ((w0 + h * 2 + r) * 32 + lane) * 16, rows[r] + (ok ? k : 0), ok);
        }
}

// The input chunks of token g's row; zeros past k_len.
DEVICE_INLINE void stream_issue_x(uint8_t* stage, int x0, const __nv_bfloat16* xrow, int kbase, int k_len, int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int k = kbase + h * 64;
        const bool ok = k < k_len;
#pragma unroll
        for (int q = 0; q < 2; ++q)
            cp_async_16_ca(stage + ((x0 + h * 2 + q) * 32 + lane) * 16, xrow + (ok ? k : 0) + q * 8, ok);
    }
}

// The inputs back as the MMA's B fragments, per half; zeros for a lane without a token.
DEVICE_INLINE void stream_read_x(const uint8_t* stage, int x0, int lane, bool has_x, uint32_t (&xw)[2][8]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const uint4 v = has_x ? *reinterpret_cast<const uint4*>(stage + ((x0 + h * 2 + q) * 32 + lane) * 16)
                                  : make_uint4(0, 0, 0, 0);
            xw[h][4 * q] = v.x;
            xw[h][4 * q + 1] = v.y;
            xw[h][4 * q + 2] = v.z;
            xw[h][4 * q + 3] = v.w;
        }
}

// c += one tile's 16 rows times the inputs over one scale block (c as mma m16n8k16 leaves it:
// rows g, g + 8 by tokens 2t, 2t + 1).
DEVICE_INLINE void stream_mma_tile(const uint8_t* stage, int w0, int lane, const uint32_t (&xw)[2][8], float (&c)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint4 va = *reinterpret_cast<const uint4*>(stage + ((w0 + h * 2) * 32 + lane) * 16);
        const uint4 vb = *reinterpret_cast<const uint4*>(stage + ((w0 + h * 2 + 1) * 32 + lane) * 16);
        const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // Step j: weights 4j..4j+3 of this lane's 16 (rows g, g + 8) and the same inputs.
            const uint32_t a[4] = {e4m3x2_to_bf16x2_int<0x9180>(wa[j]), e4m3x2_to_bf16x2_int<0x9180>(wb[j]),
                                   e4m3x2_to_bf16x2_int<0xB3A2>(wa[j]), e4m3x2_to_bf16x2_int<0xB3A2>(wb[j])};
            mma_bf16_16816(c, a, xw[h][2 * j], xw[h][2 * j + 1]);
        }
    }
}
