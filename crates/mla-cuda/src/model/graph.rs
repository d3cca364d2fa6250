//! Decode steps replayed from a CUDA graph: capture once per batch size, then each step only
//! uploads its metadata, launches the graph and reads the sampled tokens.
//!
//! A step with structured-output masks cannot sample inside the graph: its masks are computed by
//! the engine while the forward pass runs. Its replay disables the graph's sampler node, launches
//! the graph, waits for the masks, copies them and launches the sampler on its own, so the mask
//! computation overlaps the forward pass; the next step without masks enables the node again
//! (one cheap host call, only when the state changes), so unmasked steps keep their single launch.

use super::forward::CudaModel;
use super::meta::{MetaLimits, StepMeta};
use super::mtp_graph::MtpGraphs;
use super::padding::pad_row;
pub use super::padding::pad_rows;
use super::parallel::{FfnRows, RankMode};
use crate::device::Device;
use crate::gpu::{Graph, GraphNode};
use mla_core::step::plan::{LogitsRequest, SeqStep, StepKind, StepOutput, StepPlan};

pub struct DecodeGraph {
    graph: Graph,
    pub batch: usize,
    pub splits: usize,
    /// The sampler's node, when it was found in the capture (else a masked step lets the graph
    /// sample and samples again once the masks are in, which overwrites every output).
    sampler: Option<GraphNode>,
    /// Whether the sampler node runs at the next launch.
    sampler_on: bool,
}

impl DecodeGraph {
    /// Whether masked steps replaying this graph skip its sampler (tests).
    pub fn splits_sampler(&self) -> bool {
        self.sampler.is_some()
    }

    /// Whether the graph's sampler node runs at the next launch (tests: off after a masked
    /// step, on again after an unmasked one).
    pub fn samples_in_graph(&self) -> bool {
        self.sampler_on
    }

    /// Asks for the sampler node to run (`on`) or not at the next launch; returns whether it
    /// will. A failed switch is logged and leaves the node as it was: the caller then samples
    /// eagerly after the graph whenever the node did not, which is correct either way.
    fn switch_sampler(&mut self, on: bool) -> bool {
        if let Some(node) = self.sampler {
            if self.sampler_on != on {
                match self.graph.set_enabled(node, on) {
                    Ok(()) => self.sampler_on = on,
                    Err(e) => tracing::warn!(
                        "could not {} the sampler of the decode graph for batch {}: {e}",
                        if on { "enable" } else { "disable" },
                        self.batch
                    ),
                }
            }
        }
        self.sampler_on
    }
}

/// The sampler's node in a captured decode graph, if exactly one kernel node launches it.
fn find_sampler(dev: &Device, graph: &Graph, batch: usize) -> Option<GraphNode> {
    match graph.kernel_nodes(dev.k.sampling.sample_tokens_func()) {
        Ok(nodes) if nodes.len() == 1 => Some(nodes[0]),
        Ok(nodes) => {
            tracing::warn!("decode graph for batch {batch}: {} sampler nodes found, expected one; steps with structured-output masks sample twice", nodes.len());
            None
        }
        Err(e) => {
            tracing::warn!("decode graph for batch {batch}: looking for the sampler node failed ({e}); steps with structured-output masks sample twice");
            None
        }
    }
}

/// Decode graphs for a set of batch-size buckets, captured once at startup. A decode step of
/// `n` sequences replays the smallest bucket `>= n`, padded with rows that read and write only
/// the model's private padding block and whose samples are dropped; above the largest bucket,
/// or for steps a graph cannot express (rows without a sample, logits asked for), the step runs
/// eagerly.
#[derive(Default)]
pub struct DecodeGraphs {
    /// Ascending batch sizes.
    graphs: Vec<DecodeGraph>,
    /// Device memory the captures took (cuMemGetInfo before/after).
    pub bytes: usize,
    /// Padding rows `0 .. largest batch` (`pad_rows`); a step of `n` borrows `n .. batch`.
    pads: Vec<SeqStep>,
    /// The last replay's metadata words, whose allocation the next replay reuses.
    spare_words: Vec<i32>,
    /// The MTP passes of speculative steps (`model::mtp_graph`), captured separately.
    pub mtp: MtpGraphs,
}

