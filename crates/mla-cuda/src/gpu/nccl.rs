//! NCCL, loaded at run time like the other CUDA libraries, so the binary builds and runs without
//! it (a multi-GPU layout then fails at start with a message saying so). Only calls that have
//! existed since NCCL 2.12 are used. The library is `MLA_NCCL_LIBRARY` when set, else
//! `libnccl.so.2` (NCCL's soname, what distributions and PyTorch's wheels ship) or `libnccl.so`.
//! `NCCL_*` environment variables reach NCCL untouched.
//!
//! Written against the C API rather than cudarc's NCCL module: cudarc's loader does not look for
//! `libnccl.so.2`, and its safe layer wants cudarc's own stream type, which this crate does not
//! use.

use super::DSlice;
use cudarc::driver::sys::CUstream;
use half::bf16;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};

pub const LIBRARY_ENV: &str = "MLA_NCCL_LIBRARY";

type NcclResult = c_int;
type RawComm = *mut c_void;
const SUCCESS: NcclResult = 0;
const IN_PROGRESS: NcclResult = 7;
const FLOAT32: c_int = 7;
const BFLOAT16: c_int = 9;
const SUM: c_int = 0;

/// Element types the collectives carry, with NCCL's code for each.
pub trait NcclElement: Copy {
    const NCCL_TYPE: c_int;
}

impl NcclElement for f32 {
    const NCCL_TYPE: c_int = FLOAT32;
}

impl NcclElement for bf16 {
    const NCCL_TYPE: c_int = BFLOAT16;
}
const MIN: c_int = 3;

/// The 128-byte id every rank of a communicator starts from (`ncclUniqueId`). Plain bytes: it
/// travels to the other ranks by any means (a thread, a TCP connection).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId {
    pub bytes: [c_char; 128],
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

struct Api {
    _lib: libloading::Library,
    path: String,
    version: c_int,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_unique_id: unsafe extern "C" fn(*mut NcclId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, NcclId, c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> NcclResult,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, CUstream) -> NcclResult,
    reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> NcclResult,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> NcclResult,
    reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, RawComm, CUstream) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

/// Loads NCCL once per process; the error says where it looked.
fn api() -> anyhow::Result<&'static Api> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|e| anyhow::anyhow!("{e}"))
}

fn load() -> Result<Api, String> {
    let candidates: Vec<String> = match std::env::var(LIBRARY_ENV) {
        Ok(p) => vec![p],
        Err(_) => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    };
    let mut tried = Vec::new();
    for path in &candidates {
        // SAFETY: loading NCCL runs its (trusted) initialisers; nothing else is executed.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => return bind(lib, path.clone()),
            Err(e) => tried.push(format!("{path}: {e}")),
        }
    }
    Err(format!(
        "NCCL is needed for --tp and --enable-dp-attention on GPUs but could not be loaded ({}); install NCCL 2.12 or newer (libnccl2) or set {LIBRARY_ENV} to its path",
        tried.join("; ")
    ))
}

fn bind(lib: libloading::Library, path: String) -> Result<Api, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's C function of that name; its type is the field's,
            // taken from nccl.h (stable since 2.12).
            *unsafe { lib.get($name) }.map_err(|e| format!("{path} has no {}: {e}", String::from_utf8_lossy($name)))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!(b"ncclGetVersion");
    let mut version = 0;
    // SAFETY: writes one int.
    if unsafe { get_version(&mut version) } != SUCCESS {
        return Err(format!("{path}: ncclGetVersion failed"));
    }
    if version < 21200 {
        return Err(format!("{path} is NCCL {version}; 2.12 or newer is needed"));
    }
    Ok(Api {
        get_error_string: sym!(b"ncclGetErrorString"),
        get_unique_id: sym!(b"ncclGetUniqueId"),
        comm_init_rank: sym!(b"ncclCommInitRank"),
        comm_destroy: sym!(b"ncclCommDestroy"),
        comm_abort: sym!(b"ncclCommAbort"),
        comm_get_async_error: sym!(b"ncclCommGetAsyncError"),
        all_reduce: sym!(b"ncclAllReduce"),
        all_gather: sym!(b"ncclAllGather"),
        reduce_scatter: sym!(b"ncclReduceScatter"),
        broadcast: sym!(b"ncclBroadcast"),
        reduce: sym!(b"ncclReduce"),
        group_start: sym!(b"ncclGroupStart"),
        group_end: sym!(b"ncclGroupEnd"),
        _lib: lib,
        path,
        version,
    })
}

impl Api {
    fn check(&self, r: NcclResult, what: &str) -> anyhow::Result<()> {
        if r == SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(r)) }.to_string_lossy();
        anyhow::bail!("NCCL {what}: {text} (code {r}; NCCL_DEBUG=WARN says more)")
    }
}

/// "NCCL 2.28.3 from libnccl.so.2", or why NCCL cannot be used.
pub fn describe() -> anyhow::Result<String> {
    let a = api()?;
    let v = a.version;
    Ok(format!("NCCL {}.{}.{} from {}", v / 10000, (v / 100) % 100, v % 100, a.path))
}

