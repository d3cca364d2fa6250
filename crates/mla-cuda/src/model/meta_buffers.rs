//! The device side of the step metadata (`meta`): one fixed buffer that every decode step, and so
//! every captured graph, reads; an overflow buffer for the prefill steps over more cached keys than
//! the fixed one holds (prefill runs eagerly, so its words may live anywhere); and the penalty
//! entries' own buffer, whose address the upload writes into the step's words. No captured graph
//! ever holds the address of a buffer that can move, so none is ever captured again.

use super::meta::{MetaLimits, StepMeta};
use super::meta_words::to_words;
use crate::device::Device;
use crate::gpu::{DSlice, DeviceBuffer, PinnedBuffer};
use mla_core::StepKind;

pub struct MetaBuffers {
    fixed: DeviceBuffer<i32>,
    overflow: Option<DeviceBuffer<i32>>,
    staging: PinnedBuffer<i32>,
    penalties: DeviceBuffer<i32>,
    penalty_staging: PinnedBuffer<i32>,
}

/// Penalty words the buffer starts with (three per distinct token of a penalised history); it
/// grows to the next power of two when a step needs more.
const INITIAL_PENALTY_WORDS: usize = 3 << 16;

impl MetaBuffers {
    pub fn new(lim: &MetaLimits) -> anyhow::Result<Self> {
        let words = lim.words();
        Ok(MetaBuffers {
            fixed: DeviceBuffer::alloc(words)?,
            overflow: None,
            staging: PinnedBuffer::alloc(words)?,
            penalties: DeviceBuffer::alloc(INITIAL_PENALTY_WORDS)?,
            penalty_staging: PinnedBuffer::alloc(INITIAL_PENALTY_WORDS)?,
        })
    }

    /// The device words a step of `n` words reads: the fixed buffer when it fits (always for
    /// decode steps), else the overflow buffer `upload` sized for it.
    pub fn words_for(&self, n: usize) -> DSlice<'_, i32> {
        if n <= self.fixed.len() {
            return self.fixed.slice();
        }
        self.overflow.as_ref().expect("a step larger than the fixed buffer was uploaded to the overflow buffer").slice()
    }

    /// Words of the fixed buffer.
    pub fn fixed_words(&self) -> usize {
        self.fixed.len()
    }

    /// Writes the penalty buffer's address into `meta`, then queues the copies of its words and
    /// penalty entries on the stream. Buffers that must grow (the penalty entries, a prefill
    /// step's words beyond the fixed buffer) are reallocated first, outside any capture: the
    /// previous step ended with a synchronisation, so nothing reads them now.
    pub fn upload(&mut self, dev: &Device, meta: &mut StepMeta) -> anyhow::Result<()> {
        let n_pen = meta.penalties.len();
        if n_pen > self.penalties.len() {
            dev.gpu.sync()?;
            let n = n_pen.next_power_of_two();
            self.penalties = DeviceBuffer::alloc(n)?;
            self.penalty_staging = PinnedBuffer::alloc(n)?;
        }
        let addr = self.penalties.ptr();
        meta.words[meta.penalty_table.words()].copy_from_slice(to_words(&addr));
        let n = meta.words.len();
        if n > self.fixed.len() {
            anyhow::ensure!(
                meta.kind() == StepKind::Prefill,
                "decode step metadata of {n} words exceeds the {} the limits promise",
                self.fixed.len()
            );
            if self.overflow.as_ref().is_none_or(|o| o.len() < n) {
                dev.gpu.sync()?;
                self.overflow = Some(DeviceBuffer::alloc(n.next_power_of_two())?);
            }
        }
        if n > self.staging.len() {
            dev.gpu.sync()?;
            self.staging = PinnedBuffer::alloc(n.next_power_of_two())?;
        }
        self.staging.as_mut_slice()[..n].copy_from_slice(&meta.words);
        let target = self.words_for(n);
        self.staging.copy_to_device(0, n, target.sub(0, n), dev.stream())?;
        if n_pen > 0 {
            self.penalty_staging.as_mut_slice()[..n_pen].copy_from_slice(&meta.penalties);
            self.penalty_staging.copy_to_device(0, n_pen, self.penalties.sub(0, n_pen), dev.stream())?;
        }
        Ok(())
    }
}