impl DecodeGraphs {
    pub fn batch_sizes(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.batch).collect()
    }

    /// The captured graphs, smallest batch first.
    pub fn graphs(&self) -> &[DecodeGraph] {
        &self.graphs
    }

    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }

    /// The graph a decode step would replay, if any.
    fn pick(&self, plan: &StepPlan) -> Option<usize> {
        if plan.seqs.is_empty() || !graph_expressible(plan) || plan.has_speculative() {
            return None;
        }
        self.graphs.iter().position(|g| g.batch >= plan.seqs.len())
    }
}

/// Whether a graph can run `plan`: a decode step (or an idle rank's empty plan) whose rows all
/// sample and ask for no logits. Never a mixed step: its prompt chunks' sections and launches
/// change with every plan.
pub fn graph_expressible(plan: &StepPlan) -> bool {
    plan.seqs.is_empty()
        || (plan.kind == StepKind::Decode
            && !plan.has_speculative()
            && plan.seqs.iter().all(|s| s.sample.is_some() && s.logits == LogitsRequest::None))
}

/// Host timestamps of the last graph replay (the engine benchmark's gap measurement).
#[derive(Debug, Clone, Copy)]
pub struct ReplayTimes {
    /// When the graph launch was queued (metadata built and its upload queued).
    pub launched: std::time::Instant,
    /// When the sampled tokens were on the host.
    pub done: std::time::Instant,
}

/// The metadata of decode `plan` replayed by the graph of `batch` rows: its rows, then
/// `pads[n..batch]` (see `pad_rows`), whose outputs are dropped; written into `words` (reused).
/// Pure host work, so the host benchmark times exactly this.
pub fn graph_step_meta(
    plan: &StepPlan,
    pads: &[SeqStep],
    batch: usize,
    lim: &MetaLimits,
    words: Vec<i32>,
) -> anyhow::Result<StepMeta> {
    let n = plan.seqs.len();
    anyhow::ensure!(
        (plan.kind == StepKind::Decode || n == 0) && n <= batch && batch <= pads.len(),
        "a graph of {batch} rows ({} padding rows) cannot replay this step of {n}",
        pads.len()
    );
    let mut meta = StepMeta::build_rows(StepKind::Decode, &plan.seqs, &pads[n..batch], lim, words)?;
    meta.outputs.truncate(n);
    Ok(meta)
}

impl CudaModel {
    fn padded_plan(&self, plan: &StepPlan, batch: usize) -> StepPlan {
        let mut seqs = plan.seqs.clone();
        let pad = self.pad_block();
        seqs.extend((plan.seqs.len()..batch).map(|i| pad_row(i, pad)));
        StepPlan { kind: StepKind::Decode, seqs }
    }

    /// Captures one graph per batch size in `sizes` (ascending, each <= max_num_seqs) while the
    /// captures' device memory stays within `budget` bytes; returns what was captured. Each
    /// capture is run once on padding rows, so a broken capture fails here, at startup. A rank
    /// of a group captures every size whatever the budget: the ranks of a step must replay the
    /// same graph, since a graph's collectives are collective across the ranks.
    pub fn capture_decode_buckets(
        &mut self,
        dev: &Device,
        sizes: &[usize],
        budget: usize,
    ) -> anyhow::Result<DecodeGraphs> {
        let mut set = DecodeGraphs {
            pads: pad_rows(sizes.iter().copied().max().unwrap_or(0), self.pad_block()),
            ..Default::default()
        };
        let empty = StepPlan { kind: StepKind::Decode, seqs: vec![] };
        for &b in sizes {
            anyhow::ensure!(b >= 1 && b <= self.lim.max_seqs, "graph batch size {b} outside 1..={}", self.lim.max_seqs);
            dev.gpu.sync()?;
            let (free0, _) = dev.gpu.mem_info()?;
            let plan = self.padded_plan(&empty, b);
            let mut meta = StepMeta::build(&plan, &self.lim)?;
            self.upload_meta(dev, &mut meta)?;
            let splits = self.graph_decode_splits(dev, b);
            let graph = Graph::capture(dev.stream(), || self.queue_forward(dev, &meta, splits, FfnRows::Padded(b)))?;
            graph.launch(dev.stream())?;
            self.read_outputs(dev, &meta)?;
            let (free1, _) = dev.gpu.mem_info()?;
            let took = free0.saturating_sub(free1);
            if set.bytes + took > budget && matches!(self.mode, RankMode::Single) {
                tracing::warn!("CUDA graph for batch {b} would exceed the graph memory budget ({} MiB); larger batches run eagerly", budget >> 20);
                break;
            }
            set.bytes += took;
            let sampler = find_sampler(dev, &graph, b);
            set.graphs.push(DecodeGraph { graph, batch: b, splits, sampler, sampler_on: true });
        }
        Ok(set)
    }

