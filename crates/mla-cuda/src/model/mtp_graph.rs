//! The MTP passes of speculative decode steps replayed from CUDA graphs (issue 31 asks for graphs
//! of draft steps as of verify steps). What they buy is small: on a TP-8 rank's shapes a batch-1
//! pass takes 0.460 ms from its graph against 0.511 eagerly (run S30), since a pass is bound by
//! its kernels, not by launching them.
//!
//! A graph fixes its shape: token rows, sampling rows, attention splits. The passes' shapes follow
//! from the plan (`model::speculative`), so each is captured per batch bucket of `slots`
//! sequences:
//! - the first pass after a decode-only verify step: `slots * (1 + drafts)` token rows (a sequence's
//!   `1 + drafts` verify rows, each one decode row of the MTP layer) and `slots` sampling rows.
//!   A replay samples every sequence's last emitted row, greedily where the sequence does not
//!   draft (its token is dropped), so that the head always reads one row per sequence;
//! - a chained pass: `slots` rows, each sampling (every row of a chained pass drafts).
//!
//! Padding fills both counts: rows of the model's padding block, the first ones sampling until
//! the graph's sampling rows are full; their outputs are dropped, their `src` is row 0. A plan
//! with prompt chunks, a DP-attention rank (whose passes are sized by every rank's rows), or a
//! pass beyond the largest bucket runs eagerly.

use super::forward::CudaModel;
use super::meta::StepMeta;
use super::padding::pad_row;
use super::parallel::{FfnRows, RankMode};
use crate::device::Device;
use crate::gpu::Graph;
use mla_core::step::plan::{SeqStep, StepKind, StepPlan};

/// Where an MTP pass takes its `prev` rows from.
#[derive(Clone, Copy)]
pub(super) enum PrevRows {
    /// The target's last hidden states (`ws.h` after the verify step's final norm).
    Target,
    /// The previous MTP pass's output before `shared_head.norm` (`ws.residual`).
    Mtp,
}

/// One captured MTP pass.
pub struct MtpGraph {
    graph: Graph,
    /// Sampling rows (sequences).
    pub slots: usize,
    /// Token rows.
    pub rows: usize,
}

/// The MTP pass graphs of a model with speculative decoding (empty without, on a DP-attention
/// rank, or when no decode graphs are captured).
#[derive(Default)]
pub struct MtpGraphs {
    /// First passes (`PrevRows::Target`), ascending.
    first: Vec<MtpGraph>,
    /// Chained passes (`PrevRows::Mtp`), ascending.
    chain: Vec<MtpGraph>,
    /// Device memory the captures took.
    pub bytes: usize,
    /// Passes replayed so far (benchmarks report it: a graph that never fits costs memory alone).
    replays: std::sync::atomic::AtomicU64,
}

