//! How the GPU ranks of a group reach each other: an NCCL communicator per rank
//! (`gpu::nccl::NcclComm`), whose collectives are queued on the rank's stream like a kernel (so
//! they can be captured in a decode graph) and issued by every rank in the same order with the
//! same sizes. `NcclConnector` carries the id all ranks of one communicator start from.

use crate::gpu::nccl::{NcclComm, NcclId};

pub use mla_core::runtime::group::Aborter;

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

    /// Rank `rank`'s communicator, created on its worker thread with its device current. Every
    /// rank calls it at about the same time; it blocks until all have.
    pub fn connect(&self, rank: usize, world: usize) -> anyhow::Result<NcclComm> {
        NcclComm::init_rank(&self.id, rank, world)
    }
}