    /// Runs a step from a captured graph when one fits (see `DecodeGraphs`); `None` means the
    /// caller must run it eagerly. The graphs read the metadata from a buffer that never moves
    /// (`MetaBuffers`), so a replay is valid whatever the step's penalty history.
    pub fn step_with_graphs(
        &mut self,
        dev: &Device,
        set: &mut DecodeGraphs,
        plan: &StepPlan,
    ) -> Option<anyhow::Result<(StepOutput, ReplayTimes)>> {
        let i = set.pick(plan)?;
        Some(self.replay(dev, set, plan, i))
    }

    /// Replays the graph of `batch` rows for `plan` (a DP-attention rank: the ranks agreed on
    /// the batch, and an idle rank replays it with padding rows only). Errors if no graph of
    /// that size was captured or the plan does not fit it.
    pub fn replay_batch(
        &mut self,
        dev: &Device,
        set: &mut DecodeGraphs,
        plan: &StepPlan,
        batch: usize,
    ) -> anyhow::Result<(StepOutput, ReplayTimes)> {
        let i = set.graphs.iter().position(|g| g.batch == batch);
        let i = i.ok_or_else(|| anyhow::anyhow!("no decode graph of {batch} rows was captured"))?;
        anyhow::ensure!(graph_expressible(plan), "this step cannot run from a decode graph");
        self.replay(dev, set, plan, i)
    }

    fn replay(
        &mut self,
        dev: &Device,
        set: &mut DecodeGraphs,
        plan: &StepPlan,
        i: usize,
    ) -> anyhow::Result<(StepOutput, ReplayTimes)> {
        self.validate(plan)?;
        anyhow::ensure!(
            !plan.has_speculative(),
            "speculative steps replay their verify rows (CudaModel::step_speculative)"
        );
        super::forward::settled(dev, self.queue_forks(dev, plan))?;
        let words = std::mem::take(&mut set.spare_words);
        let batch = set.graphs[i].batch;
        let mut meta = graph_step_meta(plan, &set.pads, batch, &self.lim, words)?;
        let g = &mut set.graphs[i];
        let mut run = |me: &mut Self, meta: &mut StepMeta| -> anyhow::Result<(StepOutput, ReplayTimes)> {
            me.upload_meta(dev, meta)?;
            // Masks, and a verdict on sampled drafts, come between the logits and the sampler.
            let after = !meta.masks.is_empty() || me.pending_verdict.is_some();
            let sampled_in_graph = g.switch_sampler(!after);
            g.graph.launch(dev.stream())?;
            let launched = std::time::Instant::now();
            if after || !sampled_in_graph {
                // While the device runs the forward pass, the engine computes the masks.
                me.upload_masks(dev, meta)?;
                me.queue_sampler(dev, meta)?;
            }
            let out = me.read_outputs(dev, meta)?;
            Ok((out, ReplayTimes { launched, done: std::time::Instant::now() }))
        };
        let r = super::forward::settled(dev, run(self, &mut meta));
        set.spare_words = meta.words;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_steps_never_replay_a_graph() {
        let pads = pad_rows(4, 9);
        let mut chunk = pad_row(7, 3);
        chunk.tokens = vec![5, 6];
        let decode = StepPlan { kind: StepKind::Decode, seqs: pads[..2].to_vec() };
        let mixed = StepPlan { kind: StepKind::Mixed { prefill: 1 }, seqs: vec![chunk, pads[0].clone()] };
        // Even one whose rows are all one token: its kind names a prompt chunk.
        let single = StepPlan { kind: StepKind::Mixed { prefill: 1 }, seqs: pads[..2].to_vec() };
        assert!(graph_expressible(&decode));
        assert!(!graph_expressible(&mixed) && !graph_expressible(&single));
        let lim = MetaLimits {
            max_tokens: 16,
            max_seqs: 4,
            max_logit_rows: 8,
            max_kv_chunk: 64,
            max_blocks_per_seq: 2,
            vocab: 32,
        };
        assert!(graph_step_meta(&mixed, &pads, 4, &lim, vec![]).is_err());
    }
}
