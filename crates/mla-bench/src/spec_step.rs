//! `mla-bench spec-step`: what speculative decoding with the MTP module costs on the GPU and what
//! it pays (issue 31), on a model of dummy weights with an MTP module. Dummy weights draft nothing
//! a target would accept, so the acceptance is forced (`CudaModel::forced_acceptance`, a
//! benchmark-only switch: each fed draft stands with probability `a` whatever the target chose),
//! which makes every part run with the rows it has at that acceptance: the verify step of
//! `B * (K + 1)` rows (a decode graph replay), the MTP pass over the emitted tokens and the
//! chained passes for the further drafts. Per batch size `B`, the plain decode step (graph) and,
//! per `K` and acceptance, the speculative step: time per step, tokens emitted per second, and
//! the speedup over plain decoding. Every step runs at the same positions (context `ctx`), so
//! the cache never grows and each row reads the same keys. Each step feeds the drafts the one
//! before proposed, so sampled sequences (`--temperature`) verify against the distributions
//! their drafts were drawn from, as in serving: the device verdict's whole cost is in the step.

use crate::dummy_model;
use mla_core::step::plan::{MtpStep, SampleRequest, SeqStep, StepPlan};
use mla_core::{ModelConfig, SamplingParams, SplitMix64};
use mla_cuda::model::{CudaModel, DecodeGraphs, ModelOptions};
use mla_cuda::ops::PAGE_SIZE;
use mla_cuda::Device;
use serde_json::{json, Value};
use std::time::Instant;

const WARMUP_STEPS: usize = 3;
const TIMED_STEPS: usize = 20;

pub struct SpecStepArgs {
    pub cfg: ModelConfig,
    pub batches: Vec<usize>,
    pub drafts: Vec<usize>,
    pub acceptance: Vec<f64>,
    pub context: usize,
    /// Every sequence's sampling parameters (greedy, or sampled with drafts verified on the device).
    pub sampling: SamplingParams,
    /// Runs the MTP passes eagerly instead of from their graphs (A/B runs).
    pub eager_mtp: bool,
}

pub fn run(a: &SpecStepArgs) -> anyhow::Result<Value> {
    let dev = Device::new(0)?;
    let (b_max, k_max) = (a.batches.iter().copied().max().unwrap_or(1), a.drafts.iter().copied().max().unwrap_or(1));
    anyhow::ensure!(k_max >= 1, "--drafts: at least 1");
    anyhow::ensure!(a.cfg.num_nextn_predict_layers > 0, "the config has no MTP layer (num_nextn_predict_layers 0)");
    // Room for the fed drafts and the rows the chained passes write past them.
    let blocks_per_seq = (a.context + 2 * k_max + 1).div_ceil(PAGE_SIZE);
    let opts = ModelOptions {
        num_blocks: Some(b_max * blocks_per_seq),
        max_model_len: blocks_per_seq * PAGE_SIZE,
        mtp_drafts: k_max,
        ..ModelOptions::fixed(b_max * (k_max + 1), b_max, b_max, 16384)
    };
    let t0 = Instant::now();
    let mut model = dummy_model::build(&dev, &a.cfg, &opts)?;
    println!(
        "{} ({} layers + MTP): built in {:.1}s",
        dev.gpu.info.name,
        a.cfg.num_hidden_layers,
        t0.elapsed().as_secs_f64()
    );
    let mut sizes: Vec<usize> =
        a.batches.iter().flat_map(|&b| a.drafts.iter().map(move |&k| b * (k + 1)).chain([b])).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut graphs = model.capture_decode_buckets(&dev, &sizes, usize::MAX)?;
    if !a.eager_mtp {
        graphs.mtp = model.capture_mtp_passes(&dev, &a.batches, &a.drafts, usize::MAX)?;
    }
    let vocab = a.cfg.vocab_size;
    let mut rows = vec![];
    for &b in &a.batches {
        let plain =
            |j: usize| with_sampling(dummy_model::decode_plan(b, a.context, blocks_per_seq, j, vocab), &a.sampling);
        let plain_ms = time_steps(&mut |j| step_graph(&mut model, &dev, &mut graphs, &plain(j)))?;
        let plain_tok_s = b as f64 / (plain_ms * 1e-3);
        println!("B={b:<3} plain decode {plain_ms:.3} ms = {plain_tok_s:.0} tok/s");
        for &k in &a.drafts {
            // The verify step alone: the decode graph of its B * (K + 1) rows.
            let verify = |j: usize| verify_rows(&plain(j), k);
            let verify_ms = time_steps(&mut |j| step_graph(&mut model, &dev, &mut graphs, &verify(j)))?;
            for &acc in &a.acceptance {
                model.forced_acceptance = Some((acc, SplitMix64::new(7)));
                let mut emitted = 0usize;
                let mut proposed: Vec<Vec<u32>> = vec![];
                let spec =
                    |j: usize| with_sampling(speculative_plan(b, k, a.context, blocks_per_seq, j, vocab), &a.sampling);
                let ms = time_steps(&mut |j| {
                    let mut plan = spec(j);
                    for (s, d) in plan.seqs.iter_mut().zip(&proposed).filter(|(_, d)| d.len() == k) {
                        s.tokens.truncate(1);
                        s.tokens.extend(d);
                    }
                    let out = model.step_speculative(&dev, Some(&mut graphs), &plan, None)?;
                    emitted += out.seqs.iter().map(|s| 1 + s.extra_tokens.len()).sum::<usize>();
                    proposed = out.seqs.into_iter().map(|s| s.drafts).collect();
                    Ok(())
                })?;
                model.forced_acceptance = None;
                let per_step = emitted as f64 / (WARMUP_STEPS + TIMED_STEPS) as f64;
                let tok_s = per_step / (ms * 1e-3);
                println!(
                    "B={b:<3} K={k} acceptance {acc:.2}: {ms:.3} ms per step (verify alone {verify_ms:.3}), {per_step:.2} tokens per step, {tok_s:.0} tok/s = {:.2}x",
                    tok_s / plain_tok_s
                );
                rows.push(json!({
                    "batch": b, "drafts": k, "acceptance": acc, "context": a.context,
                    "plain_ms": plain_ms, "plain_tok_s": plain_tok_s,
                    "verify_graph_ms": verify_ms, "spec_ms": ms,
                    "tokens_per_step": per_step, "spec_tok_s": tok_s, "speedup": tok_s / plain_tok_s,
                }));
            }
        }
    }
    println!("MTP passes replayed from graphs: {}", graphs.mtp.replays());
    Ok(json!({
        "gpu": dev.gpu.info.name,
        "sampling": format!("{:?}", a.sampling),
        "model": format!("{} layers + MTP, dummy weights drawn on the device, forced acceptance (benchmark only)", a.cfg.num_hidden_layers),
        "weights_GiB": model.weights.bytes() as f64 / (1u64 << 30) as f64,
        "mtp_pass_graph_replays": graphs.mtp.replays(),
        "steps": rows,
    }))
}

