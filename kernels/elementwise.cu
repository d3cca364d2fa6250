// Small memory-bound kernels of the forward pass: embedding gather, RMSNorm variants, SiLU·mul,
// bf16 -> f32 conversion and on-device random weights. One block per row where a row reduction
// is needed; rounding mirrors HF transformers running in bf16 where it materialises bf16 values.
#include "common.cuh"

// residual[t, :] = table[ids[t], :] (f32 residual stream; bf16 values are exact in f32).
extern "C" __global__ void embedding_gather(const bf16* __restrict__ table, const int* __restrict__ ids,
                                            float* __restrict__ residual, int hidden) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    const bf16* row = table + (size_t)ids[t] * hidden;
    float* out = residual + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = to_f32(row[i]);
}

// HF DeepseekV2RMSNorm: x * rsqrt(mean(x²) + eps) rounded to bf16, times the bf16 gain, rounded.
// One block of 256 threads per row; each thread keeps its (at most 32) values in registers, so
// the row is read once and every load of a thread is independent (hidden <= 8192). Calls
// PDL_ENTRY itself, after loading the gain.
constexpr int NORM_THREADS = 256, NORM_MAX_PER_THREAD = 32;

DEVICE_INLINE float to_f32(float x) { return x; }

template <bool ADD, typename Delta>
DEVICE_INLINE void residual_rmsnorm(float* __restrict__ residual, const Delta* __restrict__ delta,
                                    const bf16* __restrict__ w, bf16* __restrict__ out, int hidden, float eps) {
    __shared__ float scratch[32];
    const size_t t = blockIdx.x;
    float* x = residual + t * hidden;
    // The gain does not depend on the previous kernel: load it before waiting for it.
    float g[NORM_MAX_PER_THREAD];
#pragma unroll
    for (int k = 0; k < NORM_MAX_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * NORM_THREADS;
        g[k] = i < hidden ? to_f32(w[i]) : 0.f;
    }
    PDL_ENTRY();
    float v[NORM_MAX_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_MAX_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * NORM_THREADS;
        v[k] = 0.f;
        if (i < hidden) {
            float a = x[i];
            if (ADD) a += to_f32(delta[t * hidden + i]);
            v[k] = a;
            ss += a * a;
        }
    }
    if (ADD) {
#pragma unroll
        for (int k = 0; k < NORM_MAX_PER_THREAD; ++k) {
            const int i = threadIdx.x + k * NORM_THREADS;
            if (i < hidden) x[i] = v[k];
        }
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < NORM_MAX_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * NORM_THREADS;
        if (i < hidden) out[t * hidden + i] = to_bf16(g[k] * round_bf16(v[k] * r));
    }
}

// out = rmsnorm(residual) (first layer: nothing to add yet).
extern "C" __global__ void __launch_bounds__(256) rmsnorm_f32(float* __restrict__ residual, const bf16* __restrict__ w,
                                                              bf16* __restrict__ out, int hidden, float eps) {
    residual_rmsnorm<false, bf16>(residual, nullptr, w, out, hidden, eps);
}

// residual += delta; out = rmsnorm(residual). The f32 residual keeps the sum of many layers exact
// to f32 instead of re-rounding it to bf16 after every block.
extern "C" __global__ void __launch_bounds__(256)
    add_rmsnorm(float* __restrict__ residual, const bf16* __restrict__ delta, const bf16* __restrict__ w,
                bf16* __restrict__ out, int hidden, float eps) {
    residual_rmsnorm<true, bf16>(residual, delta, w, out, hidden, eps);
}

// add_rmsnorm with an f32 delta: the sum over tensor-parallel ranks of their bf16 partials,
// all-reduced in f32 (with one rank it is the bf16 delta widened, so the result is bit-equal).
extern "C" __global__ void __launch_bounds__(256)
    add_rmsnorm_f32_delta(float* __restrict__ residual, const float* __restrict__ delta, const bf16* __restrict__ w,
                          bf16* __restrict__ out, int hidden, float eps) {
    residual_rmsnorm<true, float>(residual, delta, w, out, hidden, eps);
}

// The same norms with each row spread over a cluster of NORM_SPLIT CTAs (sm_90), for steps of a
// few rows. One CTA per row leaves a V3 row (7,168 values: about 100 KB moved) to one SM, whose
// dependent passes took 12.4 us under ncu at batch 1 while the other SMs idled (run S31; 5.6 us
// launched back to back against 3.8 split, S32). Here CTA `rank` of row `blockIdx.y`'s cluster
// owns the rank-th slice of hidden / NORM_SPLIT values, and the slices' sums of squares meet in
// distributed shared memory, each CTA adding all of them in rank order, so every CTA gets the
// same bits. Needs hidden % NORM_SPLIT == 0 and hidden <= NORM_SPLIT * SPLIT_NORM_THREADS *
// SPLIT_NORM_MAX_PER_THREAD (the launcher checks).
constexpr int NORM_SPLIT = 8, SPLIT_NORM_THREADS = 128, SPLIT_NORM_MAX_PER_THREAD = 8;