impl NcclId {
    /// The id as bytes, to send to another node.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.bytes.iter().map(|&c| c as u8).collect()
    }

    /// An id received from another node.
    pub fn from_bytes(b: &[u8]) -> anyhow::Result<Self> {
        anyhow::ensure!(b.len() == 128, "an NCCL id has 128 bytes, not {}", b.len());
        let mut id = NcclId { bytes: [0; 128] };
        id.bytes.iter_mut().zip(b).for_each(|(c, &x)| *c = x as c_char);
        Ok(id)
    }

    /// A fresh id (on the rank that bootstraps the communicator).
    pub fn new() -> anyhow::Result<Self> {
        let a = api()?;
        let mut id = NcclId { bytes: [0; 128] };
        // SAFETY: writes the 128-byte id.
        a.check(unsafe { (a.get_unique_id)(&mut id) }, "getting a unique id")?;
        Ok(id)
    }
}

/// The communicator handle, shared with the aborter: whichever of destroy and abort comes first
/// takes it, so it is released exactly once.
struct Handle(AtomicPtr<c_void>);

/// One rank's communicator, used from the thread whose device it was created on.
pub struct NcclComm {
    handle: Arc<Handle>,
    rank: usize,
    world: usize,
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world`, on the device current on this thread.
    /// Returns once every rank has joined.
    pub fn init_rank(id: &NcclId, rank: usize, world: usize) -> anyhow::Result<Self> {
        let a = api()?;
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: writes the new communicator's handle; `id` is passed by value as nccl.h declares.
        let r = unsafe { (a.comm_init_rank)(&mut raw, world as c_int, *id, rank as c_int) };
        a.check(r, &format!("joining the communicator as rank {rank} of {world}"))?;
        Ok(NcclComm { handle: Arc::new(Handle(AtomicPtr::new(raw))), rank, world })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    fn raw(&self) -> anyhow::Result<RawComm> {
        let p = self.handle.0.load(Ordering::Acquire);
        anyhow::ensure!(!p.is_null(), "the NCCL communicator was aborted");
        Ok(p)
    }

    /// In place: `buf` becomes the sum over ranks (queued on `stream`).
    pub fn all_reduce_sum_f32(&self, buf: DSlice<f32>, stream: CUstream) -> anyhow::Result<()> {
        self.all_reduce_f32(buf, SUM, stream)
    }

    /// In place: `buf` becomes the element-wise minimum over ranks (startup agreements).
    pub fn all_reduce_min_f32(&self, buf: DSlice<f32>, stream: CUstream) -> anyhow::Result<()> {
        self.all_reduce_f32(buf, MIN, stream)
    }

    fn all_reduce_f32(&self, buf: DSlice<f32>, op: c_int, stream: CUstream) -> anyhow::Result<()> {
        let a = api()?;
        let p = buf.ptr as *mut c_void;
        // SAFETY: `buf` is a live device buffer of `len` floats on this communicator's device.
        let r = unsafe { (a.all_reduce)(p, p, buf.len, FLOAT32, op, self.raw()?, stream) };
        a.check(r, "all-reduce")
    }

    /// `out` (world × `send.len`) becomes every rank's `send`, in rank order.
    pub fn all_gather_bf16(&self, send: DSlice<bf16>, out: DSlice<bf16>, stream: CUstream) -> anyhow::Result<()> {
        anyhow::ensure!(out.len == self.world * send.len, "all-gather of {} into {}", send.len, out.len);
        let a = api()?;
        // SAFETY: both are live device buffers of the checked lengths on this device.
        let r = unsafe {
            (a.all_gather)(send.ptr as *const c_void, out.ptr as *mut c_void, send.len, BFLOAT16, self.raw()?, stream)
        };
        a.check(r, "all-gather")
    }

    /// `out` becomes the sum over ranks of their `input[rank · out.len ..][.. out.len]`.
    pub fn reduce_scatter_sum_f32(&self, input: DSlice<f32>, out: DSlice<f32>, stream: CUstream) -> anyhow::Result<()> {
        anyhow::ensure!(input.len == self.world * out.len, "reduce-scatter of {} into {}", input.len, out.len);
        let a = api()?;
        // SAFETY: both are live device buffers of the checked lengths on this device.
        let r = unsafe {
            (a.reduce_scatter)(
                input.ptr as *const c_void,
                out.ptr as *mut c_void,
                out.len,
                FLOAT32,
                SUM,
                self.raw()?,
                stream,
            )
        };
        a.check(r, "reduce-scatter")
    }

    /// `all_gather_bf16` with `counts[r]` elements from rank r, packed in rank order in `out`
    /// (no padding): one broadcast per rank with data, grouped into one launch.
    pub fn all_gather_v_bf16(
        &self,
        send: DSlice<bf16>,
        out: DSlice<bf16>,
        counts: &[usize],
        stream: CUstream,
    ) -> anyhow::Result<()> {
        self.check_counts(counts, send.len, out.len)?;
        let (a, comm) = (api()?, self.raw()?);
        self.grouped(|| {
            let mut at = 0;
            for (root, &n) in counts.iter().enumerate() {
                if n > 0 {
                    let dst = out.sub(at, n);
                    // SAFETY: `send` (read at the root only) and `dst` are live device buffers of
                    // at least `n` elements on this device (checked above).
                    let r = unsafe {
                        (a.broadcast)(
                            send.ptr as *const c_void,
                            dst.ptr as *mut c_void,
                            n,
                            BFLOAT16,
                            root as c_int,
                            comm,
                            stream,
                        )
                    };
                    a.check(r, "broadcast of an all-gather")?;
                }
                at += n;
            }
            Ok(())
        })
    }

    /// `reduce_scatter_sum_f32` with `counts[r]` elements for rank r, packed in rank order in
    /// `input`: one reduce per rank with data, grouped into one launch. In f32 or bf16 (NCCL then
    /// adds in bf16: one more rounding per peer, half the bytes).
    pub fn reduce_scatter_v_sum<T: NcclElement>(
        &self,
        input: DSlice<T>,
        out: DSlice<T>,
        counts: &[usize],
        stream: CUstream,
    ) -> anyhow::Result<()> {
        self.check_counts(counts, out.len, input.len)?;
        let (a, comm) = (api()?, self.raw()?);
        self.grouped(|| {
            let mut at = 0;
            for (root, &n) in counts.iter().enumerate() {
                if n > 0 {
                    let src = input.sub(at, n);
                    // SAFETY: `src` and `out` (written at the root only) are live device buffers
                    // of at least `n` elements on this device (checked above).
                    let r = unsafe {
                        (a.reduce)(
                            src.ptr as *const c_void,
                            out.ptr as *mut c_void,
                            n,
                            T::NCCL_TYPE,
                            SUM,
                            root as c_int,
                            comm,
                            stream,
                        )
                    };
                    a.check(r, "reduce of a reduce-scatter")?;
                }
                at += n;
            }
            Ok(())
        })
    }

    /// Counts for every rank, this rank's fitting `mine`, all of them fitting `all`.
    fn check_counts(&self, counts: &[usize], mine: usize, all: usize) -> anyhow::Result<()> {
        anyhow::ensure!(counts.len() == self.world, "{} counts for {} ranks", counts.len(), self.world);
        anyhow::ensure!(counts[self.rank] <= mine, "rank {} has {mine} elements for {}", self.rank, counts[self.rank]);
        anyhow::ensure!(counts.iter().sum::<usize>() <= all, "{} elements in all for {counts:?}", all);
        Ok(())
    }

    /// Runs `f`'s NCCL calls as one group (one launch); the group is closed even if `f` fails.
    fn grouped(&self, f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let a = api()?;
        // SAFETY: opens a group; closed below on every path.
        a.check(unsafe { (a.group_start)() }, "group start")?;
        let r = f();
        // SAFETY: closes the group opened above.
        let end = a.check(unsafe { (a.group_end)() }, "group end");
        r.and(end)
    }

    /// An error NCCL hit asynchronously (a peer or the network failed), if any.
    pub fn async_error(&self) -> Option<String> {
        let a = api().ok()?;
        let p = self.handle.0.load(Ordering::Acquire);
        if p.is_null() {
            return Some("the NCCL communicator was aborted".into());
        }
        let mut e = SUCCESS;
        // SAFETY: reads the state of a live communicator into one int.
        let r = unsafe { (a.comm_get_async_error)(p, &mut e) };
        if r != SUCCESS {
            return a.check(r, "reading its asynchronous error").err().map(|e| e.to_string());
        }
        (e != SUCCESS && e != IN_PROGRESS).then(|| a.check(e, "asynchronous error").unwrap_err().to_string())
    }

    /// A function any thread may call to abort this communicator (a rank blocked in a collective then returns with an error).
    pub fn aborter(&self) -> Arc<dyn Fn() + Send + Sync> {
        let handle = self.handle.clone();
        Arc::new(move || handle.abort())
    }
}

impl Handle {
    fn abort(&self) {
        let p = self.0.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if let (false, Ok(a)) = (p.is_null(), api()) {
            // SAFETY: `p` was a live communicator and no one else holds it any more. NCCL allows
            // aborting from another thread while the owner waits on the device.
            let _ = unsafe { (a.comm_abort)(p) };
        }
    }
}

// SAFETY: the handle is an atomic pointer; NCCL communicators may be aborted from any thread.
unsafe impl Send for Handle {}
// SAFETY: as above: the only cross-thread operation is the atomic swap followed by abort.
unsafe impl Sync for Handle {}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let p = self.handle.0.swap(std::ptr::null_mut(), Ordering::AcqRel);
        let (false, Ok(a)) = (p.is_null(), api()) else { return };
        // A rank unwinding from a panic may have operations its peers will never match.
        let r = if std::thread::panicking() {
            // SAFETY: `p` is live and owned by this rank alone now.
            unsafe { (a.comm_abort)(p) }
        } else {
            // SAFETY: as above; every operation of this rank has completed (steps synchronise).
            unsafe { (a.comm_destroy)(p) }
        };
        if r != SUCCESS {
            tracing::warn!("releasing the NCCL communicator of rank {}: code {r}", self.rank);
        }
    }
}
