// MLA latent-cache kernels: kv_a_layernorm + YaRN RoPE + the write of [c_kv ; k_pe] into the paged
// cache through a slot mapping, fused with RoPE on every head's q_pe (and, for small decode steps,
// with the query absorption). The gather of cached latents for prefill is elementwise.cu's
// gather_rows.
#include "common.cuh"

#define ROPE_CACHE_PARAMS                                                                                              \
    const bf16 *__restrict__ kva, int kva_stride,                       /* [T, R + P]: c_kv (pre-norm) | k_pe */       \
        const bf16 *__restrict__ kv_norm_w,                             /* [R] */                                      \
        bf16 *__restrict__ q, int q_stride,                             /* [T, H * (nope + P)], q_pe roped in place */ \
        bf16 *__restrict__ q_pe_out, int qo_stride, int qo_head_stride, /* optional roped q_pe copy */                 \
        const int *__restrict__ positions, const int *__restrict__ slots, const float *__restrict__ inv_freq,          \
        float attn_factor, float eps, bf16 *__restrict__ cache, /* [slots, R + P] */                                   \
        int heads, int nope, int R, int P
#define ROPE_CACHE_ARGS                                                                                       \
    kva, kva_stride, kv_norm_w, q, q_stride, q_pe_out, qo_stride, qo_head_stride, positions, slots, inv_freq, \
        attn_factor, eps, cache, heads, nope, R, P

// Token t's kv_a_layernorm, RoPE and cache write, by the whole block. RoPE rotates consecutive
// pairs (x[2i], x[2i+1]) by pos * inv_freq[i], with cos/sin scaled by `attn_factor`, in f32 as
// HF's complex-multiply formulation does.
DEVICE_INLINE void rope_cache_token(const int t, ROPE_CACHE_PARAMS) {
    __shared__ float scratch[32];
    __shared__ float rot_cos[64], rot_sin[64];  // rope dim <= 128
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

// One block per fed token.
extern "C" __global__ void mla_rope_cache(ROPE_CACHE_PARAMS) {
    PDL_ENTRY();
    rope_cache_token(blockIdx.x, ROPE_CACHE_ARGS);
}

// Decode steps of a few tokens: mla_rope_cache and the query absorption in one launch (two
// launches fewer per layer than mla_rope_cache + a cuBLAS batched GEMM, at B=1 each a few
// microseconds of latency). Grid (heads + 1, T), ABSORB_THREADS threads: block (h < heads, t)
// writes q_abs[t, h, :R] = W_UK[h]^T q_nope[t, h] (kv_b = [heads * (nope + v), R], W_UK[h] its rows
// h * (nope + v) .. + nope), f32 sums rounded to bf16 as cuBLAS's; block (heads, t) is token t's
// rope/cache block, which also puts the roped q_pe at q_pe_out (q_abs + R). Each warp of an
// absorb block owns nope / 16 rows of W_UK[h] and every lane 16 of the R = 512 columns, loaded
// into registers before the PDL wait (weights do not depend on the previous kernel).
constexpr int ABSORB_THREADS = ROPE_ABSORB_THREADS, ABSORB_WARPS = ABSORB_THREADS / 32, ABSORB_ROWS = 8;  // nope = 128
extern "C" __global__ void __launch_bounds__(ABSORB_THREADS)
    mla_rope_absorb_q(ROPE_CACHE_PARAMS, const bf16* __restrict__ kv_b, int v_dim, bf16* __restrict__ q_abs,
                      int qa_stride, int qa_head_stride) {
    const int h = blockIdx.x, t = blockIdx.y;
    if (h == heads) {
        PDL_ENTRY();
        rope_cache_token(t, ROPE_CACHE_ARGS);
        return;
    }
    __shared__ float qn[128];
    __shared__ float part[ABSORB_WARPS][512];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // nope == ABSORB_WARPS * ABSORB_ROWS and R == 512 (the host checks).
    const bf16* w = kv_b + ((size_t)h * (nope + v_dim) + warp * ABSORB_ROWS) * R + lane * 16;
    uint4 wv[ABSORB_ROWS][2];
#pragma unroll
    for (int r = 0; r < ABSORB_ROWS; ++r) {
        wv[r][0] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)r * R));
        wv[r][1] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)r * R + 8));
    }
    PDL_ENTRY();
    if (threadIdx.x < nope) qn[threadIdx.x] = to_f32(q[(size_t)t * q_stride + (size_t)h * (nope + P) + threadIdx.x]);
    __syncthreads();
    float acc[16];
#pragma unroll
    for (int c = 0; c < 16; ++c) acc[c] = 0.f;
#pragma unroll
    for (int r = 0; r < ABSORB_ROWS; ++r) {
        const float x = qn[warp * ABSORB_ROWS + r];
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(wv[r]);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const float2 f = __bfloat1622float2(p[c]);
            acc[2 * c] = fmaf(x, f.x, acc[2 * c]);
            acc[2 * c + 1] = fmaf(x, f.y, acc[2 * c + 1]);
        }
    }
#pragma unroll
    for (int c = 0; c < 16; ++c) part[warp][lane * 16 + c] = acc[c];
    __syncthreads();
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < ABSORB_WARPS; ++k) sum += part[k][threadIdx.x];
    q_abs[(size_t)t * qa_stride + (size_t)h * qa_head_stride + threadIdx.x] = to_bf16(sum);
}