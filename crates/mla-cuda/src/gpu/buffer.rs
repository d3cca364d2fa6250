//! Device and pinned host buffers. Device memory is raw (`CUdeviceptr`) with a typed length so
//! kernel wrappers can check sizes; it is allocated once and reused, never inside a step.

use super::{Check, Result};
use cudarc::driver::{result, sys};
use std::marker::PhantomData;

/// An owned device allocation of `len` elements of `T`.
pub struct DeviceBuffer<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _t: PhantomData<*mut T>,
}

/// A borrowed, typed window into device memory (pointer + length); what kernel wrappers take. The
/// lifetime ties it to the buffer it was taken from, so a slice cannot outlive its memory; like
/// every device handle here it stays on its thread (not `Send`).
pub struct DSlice<'a, T> {
    pub ptr: sys::CUdeviceptr,
    pub len: usize,
    _t: PhantomData<(&'a [T], *const ())>,
}

impl<T> Clone for DSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DSlice<'_, T> {}

impl<'a, T> DSlice<'a, T> {
    /// # Safety
    /// `ptr` must point to `len` valid elements for as long as the slice is used.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> Self {
        DSlice { ptr, len, _t: PhantomData }
    }

    /// Elements `start .. start + len`; panics when out of range (a programming error).
    pub fn sub(&self, start: usize, len: usize) -> DSlice<'a, T> {
        assert!(start + len <= self.len, "device slice {start}..{} out of 0..{}", start + len, self.len);
        DSlice { ptr: self.ptr + (start * std::mem::size_of::<T>()) as u64, len, _t: PhantomData }
    }

    /// Elements from `start` to the end.
    pub fn tail(&self, start: usize) -> DSlice<'a, T> {
        self.sub(start, self.len - start)
    }

    /// Queues a copy of this slice into `dst` (of the same length) on `stream`, in stream order
    /// with the kernels around it.
    pub fn copy_to(&self, dst: DSlice<T>, stream: sys::CUstream) -> Result<()> {
        assert_eq!(self.len, dst.len, "device copy between slices of different lengths");
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: both slices point to `len` valid elements (their constructors' contract).
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr, self.ptr, self.len * std::mem::size_of::<T>(), stream).result() }
            .ctx("queueing a device-to-device copy")
    }

    /// Same memory seen as another element type of the same size (bf16 <-> u16).
    pub fn cast<U>(&self) -> DSlice<'a, U> {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<U>());
        DSlice { ptr: self.ptr, len: self.len, _t: PhantomData }
    }

    /// The same memory as `len` values of another type.
    ///
    /// # Safety
    /// The bytes must hold `len` valid, suitably aligned values of `U` (at most `self`'s bytes).
    pub unsafe fn reinterpret<U>(&self, len: usize) -> DSlice<'a, U> {
        debug_assert!(len * std::mem::size_of::<U>() <= self.len * std::mem::size_of::<T>());
        DSlice { ptr: self.ptr, len, _t: PhantomData }
    }
}

impl<T> DeviceBuffer<T> {
    pub fn alloc(len: usize) -> Result<Self> {
        let bytes = (len.max(1)) * std::mem::size_of::<T>();
        // SAFETY: a plain allocation; contents are uninitialised until written.
        let ptr = unsafe { result::malloc_sync(bytes) }.ctx(&format!("allocating {bytes} bytes"))?;
        Ok(DeviceBuffer { ptr, len, _t: PhantomData })
    }

    pub fn alloc_zeroed(len: usize) -> Result<Self> {
        let b = Self::alloc(len)?;
        // SAFETY: `b` was just allocated with room for `len.max(1)` elements.
        unsafe { result::memset_d8_sync(b.ptr, 0, len.max(1) * std::mem::size_of::<T>()) }.ctx("zeroing a buffer")?;
        Ok(b)
    }

    pub fn from_host(data: &[T]) -> Result<Self> {
        let b = Self::alloc(data.len())?;
        b.upload(data)?;
        Ok(b)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub fn slice(&self) -> DSlice<'_, T> {
        DSlice { ptr: self.ptr, len: self.len, _t: PhantomData }
    }

