//! One whole decode step of the V2-Lite shape (dummy weights, context 4096) at batch 1 and 64:
//! run eagerly, and replayed from a CUDA graph through the path the server takes
//! (`capture_decode_buckets` at startup, then `step_with_graphs` per step).

use super::CONTEXT;
use crate::dummy_model;
use mla_core::step::plan::StepPlan;
use mla_core::ModelConfig;
use mla_cuda::model::{CudaModel, DecodeGraphs, ModelOptions};
use mla_cuda::ops::PAGE_SIZE;
use mla_cuda::Device;
use serde_json::{json, Value};
use std::time::Instant;

const BATCHES: [usize; 2] = [1, 64];
const WARMUP_STEPS: usize = 3;
const TIMED_STEPS: usize = 20;
/// The benchmark wants its graph whatever it costs; the server's budget is its own business.
const GRAPH_BUDGET_BYTES: usize = usize::MAX;

pub fn run(dev: &Device, cfg: &ModelConfig) -> anyhow::Result<Value> {
    let max_batch = BATCHES[BATCHES.len() - 1];
    // One block more than the context needs, for the token each step appends.
    let blocks_per_seq = CONTEXT / PAGE_SIZE + 1;
    let t0 = Instant::now();
    let opts = ModelOptions {
        num_blocks: Some(max_batch * blocks_per_seq),
        max_model_len: CONTEXT + 64,
        ..ModelOptions::fixed(256, max_batch, max_batch, 16384)
    };
    let mut model = dummy_model::build(dev, cfg, &opts)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut rows = vec![];
    for batch in BATCHES {
        let plan = |j: usize| dummy_model::decode_plan(batch, CONTEXT - 1, blocks_per_seq, j, cfg.vocab_size);
        for j in 0..WARMUP_STEPS {
            model.step(dev, &plan(j))?;
        }
        let t = Instant::now();
        for j in 0..TIMED_STEPS {
            model.step(dev, &plan(j))?;
        }
        let eager_ms = t.elapsed().as_secs_f64() * 1e3 / TIMED_STEPS as f64;

        let mut graphs = model.capture_decode_buckets(dev, &[batch], GRAPH_BUDGET_BYTES)?;
        anyhow::ensure!(graphs.batch_sizes() == [batch], "no CUDA graph was captured for batch {batch}");
        for j in 0..WARMUP_STEPS {
            replay(&mut model, dev, &mut graphs, &plan(j))?;
        }
        let t = Instant::now();
        for j in 0..TIMED_STEPS {
            replay(&mut model, dev, &mut graphs, &plan(j))?;
        }
        let graph_ms = t.elapsed().as_secs_f64() * 1e3 / TIMED_STEPS as f64;
        let tok_s = batch as f64 / (graph_ms * 1e-3);
        println!(
            "decode step B={batch:<3} ctx {CONTEXT}: eager {eager_ms:.2} ms, graph {graph_ms:.2} ms = {tok_s:.0} tok/s"
        );
        rows.push(json!({
            "batch": batch, "context": CONTEXT, "eager_ms": eager_ms, "graph_ms": graph_ms,
            "graph_splits": model.graph_decode_splits(dev, batch), "tokens_per_s_graph": tok_s,
            "tokens_per_s_eager": batch as f64 / (eager_ms * 1e-3),
        }));
    }
    Ok(json!({
        "model": "deepseek-v2-lite shape, dummy weights drawn on the device",
        "dummy_weights_and_cache_fill_s": load_s,
        "weights_GiB": model.weights.bytes() as f64 / (1u64 << 30) as f64,
        "steps": rows,
    }))
}

/// One step replayed from `graphs`; a step the graphs would hand back to the eager path is an
/// error here, since it would time the wrong thing.
fn replay(model: &mut CudaModel, dev: &Device, graphs: &mut DecodeGraphs, plan: &StepPlan) -> anyhow::Result<()> {
    match model.step_with_graphs(dev, graphs, plan) {
        Some(r) => r.map(drop),
        None => anyhow::bail!("a decode step of {} sequences was not replayed from its graph", plan.seqs.len()),
    }
}
