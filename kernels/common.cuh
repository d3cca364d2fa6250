// Shared device helpers for mla-serve kernels: bf16 conversion, warp/block reductions, and the
// tensor-core building blocks (mma.sync m16n8k16 bf16, ldmatrix, cp.async) used by the attention
// and grouped-GEMM kernels. Everything here is sm_80+ PTX so the same source also builds the
// compute_80 fallback.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "dims.cuh"

typedef __nv_bfloat16 bf16;

#define DEVICE_INLINE __device__ __forceinline__

DEVICE_INLINE float to_f32(bf16 x) { return __bfloat162float(x); }
DEVICE_INLINE bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }
// Rounds through bf16 and back, to mirror PyTorch where it materialises a bf16 intermediate.
DEVICE_INLINE float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Programmatic dependent launch (Hopper). The host launches our kernels with the
// programmatic-stream-serialization attribute on sm_90 (crates/mla-cuda/src/gpu/module.rs), so a
// kernel may start while its predecessor in the stream is still running. Every kernel therefore
// calls PDL_ENTRY() before it reads or writes anything a predecessor may touch: `pdl_wait` blocks
// until the predecessor grid has completed and its writes are visible, and `pdl_trigger` then
// lets the next kernel's blocks be scheduled so that their launch and any weight prefetch before
// their own wait overlap this kernel's work. Waiting before triggering keeps at most one kernel
// ahead and makes every kernel's completion imply its predecessors' (each passed its wait). Both
// are no-ops when the kernel was launched without the attribute, and absent from the compute_80
// PTX, where the host never sets it.
DEVICE_INLINE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
DEVICE_INLINE void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Starts pulling `bytes` (a multiple of 16, below 4 GiB) at `p` (16-byte aligned) into L2 without
// waiting: the bulk-copy engine's prefetch on sm_90, nothing elsewhere.
DEVICE_INLINE void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}
#define PDL_ENTRY()    \
    do {               \
        pdl_wait();    \
        pdl_trigger(); \
    } while (0)

DEVICE_INLINE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

DEVICE_INLINE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum and max over the four lanes of an MMA quad (lanes that differ in their two low bits), which
// hold one accumulator row's columns in the mma.sync and wgmma layouts: the softmax epilogues.
DEVICE_INLINE float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

DEVICE_INLINE float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Sum over the whole block; `scratch` holds at least 32 floats. Every thread gets the result.
DEVICE_INLINE float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(t);
}

DEVICE_INLINE float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : -INFINITY;
    return warp_max(t);
}

DEVICE_INLINE double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < nwarps ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// ---- tensor cores -------------------------------------------------------------------------
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 (k x n):    b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8 f32:        c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)

DEVICE_INLINE void mma_bf16_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DEVICE_INLINE uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Thread-block clusters (sm_90; elsewhere the callers never launch a cluster).
DEVICE_INLINE void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The f32 at `p` in the shared memory of the cluster's CTA `rank`.
DEVICE_INLINE float ld_dsmem_f32(const float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    __trap();
    return 0.f;
#endif
}

// Four 8x8 b16 matrices, transposed on the way: lanes 8i..8i+7 give the row addresses of matrix i;
// register i of a lane receives (row 2t..2t+1, column g) of matrix i.
DEVICE_INLINE void ldmatrix_x4_trans(uint32_t r[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr)));
}

DEVICE_INLINE uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

DEVICE_INLINE uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// 16-byte global->shared copy that bypasses registers; `valid == false` writes zeros instead.
DEVICE_INLINE void cp_async_16(void* smem, const void* gmem, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}
DEVICE_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVICE_INLINE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- misc ----------------------------------------------------------------------------------

// Ordered integer image of a float: a < b  <=>  key(a) < key(b) (for radix selection).
DEVICE_INLINE uint32_t float_key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
DEVICE_INLINE float key_float(uint32_t k) {
    uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    return __uint_as_float(u);
}

// SplitMix64 finaliser: a good 64-bit hash for counter-based random numbers.
DEVICE_INLINE uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// Uniform in the open interval (0, 1) with 53 bits.
DEVICE_INLINE double uniform_open(uint64_t h) { return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
