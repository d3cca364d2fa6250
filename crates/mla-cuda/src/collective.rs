//! The collectives a rank's forward pass issues, as the model sees them: queued on the rank's
//! stream like a kernel (so they can be captured in a decode graph), on device buffers, and
//! issued by every rank in the same order with the same sizes. NCCL is the real one
//! (`NcclConnector`); the model never names it.

use crate::gpu::nccl::{NcclComm, NcclId};
use crate::gpu::DSlice;
use cudarc::driver::sys::CUstream;
use half::bf16;

pub trait DeviceCollective {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// `buf` becomes the element-wise sum of every rank's `buf`.
    fn all_reduce_sum_f32(&self, buf: DSlice<f32>, stream: CUstream) -> anyhow::Result<()>;

    /// `buf` becomes the element-wise minimum of every rank's `buf` (startup agreements).
    fn all_reduce_min_f32(&self, buf: DSlice<f32>, stream: CUstream) -> anyhow::Result<()>;

    /// `out[r * send.len ..][.. send.len]` becomes rank r's `send`; `out.len == world * send.len`.
    fn all_gather_bf16(&self, send: DSlice<bf16>, out: DSlice<bf16>, stream: CUstream) -> anyhow::Result<()>;

    /// `out` becomes the sum over ranks of their `input[rank * out.len ..][.. out.len]`, where
    /// `rank` is this rank; `input.len == world * out.len`.
    fn reduce_scatter_sum_f32(&self, input: DSlice<f32>, out: DSlice<f32>, stream: CUstream) -> anyhow::Result<()>;

    /// `all_gather_bf16` without padding: rank r sends `counts[r]` elements (its `send`), and
    /// `out` gets them packed in rank order.
    fn all_gather_v_bf16(
        &self,
        send: DSlice<bf16>,
        out: DSlice<bf16>,
        counts: &[usize],
        stream: CUstream,
    ) -> anyhow::Result<()>;

    /// `reduce_scatter_sum_f32` without padding: `input` holds `counts[r]` elements for rank r,
    /// packed in rank order; `out` gets the sum over ranks of this rank's part.
    fn reduce_scatter_v_sum_f32(
        &self,
        input: DSlice<f32>,
        out: DSlice<f32>,
        counts: &[usize],
        stream: CUstream,
    ) -> anyhow::Result<()>;

    /// An error the collectives hit asynchronously (a peer died, the network broke), if any.
    fn async_error(&self) -> Option<String>;

    /// Something another thread can call to abort this rank's collectives: a rank blocked in
    /// one (its device waiting for a peer that died) then returns with an error instead of
    /// hanging. After it, the collective is unusable.
    fn aborter(&self) -> Aborter;
}

pub use mla_core::group::Aborter;

/// How the ranks of a group reach each other: creates rank `rank`'s collective on its worker
/// thread, with its device current. Every rank calls it at about the same time; it may block
/// until all have.
pub trait GroupConnector: Send + Sync {
    fn connect(&self, rank: usize, world: usize) -> anyhow::Result<Box<dyn DeviceCollective>>;
}

impl DeviceCollective for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }
    fn world(&self) -> usize {
        NcclComm::world(self)
    }
    fn all_reduce_sum_f32(&self, buf: DSlice<f32>, stream: CUstream) -> anyhow::Result<()> {
        NcclComm::all_reduce_sum_f32(self, buf, stream)
    }
    fn all_reduce_min_f32(&self, buf: DSlice<f32>, stream: CUstream) -> anyhow::Result<()> {
        NcclComm::all_reduce_min_f32(self, buf, stream)
    }
    fn all_gather_bf16(&self, send: DSlice<bf16>, out: DSlice<bf16>, stream: CUstream) -> anyhow::Result<()> {
        NcclComm::all_gather_bf16(self, send, out, stream)
    }
    fn reduce_scatter_sum_f32(&self, input: DSlice<f32>, out: DSlice<f32>, stream: CUstream) -> anyhow::Result<()> {
        NcclComm::reduce_scatter_sum_f32(self, input, out, stream)
    }
    fn all_gather_v_bf16(
        &self,
        send: DSlice<bf16>,
        out: DSlice<bf16>,
        counts: &[usize],
        stream: CUstream,
    ) -> anyhow::Result<()> {
        NcclComm::all_gather_v_bf16(self, send, out, counts, stream)
    }
    fn reduce_scatter_v_sum_f32(
        &self,
        input: DSlice<f32>,
        out: DSlice<f32>,
        counts: &[usize],
        stream: CUstream,
    ) -> anyhow::Result<()> {
        NcclComm::reduce_scatter_v_sum_f32(self, input, out, counts, stream)
    }
    fn async_error(&self) -> Option<String> {
        NcclComm::async_error(self)
    }
    fn aborter(&self) -> Aborter {
        NcclComm::aborter(self)
    }
}

/// The ranks of one communicator, all starting from one NCCL id (made by the process that
/// bootstraps the group, or received from it over the network).
pub struct NcclConnector {
    pub id: NcclId,
}

impl NcclConnector {
    /// A connector for a new communicator whose ranks are all in this process.
    pub fn new() -> anyhow::Result<Self> {
        Ok(NcclConnector { id: NcclId::new()? })
    }
}

impl GroupConnector for NcclConnector {
    fn connect(&self, rank: usize, world: usize) -> anyhow::Result<Box<dyn DeviceCollective>> {
        Ok(Box::new(NcclComm::init_rank(&self.id, rank, world)?))
    }
}
