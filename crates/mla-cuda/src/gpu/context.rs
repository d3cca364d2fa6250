//! The device context and the stream every kernel of this backend runs on.

use super::{Check, CudaError, Result};
use cudarc::driver::{result, sys};

#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: usize,
    pub total_memory: usize,
    pub max_smem_per_block_optin: usize,
}

/// The primary context of one device, made current on the creating thread, and a non-blocking
/// stream: CUDA graphs cannot be captured on the legacy default stream.
pub struct Gpu {
    pub info: GpuInfo,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: probing for libcuda only opens the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError {
                what: "loading the driver".into(),
                detail: "libcuda.so was not found (no NVIDIA driver on this machine, or LD_LIBRARY_PATH lacks it)"
                    .into(),
            });
        }
        result::init().ctx("cuInit")?;
        let count = result::device::get_count().ctx("counting devices")?;
        if ordinal as i32 >= count {
            return Err(CudaError {
                what: "selecting a device".into(),
                detail: format!("device {ordinal} requested, {count} present"),
            });
        }
        let device = result::device::get(ordinal as i32).ctx("cuDeviceGet")?;
        // SAFETY: `device` came from cuDeviceGet; the context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }.ctx("retaining the primary context")?;
        // SAFETY: `ctx` was just retained and stays alive until Drop releases it.
        unsafe { result::ctx::set_current(ctx) }.ctx("making the context current")?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).ctx("creating the stream")?;
        // SAFETY: `device` came from cuDeviceGet; reading an attribute has no other precondition.
        let attr = |a| unsafe { result::device::get_attribute(device, a) }.ctx("reading a device attribute");
        use sys::CUdevice_attribute::*;
        let info = GpuInfo {
            ordinal,
            name: result::device::get_name(device).ctx("reading the device name")?,
            compute_capability: (
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            // SAFETY: as for the attributes: a valid device handle.
            total_memory: unsafe { result::device::total_mem(device) }.ctx("reading the memory size")?,
            max_smem_per_block_optin: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
        };
        Ok(Gpu { info, device, ctx, stream })
    }

    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Waits for everything queued on the stream; surfaces asynchronous kernel faults.
    pub fn sync(&self) -> Result<()> {
        // SAFETY: the stream lives until Drop.
        unsafe { result::stream::synchronize(self.stream) }.ctx("synchronizing the stream")
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        result::mem_get_info().ctx("cuMemGetInfo")
    }

    /// Makes this context current on the calling thread (tests that move a Gpu between threads).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained until Drop.
        unsafe { result::ctx::set_current(self.ctx) }.ctx("making the context current")
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: all buffers owned by the backend are dropped before the Gpu (field order).
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.stream);
            let _ = result::primary_ctx::release(self.device);
        }
    }
}
