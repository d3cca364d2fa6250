// The FP8 latent cache's arithmetic on the device (the format: dims.cuh and
// crates/mla-core/src/model/latent_fp8.rs, whose functions these must equal bit for bit): the
// scale exponent of a group, the quantization of one value, and the exact dequantization of 8
// codes to bf16 the decode kernel and the prefill gather read.
#pragma once
#include <cuda_fp8.h>

#include "common.cuh"

static_assert(LATENT_ROW % 16 == 0 && LATENT_ROW / LATENT_FP8_GROUP <= 16,
              "an FP8 row's exponents must fit the 16-byte block after its codes");

// The smallest k with amax <= 448 * 2^k, as k + 127 clamped to [1, LATENT_FP8_MAX_EXPONENT]:
// integer arithmetic on the bits (amax = 1.m * 2^(E - 127); 448 = 1.75 * 2^8), as
// latent_fp8::scale_exponent.
constexpr int LATENT_FP8_MAX_EXPONENT = 127 + 7;
DEVICE_INLINE int latent_scale_exponent(float amax) {
    if (!(amax > 0.f)) return 127;
    const unsigned bits = __float_as_uint(amax);
    const int e = (int)((bits >> 23) & 0xff) - 8 + ((bits & 0x7fffff) > 0x600000u ? 1 : 0);
    return min(max(e, 1), LATENT_FP8_MAX_EXPONENT);
}

// e4m3(v / 2^(e - 127)), round to nearest even, saturating (v / 2^(e - 127) is exact).
DEVICE_INLINE unsigned char latent_fp8_code(float v, int e) {
    const float inv = __uint_as_float((unsigned)(254 - e) << 23);
    return (unsigned char)__nv_cvt_float_to_fp8(v * inv, __NV_SATFINITE, __NV_E4M3);
}

// Two e4m3 codes (bytes 0 and 1 of the low 16-bit halves of x) as the bf16x2 whose values are
// the codes' times 2^-120, exactly: an e4m3 code's exponent and mantissa bits land in bf16's
// exponent and mantissa (bias 7 against 127), and e4m3 subnormals become bf16 subnormals.
DEVICE_INLINE uint32_t e4m3x2_as_bf16x2_scaled(uint32_t x) {
    return ((x << 8) & 0x80008000u) | ((x << 4) & 0x07f007f0u);
}

// The bf16 factor that takes e4m3x2_as_bf16x2_scaled's values to code * 2^(e - 127): 2^(120 + k),
// a normal bf16 for every exponent the format allows (k <= 7).
DEVICE_INLINE __nv_bfloat162 latent_fp8_factor(int e) {
    return __float2bfloat162_rn(__uint_as_float((unsigned)(e + 120) << 23));
}

// 8 codes of one scale group (f: latent_fp8_factor of its exponent) to 8 bf16 values
// code * 2^(e - 127), exact (a code has 4 significant bits; bf16 keeps 8 and f32's exponent
// range): the bit placement, then one bf16 multiply per pair.
DEVICE_INLINE uint4 latent_fp8x8_to_bf16(uint2 codes, __nv_bfloat162 f) {
    const uint32_t w[4] = {__byte_perm(codes.x, 0, 0x4140), __byte_perm(codes.x, 0, 0x4342),
                           __byte_perm(codes.y, 0, 0x4140), __byte_perm(codes.y, 0, 0x4342)};
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t b = e4m3x2_as_bf16x2_scaled(w[i]);
        const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&b), f);
        o[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    return out;
}