template <bool ADD, typename Delta>
DEVICE_INLINE void residual_rmsnorm_split(float* __restrict__ residual, const Delta* __restrict__ delta,
                                          const bf16* __restrict__ w, bf16* __restrict__ out, int hidden, float eps) {
    __shared__ float scratch[32];
    __shared__ float partial;
    const int slice = hidden / NORM_SPLIT, base = blockIdx.x * slice;
    const size_t t = blockIdx.y;
    float* x = residual + t * hidden + base;
    float g[SPLIT_NORM_MAX_PER_THREAD];
#pragma unroll
    for (int k = 0; k < SPLIT_NORM_MAX_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * SPLIT_NORM_THREADS;
        g[k] = i < slice ? to_f32(w[base + i]) : 0.f;
    }
    PDL_ENTRY();
    float v[SPLIT_NORM_MAX_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < SPLIT_NORM_MAX_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * SPLIT_NORM_THREADS;
        v[k] = 0.f;
        if (i < slice) {
            float a = x[i];
            if (ADD) a += to_f32(delta[t * hidden + base + i]);
            v[k] = a;
            ss += a * a;
        }
    }
    if (ADD) {
#pragma unroll
        for (int k = 0; k < SPLIT_NORM_MAX_PER_THREAD; ++k) {
            const int i = threadIdx.x + k * SPLIT_NORM_THREADS;
            if (i < slice) x[i] = v[k];
        }
    }
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) partial = ss;
    cluster_sync_all();
    float total = 0.f;
    for (int r = 0; r < NORM_SPLIT; ++r) total += ld_dsmem_f32(&partial, r);
    cluster_sync_all();  // no CTA leaves while another still reads its partial
    const float r = rsqrtf(total / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < SPLIT_NORM_MAX_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * SPLIT_NORM_THREADS;
        if (i < slice) out[t * hidden + base + i] = to_bf16(g[k] * round_bf16(v[k] * r));
    }
}

extern "C" __global__ void __launch_bounds__(SPLIT_NORM_THREADS)
    rmsnorm_f32_split(float* __restrict__ residual, const bf16* __restrict__ w, bf16* __restrict__ out, int hidden,
                      float eps) {
    residual_rmsnorm_split<false, bf16>(residual, nullptr, w, out, hidden, eps);
}

extern "C" __global__ void __launch_bounds__(SPLIT_NORM_THREADS)
    add_rmsnorm_split(float* __restrict__ residual, const bf16* __restrict__ delta, const bf16* __restrict__ w,
                      bf16* __restrict__ out, int hidden, float eps) {
    residual_rmsnorm_split<true, bf16>(residual, delta, w, out, hidden, eps);
}

extern "C" __global__ void __launch_bounds__(SPLIT_NORM_THREADS)
    add_rmsnorm_f32_delta_split(float* __restrict__ residual, const float* __restrict__ delta,
                                const bf16* __restrict__ w, bf16* __restrict__ out, int hidden, float eps) {
    residual_rmsnorm_split<true, float>(residual, delta, w, out, hidden, eps);
}

// RMSNorm of a strided bf16 input (q_a_layernorm of V2/V3 queries).
extern "C" __global__ void rmsnorm_bf16(const bf16* __restrict__ x, int x_stride, const bf16* __restrict__ w,
                                        bf16* __restrict__ out, int out_stride, int n, float eps) {
    PDL_ENTRY();
    __shared__ float scratch[32];
    const size_t t = blockIdx.x;
    const bf16* xr = x + t * x_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[t * out_stride + i] = to_bf16(to_f32(w[i]) * round_bf16(to_f32(xr[i]) * r));
}

// out[r, i] = silu(gate[r, i]) * up[r, i] with gate_up[r] = [gate (inter) | up (inter)].
// HF rounds silu's output to bf16 before the product; so do we.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out, int inter,
                                    long long total) {
    PDL_ENTRY();
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / inter, i = idx - r * inter;
        const float g = to_f32(gate_up[r * 2 * inter + i]);
        const float u = to_f32(gate_up[r * 2 * inter + inter + i]);
        const float s = round_bf16(g / (1.f + __expf(-g)));
        out[idx] = to_bf16(s * u);
    }
}

extern "C" __global__ void bf16_to_f32(const bf16* __restrict__ x, float* __restrict__ y, long long n) {
    PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = to_f32(x[i]);
}

// Random weights on the device (--load-format dummy): mean + std * N(0,1), counter-based so the
// values depend only on (seed, index), never on the launch shape.
extern "C" __global__ void fill_normal_bf16(bf16* __restrict__ out, long long n, unsigned long long seed, float mean,
                                            float std) {
    PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const uint64_t pair = (uint64_t)(i >> 1);
        const double u1 = uniform_open(mix64(seed ^ mix64(2 * pair)));
        const double u2 = uniform_open(mix64(seed ^ mix64(2 * pair + 1)));
        const double r = sqrt(-2.0 * log(u1));
        const double th = 6.283185307179586 * u2;
        const double z = (i & 1) ? r * sin(th) : r * cos(th);
        out[i] = to_bf16(mean + std * (float)z);
    }
}

extern "C" __global__ void fill_normal_f32(float* __restrict__ out, long long n, unsigned long long seed, float mean,
                                           float std) {
    PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const uint64_t pair = (uint64_t)(i >> 1);
        const double u1 = uniform_open(mix64(seed ^ mix64(2 * pair)));
        const double u2 = uniform_open(mix64(seed ^ mix64(2 * pair + 1)));
        const double r = sqrt(-2.0 * log(u1));
        const double th = 6.283185307179586 * u2;
        const double z = (i & 1) ? r * sin(th) : r * cos(th);
        out[i] = mean + std * (float)z;
    }
}

// out[i, :] = x[idx[i], :] for `rows` rows of `width` bf16 values (width % 8 == 0), 16 bytes per
// thread and step: latent rows of the cache by slot (prefill), token rows by routed assignment
// (MoE experts), hidden rows by logits request (output head).
extern "C" __global__ void gather_rows(const bf16* __restrict__ x, const int* __restrict__ idx, bf16* __restrict__ out,
                                       int rows, int width) {
    PDL_ENTRY();
    const int vec = width / 8;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)rows * vec;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / vec, v = i - r * vec;
        reinterpret_cast<uint4*>(out + (size_t)r * width)[v] =
            reinterpret_cast<const uint4*>(x + (size_t)idx[r] * width)[v];
    }
}
