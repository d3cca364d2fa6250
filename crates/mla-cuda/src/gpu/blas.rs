//! cuBLAS on our stream, with a fixed workspace so calls can be captured into CUDA graphs.
//!
//! cuBLAS is column-major; every wrapper here takes row-major operands (PyTorch layout) and maps
//! `Y = X · Wᵀ` (X [rows, in], W [out, in]) onto `Yᵀ = W · Xᵀ` in column-major terms.

use super::{Check, DeviceBuffer, Result};
use cudarc::cublas::{result as cb, sys as cbs};
use cudarc::driver::sys as drv;
use std::ffi::c_void;

const WORKSPACE_BYTES: usize = 32 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmOut {
    Bf16,
    F32,
}

pub struct Blas {
    handle: cbs::cublasHandle_t,
    _workspace: DeviceBuffer<u8>,
}

/// One column-major GEMM description (internal).
pub struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub c: u64,
    pub ldc: usize,
    /// Input element type: bf16 unless `f32_inputs`.
    pub f32_inputs: bool,
    pub out: GemmOut,
    /// (count, stride_a, stride_b, stride_c) in elements for strided-batched GEMMs.
    pub batch: Option<(usize, usize, usize, usize)>,
}

impl Blas {
    pub fn new(stream: drv::CUstream) -> Result<Self> {
        // SAFETY: probing for libcublas only opens the library.
        if !unsafe { cbs::is_culib_present() } {
            return Err(super::CudaError {
                what: "loading cuBLAS".into(),
                detail: "libcublas.so was not found (set LD_LIBRARY_PATH to the CUDA 13 libraries)".into(),
            });
        }
        let handle = cb::create_handle().ctx("cublasCreate")?;
        // SAFETY: `handle` was just created; the stream outlives it (the Device drops Blas before its Gpu).
        unsafe { cb::set_stream(handle, stream as cbs::cudaStream_t) }.ctx("cublasSetStream")?;
        let workspace = DeviceBuffer::<u8>::alloc(WORKSPACE_BYTES)?;
        // SAFETY: the workspace holds WORKSPACE_BYTES and lives in `Blas` as long as the handle.
        unsafe { cbs::cublasSetWorkspace_v2(handle, workspace.ptr() as *mut c_void, WORKSPACE_BYTES).result() }
            .ctx("cublasSetWorkspace")?;
        Ok(Blas { handle, _workspace: workspace })
    }

    pub fn gemm(&self, g: &Gemm) -> Result<()> {
        let op = |t: bool| if t { cbs::cublasOperation_t::CUBLAS_OP_T } else { cbs::cublasOperation_t::CUBLAS_OP_N };
        let in_ty = if g.f32_inputs { cbs::cudaDataType::CUDA_R_32F } else { cbs::cudaDataType::CUDA_R_16BF };
        let out_ty = match g.out {
            GemmOut::Bf16 => cbs::cudaDataType::CUDA_R_16BF,
            GemmOut::F32 => cbs::cudaDataType::CUDA_R_32F,
        };
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let compute = cbs::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cbs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        // SAFETY: the wrappers that build `Gemm` check every operand's size against m, n, k and the
        // leading dimensions; alpha and beta outlive the call, which only queues work.
        unsafe {
            match g.batch {
                None => cb::gemm_ex(
                    self.handle,
                    op(g.trans_a),
                    op(g.trans_b),
                    g.m as i32,
                    g.n as i32,
                    g.k as i32,
                    &alpha as *const f32 as *const c_void,
                    g.a as *const c_void,
                    in_ty,
                    g.lda as i32,
                    g.b as *const c_void,
                    in_ty,
                    g.ldb as i32,
                    &beta as *const f32 as *const c_void,
                    g.c as *mut c_void,
                    out_ty,
                    g.ldc as i32,
                    compute,
                    algo,
                ),
                Some((count, sa, sb, sc)) => cb::gemm_strided_batched_ex(
                    self.handle,
                    op(g.trans_a),
                    op(g.trans_b),
                    g.m as i32,
                    g.n as i32,
                    g.k as i32,
                    &alpha as *const f32 as *const c_void,
                    g.a as *const c_void,
                    in_ty,
                    g.lda as i32,
                    sa as i64,
                    g.b as *const c_void,
                    in_ty,
                    g.ldb as i32,
                    sb as i64,
                    &beta as *const f32 as *const c_void,
                    g.c as *mut c_void,
                    out_ty,
                    g.ldc as i32,
                    sc as i64,
                    count as i32,
                    compute,
                    algo,
                ),
            }
        }
        .ctx(&format!("cublasGemmEx m={} n={} k={} batch={:?}", g.m, g.n, g.k, g.batch.map(|b| b.0)))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle is destroyed once, here.
        unsafe {
            let _ = cb::destroy_handle(self.handle);
        }
    }
}
