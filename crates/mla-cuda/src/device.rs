//! Everything one GPU needs to run kernels: context + stream, loaded modules, cuBLAS(Lt).

use crate::gpu::{Blas, BlasLt, Gpu, Modules};
use crate::ops::Kernels;

/// Owned by one thread. Field order is drop order: cuBLAS and modules go before the context.
pub struct Device {
    pub blas: Blas,
    /// cuBLASLt, for the block-scaled FP8 GEMMs.
    pub blas_lt: BlasLt,
    pub k: Kernels,
    modules: Modules,
    pub gpu: Gpu,
}

impl Device {
    pub fn new(ordinal: usize) -> anyhow::Result<Self> {
        let gpu = Gpu::new(ordinal)?;
        let modules = Modules::load(gpu.info.compute_capability)?;
        if modules.used_ptx {
            tracing::warn!(
                "{} has compute capability {:?}: running the compute_80 PTX through the driver's JIT (tuned for sm_90a)",
                gpu.info.name,
                gpu.info.compute_capability
            );
        }
        let k = Kernels::load(&modules, &gpu.info)?;
        let blas = Blas::new(gpu.stream())?;
        let blas_lt = BlasLt::new()?;
        Ok(Device { blas, blas_lt, k, modules, gpu })
    }

    pub fn stream(&self) -> cudarc::driver::sys::CUstream {
        self.gpu.stream()
    }

    /// Whether the modules came from PTX (not the sm_90a cubin).
    pub fn jit(&self) -> bool {
        self.modules.used_ptx
    }
}
