// MLA latent-cache kernels: kv_a_layernorm + YaRN RoPE + the write of [c_kv ; k_pe] into the paged
// cache through a slot mapping (bf16 rows, or the FP8 rows of latent_fp8.cuh), fused with RoPE on
// every head's q_pe (and, for small decode steps, with the query absorption); and the gather of an
// FP8 cache's rows as bf16 for prefill (a bf16 cache's rows go through elementwise.cu's
// gather_rows).
#include "common.cuh"
#include "latent_fp8.cuh"

#define ROPE_CACHE_PARAMS                                                                                              \
    const bf16 *__restrict__ kva, int kva_stride,                       /* [T, R + P]: c_kv (pre-norm) | k_pe */       \
        const bf16 *__restrict__ kv_norm_w,                             /* [R] */                                      \
        bf16 *__restrict__ q, int q_stride,                             /* [T, H * (nope + P)], q_pe roped in place */ \
        bf16 *__restrict__ q_pe_out, int qo_stride, int qo_head_stride, /* optional roped q_pe copy */                 \
        const int *__restrict__ positions, const int *__restrict__ slots, const float *__restrict__ inv_freq,          \
        float attn_factor, float eps, void *__restrict__ cache, /* [slots, R + P] bf16 or FP8 rows */                  \
        int cache_fp8, int heads, int nope, int R, int P
#define ROPE_CACHE_ARGS                                                                                       \
    kva, kva_stride, kv_norm_w, q, q_stride, q_pe_out, qo_stride, qo_head_stride, positions, slots, inv_freq, \
        attn_factor, eps, cache, cache_fp8, heads, nope, R, P

// Quantizes the row in `vals` (R + P = LATENT_ROW values, already rounded to bf16 as a bf16 cache
// would hold them) into the FP8 row at dst, by the whole block: each warp takes groups of 64
// columns for their amax and exponent, then every thread a share of the codes.
DEVICE_INLINE void write_fp8_row(const float* vals, unsigned char* dst) {
    constexpr int GROUPS = LATENT_ROW / LATENT_FP8_GROUP;
    __shared__ int exps[GROUPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int g = warp; g < GROUPS; g += nwarps) {
        const float* v = vals + g * LATENT_FP8_GROUP;
        const float amax = warp_max(fmaxf(fabsf(v[lane]), fabsf(v[lane + 32])));
        if (lane == 0) exps[g] = latent_scale_exponent(amax);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < LATENT_ROW; i += blockDim.x)
        dst[i] = latent_fp8_code(vals[i], exps[i / LATENT_FP8_GROUP]);
    for (int i = threadIdx.x; i < LATENT_FP8_ROW_BYTES - LATENT_ROW; i += blockDim.x)
        dst[LATENT_ROW + i] = i < GROUPS ? (unsigned char)exps[i] : 0;
}

// Token t's kv_a_layernorm, RoPE and cache write, by the whole block. RoPE rotates consecutive
// pairs (x[2i], x[2i+1]) by pos * inv_freq[i], with cos/sin scaled by `attn_factor`, in f32 as
// HF's complex-multiply formulation does. An FP8 cache (R + P == LATENT_ROW, the host checks) gets
// the bf16 row's values quantized: the row is built in shared memory first.
DEVICE_INLINE void rope_cache_token(const int t, ROPE_CACHE_PARAMS) {
    __shared__ float scratch[32];
    __shared__ float rot_cos[64], rot_sin[64];  // rope dim <= 128
    __shared__ float fp8_vals[LATENT_ROW];
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
    const bool write = slot >= 0;
    bf16* dst = write && !cache_fp8 ? reinterpret_cast<bf16*>(cache) + (size_t)slot * (R + P) : nullptr;
    // Column i of the row, as the bf16 cache stores it.
    auto put = [&](int i, float v) {
        const bf16 b = to_bf16(v);
        if (dst)
            dst[i] = b;
        else if (write)
            fp8_vals[i] = to_f32(b);
    };

    float ss = 0.f;
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        float v = to_f32(src[i]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)R + eps);
    for (int i = threadIdx.x; i < R; i += blockDim.x) put(i, to_f32(kv_norm_w[i]) * round_bf16(to_f32(src[i]) * r));

    // k_pe (shared by all heads) and every head's q_pe: (heads + 1) * half rotations. (The
    // block_sum above synchronised after the cos/sin table was written.)
    for (int j = threadIdx.x; j < (heads + 1) * half; j += blockDim.x) {
        const int h = j / half, i = j - h * half;
        const float c = rot_cos[i], s = rot_sin[i];
        if (h == heads) {
            const float x0 = to_f32(src[R + 2 * i]), x1 = to_f32(src[R + 2 * i + 1]);
            put(R + 2 * i, x0 * c - x1 * s);
            put(R + 2 * i + 1, x0 * s + x1 * c);
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
    if (write && cache_fp8) {
        __syncthreads();
        write_fp8_row(fp8_vals, reinterpret_cast<unsigned char*>(cache) + (size_t)slot * LATENT_FP8_ROW_BYTES);
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
// out[i, :] = the bf16 values of FP8 cache row idx[i] (576 of them), exactly: the prefill gather
// of an FP8 cache. One thread per 8 codes of a row (72 per row), grid-stride.
extern "C" __global__ void gather_latent_fp8(const unsigned char* __restrict__ cache, const int* __restrict__ idx,
                                             bf16* __restrict__ out, int rows) {
    PDL_ENTRY();
    constexpr int CHUNKS = LATENT_ROW / 8;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)rows * CHUNKS;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / CHUNKS;
        const int c = (int)(i - r * CHUNKS);
        const unsigned char* row = cache + (size_t)idx[r] * LATENT_FP8_ROW_BYTES;
        const uint2 codes = *reinterpret_cast<const uint2*>(row + c * 8);
        reinterpret_cast<uint4*>(out + (size_t)r * LATENT_ROW)[c] =
            latent_fp8x8_to_bf16(codes, latent_fp8_factor(row[LATENT_ROW + c * 8 / LATENT_FP8_GROUP]));
    }
}

// Benchmarks and dummy-weight runs: `rows` valid FP8 cache rows of pseudo-random codes (NaN codes
// replaced by zero) with every group's exponent at 120 (scale 2^-7: values within +-3.5, about
// the spread of the N(0, 1) values a bf16 cache gets), padding zero.
extern "C" __global__ void fill_latent_fp8_random(unsigned char* __restrict__ cache, long long rows,
                                                  unsigned long long seed) {
    PDL_ENTRY();
    const long long n = rows * LATENT_FP8_ROW_BYTES;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int col = (int)(i % LATENT_FP8_ROW_BYTES);
        unsigned char b;
        if (col < LATENT_ROW) {
            unsigned long long h = (unsigned long long)i * 0x9E3779B97F4A7C15ull + seed;
            h ^= h >> 31;
            h *= 0xBF58476D1CE4E5B9ull;
            h ^= h >> 29;
            b = (unsigned char)(h >> 24);
            if ((b & 0x7f) == 0x7f) b = 0;
        } else {
            b = col < LATENT_ROW + LATENT_ROW / LATENT_FP8_GROUP ? 120 : 0;
        }
        cache[i] = b;
    }
}
