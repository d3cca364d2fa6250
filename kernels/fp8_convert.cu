// Block-FP8 weight conversion on the device (issue 12). The quantizer turns bf16 weights into
// DeepSeek-V3's block-FP8 layout at load time (`--quantization fp8`, FP8 dummy weights):
// per 128x128 block scale_inv = max(amax, 1e-12) / 448 and fp8 = e4m3(w / scale_inv), rounded
// to nearest even and saturated, bit-exact with mla-core's fp8::quantize_block_fp8 (the CPU
// reference quantizes with it). The dequantizer writes bf16(fp8 * scale_inv) (one f32 multiply,
// then round to nearest even): exactly the bf16 weight the loader used to build from an FP8
// checkpoint, so a projection run as dequantize + bf16 GEMM computes what the bf16 model did.
#include <cuda_fp8.h>

#include "common.cuh"

namespace {
constexpr int QB = 128;  // scale block edge (DeepSeek-V3's weight_block_size)

DEVICE_INLINE float fp8_to_f32(uint8_t b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return static_cast<float>(v);
}
}  // namespace

// Grid (ceil(cols / 128), ceil(rows / 128)) blocks of 256 threads, one scale block each; the
// scale grid is [ceil(rows / 128), ceil(cols / 128)] row-major, as checkpoints store it.
extern "C" __global__ void __launch_bounds__(256)
    fp8_quantize_block(const bf16* __restrict__ w, int rows, int cols, uint8_t* __restrict__ q,
                       float* __restrict__ scale_inv) {
    __shared__ float scratch[32];
    PDL_ENTRY();
    const int r0 = blockIdx.y * QB, c0 = blockIdx.x * QB;
    const int nr = min(QB, rows - r0), nc = min(QB, cols - c0);
    float amax = 0.f;
    for (int i = threadIdx.x; i < nr * nc; i += blockDim.x)
        amax = fmaxf(amax, fabsf(to_f32(w[(size_t)(r0 + i / nc) * cols + c0 + i % nc])));
    amax = block_max(amax, scratch);
    const float s = __fdiv_rn(fmaxf(amax, 1e-12f), 448.f);
    if (threadIdx.x == 0) scale_inv[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = s;
    for (int i = threadIdx.x; i < nr * nc; i += blockDim.x) {
        const size_t at = (size_t)(r0 + i / nc) * cols + c0 + i % nc;
        q[at] = __nv_cvt_float_to_fp8(__fdiv_rn(to_f32(w[at]), s), __NV_SATFINITE, __NV_E4M3);
    }
}

// out[r, c] = bf16(fp8[r, c] * scale_inv[r / 128][c / 128]) for a [rows, cols] weight with
// cols % 16 == 0 (16-byte chunks, which never straddle a 128-wide block); grid-stride over chunks.
extern "C" __global__ void __launch_bounds__(256)
    fp8_dequantize_bf16(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv, int rows, int cols,
                        bf16* __restrict__ out) {
    PDL_ENTRY();
    const int row_chunks = cols / 16, grid_cols = (cols + QB - 1) / QB;
    const size_t chunks = (size_t)rows * row_chunks;
    for (size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x; c < chunks; c += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(c / row_chunks), k = (int)(c % row_chunks) * 16;
        const float s = __ldg(scale_inv + (size_t)(r / QB) * grid_cols + k / QB);
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(q + (size_t)r * cols + k));
        const uint8_t* b = reinterpret_cast<const uint8_t*>(&v);
        __align__(16) bf16 o[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) o[i] = __float2bfloat16_rn(fp8_to_f32(b[i]) * s);
        uint4* dst = reinterpret_cast<uint4*>(out + (size_t)r * cols + k);
        dst[0] = reinterpret_cast<const uint4*>(o)[0];
        dst[1] = reinterpret_cast<const uint4*>(o)[1];
    }
}

// Activations for the block-scaled FP8 GEMM (cuBLASLt VEC128 x BLK128x128): per row and group of
// 128 columns, scale = max(amax, 1e-12) / 448 and q = e4m3(x / scale), the weights' recipe on
// 1x128 blocks (bit-exact with mla-core's quantize_block_fp8 with block [1, 128]). q is packed
// [rows, cols]; the scale of row r, group g goes to scales[g * scale_ld + r] (M-major, as
// cuBLASLt reads VEC128 scales). With src_rows, output row r quantizes x row src_rows[r] (the
// MoE layer's grouping of token rows by expert, gathered in the same pass). Grid
// (ceil(cols / 128), ceil(rows / 8)), 256 threads: one warp per (row, group), four adjacent
// values per lane, read as one 8-byte load and written as one 4-byte store when `vec` (x_stride
// and cols multiples of 4, x 8-byte aligned: the wrapper decides) and the lane's four are in
// the row (one element at a time took 34 us per V2-Lite prefill projection on an H100, run F14).
extern "C" __global__ void __launch_bounds__(256)
    fp8_quantize_act(const bf16* __restrict__ x, int x_stride, const int* __restrict__ src_rows, int rows, int cols,
                     uint8_t* __restrict__ q, float* __restrict__ scales, int scale_ld, int vec) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, r = blockIdx.y * 8 + (threadIdx.x >> 5), c0 = blockIdx.x * QB;
    if (r >= rows) return;
    const bf16* xr = x + (size_t)(src_rows ? __ldg(src_rows + r) : r) * x_stride + c0;
    const int n = min(QB, cols - c0), c = lane * 4;
    const bool whole = vec && c + 4 <= n;
    float v[4];
    if (whole) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(xr + c));
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = c + i < n ? to_f32(xr[c + i]) : 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = warp_max(amax);
    const float s = __fdiv_rn(fmaxf(amax, 1e-12f), 448.f);
    if (lane == 0) scales[(size_t)blockIdx.x * scale_ld + r] = s;
    uint8_t* qr = q + (size_t)r * cols + c0 + c;
    uint8_t b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], s), __NV_SATFINITE, __NV_E4M3);
    if (whole) {
        *reinterpret_cast<uint32_t*>(qr) = b[0] | (b[1] << 8) | (b[2] << 16) | ((uint32_t)b[3] << 24);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (c + i < n) qr[i] = b[i];
    }
}
