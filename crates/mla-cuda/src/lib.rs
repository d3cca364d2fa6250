//! CUDA backend of mla-serve: kernels compiled by build.rs and embedded in the binary, cuBLAS for
//! dense projections, a paged latent KV cache on the device, device-side sampling, and a worker
//! thread that owns the context. See docs/cuda-backend.md.

pub mod collective;
pub mod cuda_backend;
pub mod device;
pub mod embedded;
pub mod gpu;
pub mod group;
pub mod layout;
pub mod model;
pub mod ops;
pub mod options;
pub mod worker;

pub use cuda_backend::CudaBackend;
pub use device::Device;
pub use options::{CudaOptions, WeightsFrom, DEFAULT_GRAPH_BATCH_SIZES};
pub use worker::{DeviceWorker, StepClock};

/// Whether this binary carries compiled kernels (false when nvcc was absent at build time).
pub fn kernels_built() -> bool {
    embedded::KERNELS_BUILT
}

/// Number of CUDA devices this process can see; 0 when no driver is installed. Never panics,
/// so `--device auto` can probe on machines without a GPU.
pub fn visible_gpus() -> usize {
    // SAFETY: probing only opens the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count().map_or(0, |c| c.max(0) as usize)
}
