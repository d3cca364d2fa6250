//! Block forks on the device (`SeqStep::fork`): before a step writes, a sequence that forks
//! gets a copy of the block its shared prompt ends in, every cache layer (the MTP module's too),
//! so the `n` completions of one request compute the prompt's last token once each instead of
//! the whole partial block each.

use super::forward::CudaModel;
use crate::device::Device;
use crate::ops::{cache_row_bytes, PAGE_SIZE};
use mla_core::step::plan::StepPlan;

impl CudaModel {
    /// Queues the copies of `plan`'s forks on the step's stream, ahead of its kernels. One copy
    /// per fork and layer: forks come once per completion of an `n`-way request, so a few
    /// thousand queued copies at most (64 completions of a 62-layer model), against recomputing
    /// up to 63 tokens for each. A plan's rows may repeat a sequence (a verify step's draft
    /// rows); each target block is copied once.
    pub(super) fn queue_forks(&self, dev: &Device, plan: &StepPlan) -> anyhow::Result<()> {
        let block = PAGE_SIZE * cache_row_bytes(self.cache_dtype);
        let mut done = Vec::new();
        for f in plan.seqs.iter().filter_map(|s| s.fork) {
            if done.contains(&f.to) {
                continue;
            }
            done.push(f.to);
            let (from, to) = (f.from as usize * block, f.to as usize * block);
            for layer in 0..self.cache_layers() {
                let cache = self.layer_cache(layer).bytes;
                cache.sub(from, block).copy_to(cache.sub(to, block), dev.stream())?;
            }
        }
        Ok(())
    }
}
