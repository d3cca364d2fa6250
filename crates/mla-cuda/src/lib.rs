//! CUDA backend of mla-serve: kernels compiled by build.rs and embedded in the binary, cuBLAS for
//! dense projections, a paged latent KV cache on the device, device-side sampling, and a worker
//! thread that owns the context. See docs/cuda-notes.md.

pub mod embedded;
pub mod gpu;