    pub fn sub(&self, start: usize, len: usize) -> DSlice<'_, T> {
        self.slice().sub(start, len)
    }

    /// Elements from `start` to the end.
    pub fn tail(&self, start: usize) -> DSlice<'_, T> {
        self.slice().tail(start)
    }

    /// Host -> device copy into the start of the buffer, complete when this returns.
    pub fn upload(&self, data: &[T]) -> Result<()> {
        self.upload_at(0, data)
    }

    pub fn upload_at(&self, start: usize, data: &[T]) -> Result<()> {
        assert!(start + data.len() <= self.len, "upload of {} at {start} into {}", data.len(), self.len);
        if data.is_empty() {
            return Ok(());
        }
        let dst = self.ptr + (start * std::mem::size_of::<T>()) as u64;
        // SAFETY: the assertion above keeps the copy inside the allocation.
        unsafe { result::memcpy_htod_sync(dst, data) }.ctx("copying host to device")?;
        wait_for_legacy_copies()
    }

    /// Synchronous device -> host copy of the whole buffer (tests and loading only).
    pub fn download(&self) -> Result<Vec<T>>
    where
        T: Copy + Default,
    {
        download(self.slice())
    }
}

/// Synchronous device -> host copy of a slice (after a stream sync; tests and loading only).
pub fn download<T: Copy + Default>(s: DSlice<T>) -> Result<Vec<T>> {
    let mut out = vec![T::default(); s.len];
    if s.len > 0 {
        // SAFETY: `out` has exactly `s.len` elements, the slice's size.
        unsafe { result::memcpy_dtoh_sync(&mut out, s.ptr) }.ctx("copying device to host")?;
    }
    Ok(out)
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync and freed once; the owning context is still alive
        // because the backend drops its buffers before its Gpu.
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Page-locked host memory: the source and target of asynchronous copies (and of copies inside
/// captured graphs, which read it at replay time).
pub struct PinnedBuffer<T> {
    ptr: *mut T,
    len: usize,
}

impl<T: Copy + Default> PinnedBuffer<T> {
    pub fn alloc(len: usize) -> Result<Self> {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        // SAFETY: a plain pinned allocation of `bytes`, initialised just below and freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.ctx(&format!("allocating {bytes} pinned bytes"))? as *mut T;
        let b = PinnedBuffer { ptr, len };
        for i in 0..len {
            // SAFETY: `i < len` and the allocation holds `len.max(1)` elements of `T`.
            unsafe { ptr.add(i).write(T::default()) };
        }
        Ok(b)
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (see `alloc`) for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as `as_slice`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues a copy of `count` elements from `start` to device memory at `dst` on `stream`.
    pub fn copy_to_device(&self, start: usize, count: usize, dst: DSlice<T>, stream: sys::CUstream) -> Result<()> {
        assert!(start + count <= self.len && count <= dst.len, "pinned copy out of range");
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the assertion keeps both ranges in bounds; the pinned memory stays allocated until
        // the copy has run because every owner synchronises the stream before freeing it.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr,
                self.ptr.add(start) as *const _,
                count * std::mem::size_of::<T>(),
                stream,
            )
            .result()
        }
        .ctx("queueing a host-to-device copy")
    }

    /// Queues a copy of `src` into this buffer at `start` on `stream`.
    pub fn copy_from_device(&mut self, start: usize, src: DSlice<T>, stream: sys::CUstream) -> Result<()> {
        assert!(start + src.len <= self.len, "pinned copy out of range");
        if src.len == 0 {
            return Ok(());
        }
        // SAFETY: as `copy_to_device`: both ranges are checked and the buffer outlives the queued copy.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                self.ptr.add(start) as *mut _,
                src.ptr,
                src.len * std::mem::size_of::<T>(),
                stream,
            )
            .result()
        }
        .ctx("queueing a device-to-host copy")
    }
}

impl<T> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host and freed once, here.
        unsafe {
            let _ = result::free_host(self.ptr as *mut _);
        }
    }
}

/// Waits for the copies queued on the legacy default stream. `cuMemcpyHtoD` from pageable memory
/// returns once the data is staged, possibly before the DMA lands, and `cuMemcpyDtoD` does not
/// wait at all; our kernels run on a non-blocking stream that is not ordered after either, so a
/// kernel reading freshly uploaded data could see the old contents (it did: FP8 weights quantized
/// from a staging buffer were now and then stale, H100, 2026-11-26).
pub fn wait_for_legacy_copies() -> Result<()> {
    // SAFETY: the null stream handle names the legacy default stream of the current context.
    unsafe { result::stream::synchronize(std::ptr::null_mut()) }.ctx("waiting for host-to-device copies")
}
