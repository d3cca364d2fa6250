//! The device side of the step metadata (`meta`): one fixed buffer that every decode step, and so
//! every captured graph, reads; an overflow buffer for the prefill (and mixed) steps over more
//! cached keys than the fixed one holds (they run eagerly, so their words may live anywhere); the
//! penalty and logit-bias entries' own buffers, whose addresses the upload writes into the step's
//! words; and the mask table, sized once for a mask per sequence, which structured-output masks
//! are copied into when the engine has filled them. No captured graph ever holds the address of a
//! buffer that can move, so none is ever captured again.

use super::meta::{MetaLimits, StepMeta};
use super::meta_words::to_words;
use crate::device::Device;
use crate::gpu::{DSlice, DeviceBuffer, PinnedBuffer};
use mla_core::step::token_mask::{mask_words, MASK_WAIT};

/// Entries of a variable count (penalties, logit biases) on the device and the pinned words they
/// are copied from; both grow to the next power of two when a step needs more.
struct EntryBuffer {
    device: DeviceBuffer<i32>,
    staging: PinnedBuffer<i32>,
}

impl EntryBuffer {
    fn new(words: usize) -> anyhow::Result<Self> {
        Ok(EntryBuffer { device: DeviceBuffer::alloc(words)?, staging: PinnedBuffer::alloc(words)? })
    }

    /// Makes room for `n` words (outside any capture: see `MetaBuffers::upload`).
    fn reserve(&mut self, dev: &Device, n: usize) -> anyhow::Result<()> {
        if n > self.device.len() {
            dev.gpu.sync()?;
            let n = n.next_power_of_two();
            self.device = DeviceBuffer::alloc(n)?;
            self.staging = PinnedBuffer::alloc(n)?;
        }
        Ok(())
    }

    /// Queues the copy of `words` (already reserved) to the start of the device buffer.
    fn queue(&mut self, dev: &Device, words: &[i32]) -> anyhow::Result<()> {
        let n = words.len();
        if n > 0 {
            self.staging.as_mut_slice()[..n].copy_from_slice(words);
            self.staging.copy_to_device(0, n, self.device.sub(0, n), dev.stream())?;
        }
        Ok(())
    }
}

pub struct MetaBuffers {
    fixed: DeviceBuffer<i32>,
    overflow: Option<DeviceBuffer<i32>>,
    staging: PinnedBuffer<i32>,
    penalties: EntryBuffer,
    biases: EntryBuffer,
    /// [max_seqs, mask_words(vocab)]: row `mask_row` of a step is its `mask_row`-th masked row.
    masks: DeviceBuffer<u32>,
    mask_staging: PinnedBuffer<u32>,
    vocab: usize,
}

/// Penalty words the buffer starts with (three per distinct token of a penalised history); it
/// grows to the next power of two when a step needs more.
const INITIAL_PENALTY_WORDS: usize = 3 << 16;
/// Logit-bias words the buffer starts with (two per entry); grows likewise.
const INITIAL_BIAS_WORDS: usize = 2 << 12;

impl MetaBuffers {
    pub fn new(lim: &MetaLimits) -> anyhow::Result<Self> {
        let words = lim.words();
        let mask_table = lim.max_seqs * mask_words(lim.vocab);
        Ok(MetaBuffers {
            fixed: DeviceBuffer::alloc(words)?,
            overflow: None,
            staging: PinnedBuffer::alloc(words)?,
            penalties: EntryBuffer::new(INITIAL_PENALTY_WORDS)?,
            biases: EntryBuffer::new(INITIAL_BIAS_WORDS)?,
            masks: DeviceBuffer::alloc(mask_table)?,
            mask_staging: PinnedBuffer::alloc(mask_table)?,
            vocab: lim.vocab,
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

    /// The mask table the sampler reads (it never moves, so a captured sampler may hold it).
    pub fn mask_table(&self) -> DSlice<'_, u32> {
        self.masks.slice()
    }

    /// Writes the penalty and bias buffers' addresses into `meta`, then queues the copies of its
    /// words, penalty and bias entries on the stream. Buffers that must grow (the entries, a
    /// prefill step's words beyond the fixed buffer) are reallocated first, outside any capture:
    /// the previous step ended with a synchronisation, so nothing reads them now. Masks are not
    /// part of this: `upload_masks` copies them once the engine has filled them.
    pub fn upload(&mut self, dev: &Device, meta: &mut StepMeta) -> anyhow::Result<()> {
        self.penalties.reserve(dev, meta.penalties.len())?;
        self.biases.reserve(dev, meta.biases.len())?;
        let addr = self.penalties.device.ptr();
        meta.words[meta.penalty_table.words()].copy_from_slice(to_words(&addr));
        let addr = self.biases.device.ptr();
        meta.words[meta.bias_table.words()].copy_from_slice(to_words(&addr));
        let n = meta.words.len();
        if n > self.fixed.len() {
            // Only prompt chunks' key windows are unbounded; a mixed step runs eagerly too.
            anyhow::ensure!(
                meta.kind().has_prefill(),
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
        self.penalties.queue(dev, &meta.penalties)?;
        self.biases.queue(dev, &meta.biases)?;
        Ok(())
    }

    /// Waits for the structured-output masks of `meta`'s rows (the engine fills them while the
    /// forward pass runs), then queues their copy into the mask table. A mask that never comes
    /// or does not fit the vocabulary fails the step, naming the sequence. Call it after the
    /// forward pass is queued and before the sampler: the wait then overlaps the device's work.
    /// The staging buffer is free to overwrite: the previous step ended with a synchronisation.
    pub fn upload_masks(&mut self, dev: &Device, meta: &StepMeta) -> anyhow::Result<()> {
        if meta.masks.is_empty() {
            return Ok(());
        }
        let nw = mask_words(self.vocab);
        let n = meta.masks.len() * nw;
        anyhow::ensure!(
            n <= self.masks.len(),
            "{} masked rows exceed the mask table's {}",
            meta.masks.len(),
            self.masks.len() / nw.max(1)
        );
        let staging = self.mask_staging.as_mut_slice();
        for (k, row) in meta.masks.iter().enumerate() {
            let words = row
                .mask
                .wait(self.vocab, MASK_WAIT)
                .map_err(|e| anyhow::anyhow!("sequence {}: structured output: {e}", row.seq_id))?;
            staging[k * nw..(k + 1) * nw].copy_from_slice(&words);
        }
        self.mask_staging.copy_to_device(0, n, self.masks.sub(0, n), dev.stream())?;
        Ok(())
    }
}