/// Mean milliseconds per step of `TIMED_STEPS` steps after `WARMUP_STEPS`.
fn time_steps(step: &mut dyn FnMut(usize) -> anyhow::Result<()>) -> anyhow::Result<f64> {
    for j in 0..WARMUP_STEPS {
        step(j)?;
    }
    let t = Instant::now();
    for j in 0..TIMED_STEPS {
        step(WARMUP_STEPS + j)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / TIMED_STEPS as f64)
}

fn step_graph(model: &mut CudaModel, dev: &Device, graphs: &mut DecodeGraphs, plan: &StepPlan) -> anyhow::Result<()> {
    match model.step_with_graphs(dev, graphs, plan) {
        Some(r) => r.map(drop),
        None => anyhow::bail!("a decode step of {} rows was not replayed from a graph", plan.seqs.len()),
    }
}

/// The verify step of `plain`'s sequences with `k` drafts each, as the backend runs it: row `d` of
/// a sequence at position `context_len + d` over the same block table.
fn verify_rows(plain: &StepPlan, k: usize) -> StepPlan {
    let seqs = plain
        .seqs
        .iter()
        .flat_map(|s| (0..=k).map(move |d| SeqStep { context_len: s.context_len + d, ..s.clone() }))
        .collect();
    StepPlan { kind: plain.kind, seqs }
}

/// `plan` with every sequence drawing under `params` (its seed kept).
fn with_sampling(mut plan: StepPlan, params: &SamplingParams) -> StepPlan {
    for s in &mut plan.seqs {
        let seed = s.sample.as_ref().map_or(0, |r| r.seed);
        s.sample = Some(SampleRequest::new(params.clone(), seed));
    }
    plan
}

/// Step `j` of `b` sequences feeding `k` drafts each at position `context`, drafting `k`.
fn speculative_plan(b: usize, k: usize, context: usize, blocks_per_seq: usize, j: usize, vocab: usize) -> StepPlan {
    let mut plan = dummy_model::decode_plan(b, context, blocks_per_seq, j, vocab);
    for (i, s) in plan.seqs.iter_mut().enumerate() {
        s.tokens.extend((1..=k).map(|d| ((31 * i + 7 * d + j) % vocab) as u32));
        s.mtp = Some(MtpStep { drafts_fed: k, next_token: None, draft: k });
    }
    plan
}
