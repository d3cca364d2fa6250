//! A thin, explicit layer over the CUDA driver API (through cudarc's dynamically loaded bindings):
//! one context and one non-default stream per device, raw device buffers with typed lengths,
//! pinned staging memory, kernel modules, cuBLAS and CUDA graphs. Everything here is used from the
//! single worker thread that owns the device; nothing is `Send` on purpose.

// Streams, events and graphs are opaque driver handles (pointers in the C API): they are only
// ever handed back to the driver, never dereferenced on the Rust side.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod blas;
mod blas_lt;
mod buffer;
mod context;
mod event;
mod graph;
mod module;
pub mod nccl;

pub use blas::{Blas, Gemm, GemmOut};
pub use blas_lt::{BlasLt, Fp8BlockGemm};
pub use buffer::{download as download_slice, wait_for_legacy_copies, DSlice, DeviceBuffer, PinnedBuffer};
pub use context::{Gpu, GpuInfo};
pub use event::Event;
pub use graph::{Graph, GraphNode};
pub use module::{Arg, Kernel, Modules};

/// A CUDA driver or cuBLAS failure, with what we were doing.
#[derive(Debug, thiserror::Error)]
#[error("CUDA: {what}: {detail}")]
pub struct CudaError {
    pub what: String,
    pub detail: String,
}

pub type Result<T> = std::result::Result<T, CudaError>;

pub(crate) trait Check<T> {
    fn ctx(self, what: &str) -> Result<T>;
}

impl<T> Check<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn ctx(self, what: &str) -> Result<T> {
        self.map_err(|e| {
            let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            CudaError { what: what.to_string(), detail: format!("{name}: {text}") }
        })
    }
}

impl<T> Check<T> for std::result::Result<T, cudarc::cublas::result::CublasError> {
    fn ctx(self, what: &str) -> Result<T> {
        self.map_err(|e| CudaError { what: what.to_string(), detail: format!("cuBLAS {:?}", e.0) })
    }
}
