// MLA latent-cache kernels: kv_a_layernorm + YaRN RoPE + the write of [c_kv ; k_pe] into the paged
// cache through a slot mapping, fused with RoPE on every head's q_pe; and the gather of cached
// latents into a contiguous buffer for the prefill (decompressed) path.
#include "common.cuh"

// One block per fed token. RoPE rotates consecutive pairs (x[2i], x[2i+1]) by pos * inv_freq[i],
// with cos/sin scaled by `attn_factor`, in f32 as HF's complex-multiply formulation does.
extern "C" __global__ void mla_rope_cache(
    const bf16* __restrict__ kva, int kva_stride,          // [T, R + P]: c_kv (pre-norm) | k_pe
    const bf16* __restrict__ kv_norm_w,                    // [R]
    bf16* __restrict__ q, int q_stride,                    // [T, H * (nope + P)], q_pe roped in place
    bf16* __restrict__ q_pe_out, int qo_stride, int qo_head_stride,  // optional copy of roped q_pe
    const int* __restrict__ positions, const int* __restrict__ slots,
    const float* __restrict__ inv_freq, float attn_factor, float eps,
    bf16* __restrict__ cache,                              // [slots, R + P]
    int heads, int nope, int R, int P) {
    PDL_ENTRY();
    __shared__ float scratch[32];
    __shared__ float rot_cos[64], rot_sin[64];  // rope dim <= 128
    const int t = blockIdx.x;
    const bf16* src = kva + (size_t)t * kva_stride;
    const int slot = slots[t];
    const float pos = (float)positions[t];
    const int half = P / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        rot_cos[i] = c * attn_factor;
        rot_sin[i] = s * attn_factor;
    }
    bf16* dst = slot >= 0 ? cache + (size_t)slot * (R + P) : nullptr;

    float ss = 0.f;
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        float v = to_f32(src[i]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)R + eps);
    if (dst)
        for (int i = threadIdx.x; i < R; i += blockDim.x)
            dst[i] = to_bf16(to_f32(kv_norm_w[i]) * round_bf16(to_f32(src[i]) * r));

    // k_pe (shared by all heads) and every head's q_pe: (heads + 1) * half rotations. (The
    // block_sum above synchronised after the cos/sin table was written.)
    for (int j = threadIdx.x; j < (heads + 1) * half; j += blockDim.x) {
        const int h = j / half, i = j - h * half;
        const float c = rot_cos[i], s = rot_sin[i];
        if (h == heads) {
            const float x0 = to_f32(src[R + 2 * i]), x1 = to_f32(src[R + 2 * i + 1]);
            if (dst) {
                dst[R + 2 * i] = to_bf16(x0 * c - x1 * s);
                dst[R + 2 * i + 1] = to_bf16(x0 * s + x1 * c);
            }
        } else {
            bf16* qp = q + (size_t)t * q_stride + (size_t)h * (nope + P) + nope;
            const float x0 = to_f32(qp[2 * i]), x1 = to_f32(qp[2 * i + 1]);
            const bf16 y0 = to_bf16(x0 * c - x1 * s), y1 = to_bf16(x0 * s + x1 * c);
            qp[2 * i] = y0;
            qp[2 * i + 1] = y1;
            if (q_pe_out) {
                bf16* o = q_pe_out + (size_t)t * qo_stride + (size_t)h * qo_head_stride;
                o[2 * i] = y0;
                o[2 * i + 1] = y1;
            }
        }
    }
}

// out[i, :] = cache[slots[i], :], 16 bytes per thread step; width * 2 must be a multiple of 16.
extern "C" __global__ void gather_latent(const bf16* __restrict__ cache, const int* __restrict__ slots,
                                         bf16* __restrict__ out, int n, int width) {
    PDL_ENTRY();
    const int vec = width / 8;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < (long long)n * vec;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long i = idx / vec, v = idx - i * vec;
        const uint4* s = reinterpret_cast<const uint4*>(cache + (size_t)slots[i] * width) + v;
        reinterpret_cast<uint4*>(out + (size_t)i * width)[v] = *s;
    }
}
