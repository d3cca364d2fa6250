//! Loading the embedded kernel modules and launching their functions.

use super::{Check, CudaError, Result};
use crate::embedded::{EmbeddedModule, KERNELS_BUILT, MODULES, NVCC};
use cudarc::driver::{result, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};

/// A kernel argument: every kernel parameter of ours is a pointer or a 4/8-byte scalar.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    I64(i64),
    U64(u64),
}

impl Arg {
    fn bits(self) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::F32(v) => v.to_bits() as u64,
            Arg::I64(v) => v as u64,
        }
    }
}

/// A loaded kernel function.
#[derive(Clone, Copy)]
pub struct Kernel {
    pub name: &'static str,
    func: sys::CUfunction,
    /// Launch with programmatic stream serialization (see `Modules::pdl`).
    pdl: bool,
}

impl Kernel {
    /// The loaded function (to find this kernel's nodes in a captured graph).
    pub fn func(&self) -> sys::CUfunction {
        self.func
    }

    /// Queues the kernel on `stream`. Launch-configuration errors are reported here; faults
    /// inside the kernel surface at the next synchronisation.
    pub fn launch(
        &self,
        stream: sys::CUstream,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_cluster(stream, grid, block, smem, 1, args)
    }

    /// `launch` in thread-block clusters of `cluster` blocks along x (sm_90; 1: no cluster).
    /// `grid.0` must be a multiple of `cluster`.
    pub fn launch_cluster(
        &self,
        stream: sys::CUstream,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        cluster: u32,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // Little-endian: a 4-byte parameter reads the low half of its 8-byte slot.
        let mut store: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut ptrs: Vec<*mut c_void> = store.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        if !self.pdl && cluster <= 1 {
            // SAFETY: as below for cuLaunchKernelEx: one live 8-byte slot per kernel parameter.
            return unsafe { result::launch_kernel(self.func, grid, (block, 1, 1), smem, stream, &mut ptrs) }
                .ctx(&format!("launching {}", self.name));
        }
        let mut attrs = Vec::with_capacity(2);
        if self.pdl {
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
            });
        }
        if cluster > 1 {
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 },
                },
            });
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: `ptrs` points at one live 8-byte slot per kernel parameter; the config and its
        // attributes outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, self.func, ptrs.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .ctx(&format!("launching {}", self.name))
    }

    /// How many blocks of `block` threads (and `smem` dynamic shared memory) fit on one SM at
    /// once, for grids sized to exactly one wave.
    pub fn max_active_blocks_per_sm(&self, block: u32, smem: usize) -> Result<usize> {
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `n` outlives the call; `func` is a loaded function.
        unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.func, block as std::ffi::c_int, smem) }
            .result()
            .ctx(&format!("querying the occupancy of {}", self.name))?;
        Ok(n.max(1) as usize)
    }

    /// Allows `bytes` of dynamic shared memory (above the 48 KB default).
    pub fn set_max_dynamic_smem(&self, bytes: usize) -> Result<()> {
        // SAFETY: `func` is a loaded function; the attribute is a plain integer.
        unsafe {
            result::function::set_function_attribute(
                self.func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .ctx(&format!("raising the shared-memory limit of {}", self.name))
    }
}

/// Every embedded module, loaded into the current context: machine code on sm_90, PTX otherwise.
pub struct Modules {
    modules: HashMap<&'static str, sys::CUmodule>,
    pub used_ptx: bool,
    /// Programmatic dependent launch: on the sm_90a cubin every kernel begins with
    /// `PDL_ENTRY()` (kernels/common.cuh), so it may be launched while its predecessor runs and
    /// its launch latency (and the GEMV's weight prefetch) overlaps that kernel's tail. Off for
    /// the PTX fallback (the PTX has no griddepcontrol) and when `MLA_DISABLE_PDL=1` (A/B
    /// measurements, docs/performance.md).
    pub pdl: bool,
}

impl Modules {
    pub fn load(compute_capability: (i32, i32)) -> Result<Self> {
        if !KERNELS_BUILT {
            return Err(CudaError {
                what: "loading kernels".into(),
                detail: format!(
                    "built without CUDA kernels ({NVCC}); install nvcc (scripts/install_nvcc.sh) and rebuild"
                ),
            });
        }
        let use_cubin = compute_capability == (9, 0);
        let mut modules = HashMap::new();
        for m in MODULES {
            modules.insert(m.name, load_one(m, use_cubin)?);
        }
        let disabled = std::env::var("MLA_DISABLE_PDL").is_ok_and(|v| v == "1");
        Ok(Modules { modules, used_ptx: !use_cubin, pdl: use_cubin && !disabled })
    }

    pub fn kernel(&self, module: &str, name: &'static str) -> Result<Kernel> {
        let m = self.modules.get(module).ok_or_else(|| CudaError {
            what: format!("finding kernel {name}"),
            detail: format!("no module {module} was embedded"),
        })?;
        let cname = CString::new(name).unwrap();
        let func =
            // SAFETY: `m` is a loaded module that `Modules` keeps until its Drop.
            unsafe { result::module::get_function(*m, cname) }.ctx(&format!("finding kernel {module}::{name}"))?;
        Ok(Kernel { name, func, pdl: self.pdl })
    }
}

fn load_one(m: &EmbeddedModule, use_cubin: bool) -> Result<sys::CUmodule> {
    if use_cubin {
        // SAFETY: the cubin is a complete ELF image embedded in the binary ('static).
        unsafe { result::module::load_data(m.cubin_sm90a.as_ptr() as *const c_void) }
            .ctx(&format!("loading {}.cubin", m.name))
    } else {
        // The driver JIT-compiles PTX; it needs a NUL-terminated image.
        let mut ptx = m.ptx.to_vec();
        ptx.push(0);
        // SAFETY: `ptx` is NUL-terminated and outlives the call, which copies the image.
        unsafe { result::module::load_data(ptx.as_ptr() as *const c_void) }
            .ctx(&format!("JIT-compiling {}.ptx", m.name))
    }
}

impl Drop for Modules {
    fn drop(&mut self) {
        for (_, m) in self.modules.drain() {
            // SAFETY: each module is unloaded once, here; the kernels of it are not used afterwards (the
            // Device drops its Kernels before its Modules).
            unsafe {
                let _ = result::module::unload(m);
            }
        }
    }
}
