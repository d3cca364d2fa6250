// Launch floor on the GPU: 600 dependent launches of a tiny kernel, eager and as one CUDA graph,
// plain, with griddepcontrol in the kernel but no launch attribute, and with programmatic
// dependent launch (PDL). Standalone (no Rust): on the GPU machine,
//   nvcc -O3 -arch=sm_90a -std=c++17 benches/launch_chain.cu -o /tmp/launch_chain && /tmp/launch_chain
// Results (H200, 2026-11-22): docs/runs/2026-11-22.md, "Launch-bound decode at small batch", and
// benches/results/2026-11-22/H4-aa3c42b/launch-chain.txt.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x)                                                                \
    do {                                                                     \
        cudaError_t e = (x);                                                 \
        if (e != cudaSuccess) {                                              \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
            return 1;                                                        \
        }                                                                    \
    } while (0)
template <int MODE>  // 0: nothing, 1: wait+trigger at entry
__global__ void tiny(float* x, int n) {
    if (MODE == 1) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = x[i] * 0.5f + 1.f;
}
template <int MODE>
cudaError_t launch(cudaStream_t s, bool pdl, float* x, int n, int blocks) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cudaLaunchAttribute a[1];
    a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = a;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, tiny<MODE>, x, n);
}
int main() {
    float* x;
    CK(cudaMalloc(&x, 1 << 24));
    CK(cudaMemset(x, 0, 1 << 24));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const int N = 600;
    for (int blocks : {1, 32, 132})
        for (int n : {2048, 1 << 20})
            for (int cfgi = 0; cfgi < 3; ++cfgi) {
                const bool pdl = cfgi == 2;
                const int mode = cfgi >= 1;
                auto chain = [&]() {
                    for (int i = 0; i < N; ++i) {
                        cudaError_t e = mode ? launch<1>(s, pdl, x, n, blocks) : launch<0>(s, pdl, x, n, blocks);
                        if (e) return e;
                    }
                    return cudaSuccess;
                };
                CK(chain());
                CK(cudaStreamSynchronize(s));
                float eager = 0, graph = 0;
                CK(cudaEventRecord(a, s));
                for (int r = 0; r < 5; ++r) CK(chain());
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                CK(cudaEventElapsedTime(&eager, a, b));
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
                CK(chain());
                CK(cudaStreamEndCapture(s, &g));
                CK(cudaGraphInstantiate(&ge, g, 0));
                CK(cudaGraphLaunch(ge, s));
                CK(cudaStreamSynchronize(s));
                CK(cudaEventRecord(a, s));
                for (int r = 0; r < 5; ++r) CK(cudaGraphLaunch(ge, s));
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                CK(cudaEventElapsedTime(&graph, a, b));
                printf("blocks %3d n %8d %-22s eager %6.2f us/kernel  graph %6.2f us/kernel\n", blocks, n,
                       cfgi == 0       ? "plain"
                           : cfgi == 1 ? "griddepcontrol, no attr"
                                       : "griddepcontrol + PDL",
                       eager * 1e3 / (5 * N), graph * 1e3 / (5 * N));
                cudaGraphExecDestroy(ge);
                cudaGraphDestroy(g);
            }
    return 0;
}