impl MtpGraphs {
    /// Passes replayed from these graphs so far.
    pub fn replays(&self) -> u64 {
        self.replays.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// (slots, rows) of the captured first passes, then the slots of the chained ones.
    pub fn shapes(&self) -> (Vec<(usize, usize)>, Vec<usize>) {
        (self.first.iter().map(|g| (g.slots, g.rows)).collect(), self.chain.iter().map(|g| g.slots).collect())
    }

    /// The smallest graph of `prev`'s kind for a pass of `samplers` sampling rows among `rows`
    /// (counted as a replay: the caller replays what it picks).
    pub(super) fn pick(&self, prev: PrevRows, samplers: usize, rows: usize) -> Option<&MtpGraph> {
        let set = match prev {
            PrevRows::Target => &self.first,
            PrevRows::Mtp => &self.chain,
        };
        let g = set.iter().find(|g| g.slots >= samplers && g.rows >= rows);
        if g.is_some() {
            self.replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        g
    }
}

/// The padding that makes a pass of `rows` rows, `samplers` of them sampling, `slots` sampling
/// rows among `total`: rows of the padding block, the sampling ones first.
fn pass_pads(slots: usize, total: usize, rows: usize, samplers: usize, pad_block: usize) -> Vec<SeqStep> {
    (rows..total)
        .enumerate()
        .map(|(i, r)| {
            let mut p = pad_row(r, pad_block);
            if i >= slots - samplers {
                p.sample = None;
            }
            p
        })
        .collect()
}

impl CudaModel {
    /// Captures the MTP passes for decode batches of `slots` sequences (ascending, each within
    /// `max_num_seqs`) with `drafts` drafts per step (each a captured size), while the captures
    /// stay within `budget` bytes (a tensor-parallel rank captures every size: the ranks of a
    /// step must replay alike). None on a DP-attention rank, whose speculative steps run eagerly.
    pub fn capture_mtp_passes(
        &mut self,
        dev: &Device,
        slots: &[usize],
        drafts: &[usize],
        budget: usize,
    ) -> anyhow::Result<MtpGraphs> {
        let mut set = MtpGraphs::default();
        if self.weights.mtp.is_none() || matches!(self.mode, RankMode::DpAttention(_)) {
            return Ok(set);
        }
        let chained = drafts.iter().any(|&k| k > 1);
        let mut shapes: Vec<(PrevRows, usize, usize)> = vec![];
        for &b in slots {
            let mut rows: Vec<usize> = drafts.iter().map(|&k| b * (1 + k)).collect();
            rows.sort_unstable();
            rows.dedup();
            shapes.extend(rows.into_iter().map(|r| (PrevRows::Target, b, r)));
            if chained {
                shapes.push((PrevRows::Mtp, b, b));
            }
        }
        for (prev, b, rows) in shapes {
            if rows > self.lim.max_seqs || rows > self.lim.max_tokens {
                continue;
            }
            dev.gpu.sync()?;
            let (free0, _) = dev.gpu.mem_info()?;
            let graph = self.capture_mtp_pass(dev, prev, b, rows)?;
            let (free1, _) = dev.gpu.mem_info()?;
            let took = free0.saturating_sub(free1);
            if set.bytes + took > budget && matches!(self.mode, RankMode::Single) {
                tracing::warn!(
                    "the MTP pass graph of {rows} rows would exceed the graph memory budget ({} MiB); larger passes run eagerly",
                    budget >> 20
                );
                break;
            }
            set.bytes += took;
            let g = MtpGraph { graph, slots: b, rows };
            match prev {
                PrevRows::Target => set.first.push(g),
                PrevRows::Mtp => set.chain.push(g),
            }
        }
        Ok(set)
    }

    /// One MTP pass of `rows` token rows and `slots` sampling rows, captured and run once on
    /// padding rows (so a broken capture fails at startup).
    fn capture_mtp_pass(&mut self, dev: &Device, prev: PrevRows, slots: usize, rows: usize) -> anyhow::Result<Graph> {
        let pads = pass_pads(slots, rows, 0, 0, self.pad_block());
        let mut meta = StepMeta::build_rows(StepKind::Decode, &[], &pads, &self.lim, vec![])?;
        self.upload_meta(dev, &mut meta)?;
        let bufs = self.ws.mtp.as_ref().expect("the MTP buffers exist when the module is loaded");
        bufs.src.upload_at(0, &vec![0i32; rows])?;
        let splits = self.graph_decode_splits(dev, rows);
        let graph = Graph::capture(dev.stream(), || {
            self.queue_mtp(dev, &meta, splits, prev, FfnRows::Padded(rows))?;
            self.queue_sampler(dev, &meta)
        })?;
        graph.launch(dev.stream())?;
        self.read_outputs(dev, &meta)?;
        Ok(graph)
    }

    /// The metadata of an MTP pass over `plan`'s rows, `samplers` of them sampling, padded to
    /// the shape of `g`; its outputs are `plan`'s rows'.
    pub(super) fn mtp_graph_meta(&self, g: &MtpGraph, plan: &StepPlan, samplers: usize) -> anyhow::Result<StepMeta> {
        let n = plan.seqs.len();
        anyhow::ensure!(
            plan.kind == StepKind::Decode && n <= g.rows && samplers <= g.slots,
            "an MTP pass of {n} rows ({samplers} sampling) does not fit the graph of {} ({})",
            g.rows,
            g.slots
        );
        let pads = pass_pads(g.slots, g.rows, n, samplers, self.pad_block());
        let mut meta = StepMeta::build_rows(StepKind::Decode, &plan.seqs, &pads, &self.lim, vec![])?;
        meta.outputs.truncate(n);
        Ok(meta)
    }
}

impl MtpGraph {
    pub(super) fn launch(&self, dev: &Device) -> anyhow::Result<()> {
        Ok(self.graph.launch(dev.stream())?)
    }
}

#[cfg(test)]
mod tests {
    use super::pass_pads;

    #[test]
    fn pads_fill_the_sampling_rows_first_then_the_token_rows() {
        // A graph of 4 sequences x 3 rows; 2 sequences fed 2 and 1 drafts: 5 rows, 2 sampling.
        let pads = pass_pads(4, 12, 5, 2, 9);
        assert_eq!(pads.len(), 7);
        let sampling: Vec<bool> = pads.iter().map(|p| p.sample.is_some()).collect();
        assert_eq!(sampling, [true, true, false, false, false, false, false]);
        assert!(pads.iter().all(|p| p.block_table == [9] && p.tokens == [0] && p.context_len == 0));
        let ids: std::collections::HashSet<u64> = pads.iter().map(|p| p.seq_id).collect();
        assert_eq!(ids.len(), 7, "padding rows are sequences of their own");
        // Full: nothing to pad. Capture: padding only.
        assert!(pass_pads(4, 12, 12, 4, 9).is_empty());
        assert_eq!(pass_pads(2, 6, 0, 0, 9).iter().filter(|p| p.sample.is_some()).count(), 2);
    }
}
