//! cuBLASLt's block-scaled FP8 GEMM (CUDA 12.9+, Hopper only): `Y = X · Wᵀ` with X e4m3 and one
//! f32 scale per row and 128 columns (VEC128_32F), W e4m3 with one f32 scale per 128x128 block
//! (BLK128x128_32F: DeepSeek-V3's `weight_scale_inv` as stored), f32 accumulation, bf16 out.
//! The prefill path of FP8 projections (issue 12): measured at 1,050 to 1,300 TFLOP/s at M=4096
//! on V3's shapes on an H200 (../shared/design/fp8-mtp.md §1.5), 1.4 to 1.7x bf16 cuBLAS.
//!
//! Row-major as everywhere in this crate: `Yᵀ [N, M] = W [N, K] · Xᵀ` in column-major terms, i.e.
//! cuBLAS's A = W (transposed, "TN" as FP8 requires), B = X. A plan (descriptors, layouts and the
//! heuristic's algorithm) is made once per shape and kept; the scale pointers are set per call.

use super::{CudaError, DeviceBuffer, Result};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys as drv;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

const WORKSPACE_BYTES: usize = 32 << 20;

/// One block-scaled GEMM: `y[r, :] = x[r, :] · Wᵀ` for `rows` rows (device pointers).
pub struct Fp8BlockGemm {
    pub rows: usize,
    pub out: usize,
    pub inp: usize,
    /// e4m3 `[rows, inp]`, packed.
    pub x: u64,
    /// f32 `[ceil(inp / 128), scale_ld]`: the scale of row r, group g at `g * scale_ld + r`.
    pub x_scales: u64,
    pub x_scale_ld: usize,
    /// e4m3 `[out, inp]` and its f32 grid `[ceil(out / 128), ceil(inp / 128)]`.
    pub w: u64,
    pub w_scales: u64,
    /// bf16 `[rows, y_stride]`.
    pub y: u64,
    pub y_stride: usize,
}

pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBuffer<u8>,
    plans: RefCell<HashMap<PlanKey, Plan>>,
}

/// rows, out, inp, y stride, activation-scale leading dimension.
type PlanKey = (usize, usize, usize, usize, usize);

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `BlasLt::plan` and destroyed once, here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn check<T>(r: std::result::Result<T, lt::CublasError>, what: &str) -> Result<T> {
    r.map_err(|e| CudaError { what: what.to_string(), detail: format!("cuBLASLt {:?}", e.0) })
}

/// Sets one attribute of a matmul descriptor from a plain value.
unsafe fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    // SAFETY: `v` is a live value of the size passed (the caller picks the attribute's type).
    check(
        unsafe { lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, size_of::<T>()) },
        "cublasLtMatmulDescSetAttribute",
    )
}

impl BlasLt {
    pub fn new() -> Result<Self> {
        let handle = check(lt::create_handle(), "cublasLtCreate")?;
        Ok(BlasLt { handle, workspace: DeviceBuffer::alloc(WORKSPACE_BYTES)?, plans: RefCell::default() })
    }

    /// The plan for a shape, made at its first use (`NOT_SUPPORTED` where cuBLASLt has no kernel:
    /// row counts that are not a multiple of 4, K not a multiple of 16, GPUs other than sm_90).
    fn plan(&self, g: &Fp8BlockGemm) -> Result<std::cell::RefMut<'_, Plan>> {
        let key = (g.rows, g.out, g.inp, g.y_stride, g.x_scale_ld);
        let mut plans = self.plans.borrow_mut();
        if let std::collections::hash_map::Entry::Vacant(slot) = plans.entry(key) {
            slot.insert(self.make_plan(g)?);
        }
        Ok(std::cell::RefMut::map(plans, |p| p.get_mut(&key).expect("inserted above")))
    }

    /// Descriptors, layouts and the heuristic's algorithm for one shape.
    fn make_plan(&self, g: &Fp8BlockGemm) -> Result<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let (m, n, k) = (g.rows as u64, g.out as u64, g.inp as u64);
        let f8 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        // SAFETY: descriptors are created here and owned by the plan; attribute values are
        // plain enums/ints of the sizes cuBLASLt documents.
        let plan = unsafe {
            let desc = check(
                lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F),
                "cublasLtMatmulDescCreate",
            )?;
            let mut plan = Plan {
                desc,
                a: check(lt::create_matrix_layout(f8, k, n, k as i64), "layout of W")?,
                b: check(lt::create_matrix_layout(f8, k, m, k as i64), "layout of X")?,
                d: check(
                    lt::create_matrix_layout(sys::cudaDataType_t::CUDA_R_16BF, n, m, g.y_stride as i64),
                    "layout of Y",
                )?,
                algo: std::mem::zeroed(),
            };
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N)?;
            let blk = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
            let vec = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &blk)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec)?;
            // The heuristic answers INVALID_VALUE while the scale pointers are unset (H100,
            // cuBLASLt 13.1): give it the first call's; every call sets its own.
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.w_scales)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.x_scales)?;
            let pref = check(lt::create_matmul_pref(), "cublasLtMatmulPreferenceCreate")?;
            let ws = WORKSPACE_BYTES as u64;
            let r = check(
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    size_of::<u64>(),
                ),
                "cublasLtMatmulPreferenceSetAttribute",
            )
            .and_then(|_| {
                check(
                    lt::get_matmul_algo_heuristic(self.handle, desc, plan.a, plan.b, plan.d, plan.d, pref),
                    "no cuBLASLt kernel for this block-scaled FP8 GEMM",
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            plan.algo = r
                .map_err(|mut e| {
                    e.detail = format!("{} (M={m}, N={n}, K={k})", e.detail);
                    e
                })?
                .algo;
            plan
        };
        Ok(plan)
    }

    /// Queues the GEMM on `stream` (capturable into a CUDA graph once its plan exists).
    pub fn fp8_block_gemm(&self, stream: drv::CUstream, g: &Fp8BlockGemm) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let plan = self.plan(g)?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the caller (ops::Fp8Gemm) checked every buffer against the shape; the plan's
        // descriptors live in `self`.
        unsafe {
            set_desc(plan.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.w_scales)?;
            set_desc(plan.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.x_scales)?;
            check(
                lt::matmul(
                    self.handle,
                    plan.desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    g.w as *const c_void,
                    plan.a,
                    g.x as *const c_void,
                    plan.b,
                    g.y as *const c_void,
                    plan.d,
                    g.y as *mut c_void,
                    plan.d,
                    &plan.algo,
                    self.workspace.ptr() as *mut c_void,
                    WORKSPACE_BYTES,
                    stream as sys::cudaStream_t,
                ),
                "cublasLtMatmul (block-scaled FP8)",
            )
        }
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: the handle was created in `new` and every plan using it is gone.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
