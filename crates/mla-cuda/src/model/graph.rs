//! Decode steps replayed from a CUDA graph: capture once per batch size, then each step only
//! uploads its metadata, launches the graph and reads the sampled tokens.

use super::forward::CudaModel;
use super::meta::StepMeta;
use crate::device::Device;
use crate::gpu::Graph;
use crate::ops::PAGE_SIZE;
use mla_core::plan::{StepKind, StepOutput, StepPlan};

pub struct DecodeGraph {
    graph: Graph,
    pub batch: usize,
    pub splits: usize,
    sample_rows: usize,
    logit_rows: usize,
    generation: u64,
}

impl CudaModel {
    fn decode_meta(&self, plan: &StepPlan) -> anyhow::Result<StepMeta> {
        anyhow::ensure!(plan.kind == StepKind::Decode, "only decode steps are captured as graphs");
        plan.validate(PAGE_SIZE, self.num_blocks, self.cfg.vocab_size, self.max_model_len)?;
        anyhow::ensure!(!plan.seqs.is_empty(), "an empty step has nothing to capture");
        StepMeta::build(plan, &self.lim)
    }

    /// Captures the decode step of `plan` (any plan of the same batch size and output shape
    /// replays it), runs it once and returns its output.
    pub fn capture_decode(&mut self, dev: &Device, plan: &StepPlan) -> anyhow::Result<(DecodeGraph, StepOutput)> {
        let meta = self.decode_meta(plan)?;
        self.upload_meta(dev, &meta)?;
        // Splits sized for the longest context the model accepts; shorter ones leave splits empty.
        let splits = self.graph_decode_splits(dev, meta.seqs);
        let graph = Graph::capture(dev.stream(), || self.queue_forward(dev, &meta, splits))?;
        let g = DecodeGraph {
            graph,
            batch: meta.seqs,
            splits,
            sample_rows: meta.sample_rows,
            logit_rows: meta.logit_rows,
            generation: self.meta_generation,
        };
        g.graph.launch(dev.stream())?;
        let out = self.read_outputs(dev, &meta)?;
        Ok((g, out))
    }

    pub fn replay_decode(&mut self, dev: &Device, g: &DecodeGraph, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        let meta = self.decode_meta(plan)?;
        anyhow::ensure!(
            meta.seqs == g.batch && meta.sample_rows == g.sample_rows && meta.logit_rows == g.logit_rows,
            "graph captured for {} sequences ({} sampled, {} logit rows); step has {} ({}, {})",
            g.batch,
            g.sample_rows,
            g.logit_rows,
            meta.seqs,
            meta.sample_rows,
            meta.logit_rows
        );
        self.upload_meta(dev, &meta)?;
        anyhow::ensure!(self.meta_generation == g.generation, "the metadata buffer moved since capture; capture again");
        g.graph.launch(dev.stream())?;
        self.read_outputs(dev, &meta)
    }
}
