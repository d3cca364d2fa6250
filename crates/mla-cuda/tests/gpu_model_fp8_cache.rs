//! The FP8 latent cache (`--kv-cache-dtype fp8`) through the whole CUDA model:
//! - on the HF fixtures with the published MLA dims (`real_dims`, and `v3_fp8_real_dims` with its
//!   FP8 weights, W8A16 so that only the cache differs), prompt prefill then teacher-forced decode
//!   of HF's continuation: the drift of every log-probability from HF's f32 run (mean, p99 of
//!   |Δ log p|, top-1 agreement) within the bounds the CPU test sets (`mla-cpu`'s
//!   `fp8_cache_accuracy`: 4x what HF's own bf16 run drifts), printed beside the bf16 cache's;
//! - long contexts (4k and 12k tokens, the `real_dims` weights with positions opened up to 16k):
//!   the FP8 cache's teacher-forced rows against the bf16 cache's, and how many free-running
//!   greedy tokens agree (reported; the bound is loose, these are random weights).
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_model_fp8_cache -- --ignored --test-threads 1`.

mod common;

use common::hf::*;
use common::*;
use mla_core::sampling::{argmax, log_softmax};
use mla_core::step::plan::{LogitsRequest, SeqStep, StepKind, StepOutput, StepPlan};
use mla_core::{Backend, KvCacheDtype, ModelConfig};
use mla_cuda::{CudaBackend, CudaOptions, WeightsFrom};
use std::path::Path;

const DRIFT_FACTOR: f64 = 4.0;
const TOP1_MARGIN: f64 = 0.1;

struct Drift {
    mean: f64,
    p99: f64,
    top1: f64,
}

fn drift(ours: &[Vec<f32>], reference: &[Vec<f32>]) -> Drift {
    assert_eq!(ours.len(), reference.len());
    let mut d: Vec<f64> = ours
        .iter()
        .zip(reference)
        .flat_map(|(a, b)| log_softmax(a).into_iter().zip(log_softmax(b)).map(|(x, y)| (x - y).abs() as f64))
        .collect();
    d.sort_by(f64::total_cmp);
    let agree = ours.iter().zip(reference).filter(|(a, b)| argmax(a) == argmax(b)).count();
    Drift {
        mean: d.iter().sum::<f64>() / d.len() as f64,
        p99: d[d.len() * 99 / 100],
        top1: agree as f64 / ours.len() as f64,
    }
}

fn show(d: &Drift) -> String {
    format!("mean {:.2e} p99 {:.2e} top-1 {:.3}", d.mean, d.p99, d.top1)
}

fn step(b: &mut CudaBackend, kind: StepKind, seqs: Vec<SeqStep>) -> StepOutput {
    b.step(&StepPlan { kind, seqs }).unwrap()
}

fn backend(dir: &Path, cfg: &ModelConfig, dtype: KvCacheDtype, blocks: usize, chunk: usize) -> CudaBackend {
    let opts = CudaOptions {
        fp8_w8a8: false,
        max_num_batched_tokens: chunk,
        max_num_seqs: 8,
        max_extra_logit_rows: 256,
        num_blocks: Some(blocks),
        kv_cache_dtype: dtype,
        ..Default::default()
    };
    CudaBackend::new(cfg.clone(), WeightsFrom::Checkpoint(dir.to_path_buf()), opts).unwrap()
}

/// Prompt prefill then teacher-forced decode of `cont`: the rows of every fed token.
fn teacher_forced(b: &mut CudaBackend, prompt: &[u32], cont: &[u32], table: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut rows = vec![];
    for (c, piece) in prompt.chunks(chunk).enumerate() {
        let out = step(b, StepKind::Prefill, vec![seq(1, piece, c * chunk, table, LogitsRequest::All, None)]);
        rows.extend(out.seqs[0].logits.clone());
    }
    for (j, &t) in cont.iter().enumerate() {
        let s = seq(1, &[t], prompt.len() + j, table, LogitsRequest::Last, None);
        rows.extend(step(b, StepKind::Decode, vec![s]).seqs[0].logits.clone());
    }
    rows
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_cache_log_probabilities_stay_close_to_hf() {
    let mut failures = vec![];
    for variant in ["real_dims", "v3_fp8_real_dims"] {
        let dir = repo_root().join("tests/fixtures").join(variant);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let mut backends = [KvCacheDtype::Auto, KvCacheDtype::Fp8E4m3].map(|d| backend(&dir, &cfg, d, 16, 256));
        let (mut rows, mut f32_rows, mut bf16_rows) = ([vec![], vec![]], vec![], vec![]);
        for (i, p) in oracle(&dir).iter().enumerate() {
            let table: Vec<u32> = vec![12 - 2 * i as u32, 3 + 3 * i as u32];
            for (r, b) in rows.iter_mut().zip(backends.iter_mut()) {
                r.extend(teacher_forced(b, &p.prompt, &p.continuation, &table, 256));
            }
            f32_rows.extend(oracle_logits(&dir, "oracle_f32.safetensors", &p.name));
            bf16_rows.extend(oracle_logits(&dir, "oracle_bf16_cuda.safetensors", &p.name));
        }
        let yard = drift(&bf16_rows, &f32_rows);
        let (ours_bf16, ours_fp8) = (drift(&rows[0], &f32_rows), drift(&rows[1], &f32_rows));
        let between = drift(&rows[1], &rows[0]);
        println!(
            "{variant}: |Δ log p| vs HF f32: HF bf16 {}; bf16 cache {}; fp8 cache {} ({:.2}x HF bf16's mean); fp8 vs bf16 cache {}",
            show(&yard),
            show(&ours_bf16),
            show(&ours_fp8),
            ours_fp8.mean / yard.mean,
            show(&between)
        );
        if ours_fp8.mean > DRIFT_FACTOR * yard.mean
            || ours_fp8.p99 > DRIFT_FACTOR * yard.p99
            || ours_fp8.top1 < yard.top1 - TOP1_MARGIN
        {
            failures.push(format!("{variant}: fp8 cache {} against HF bf16 {}", show(&ours_fp8), show(&yard)));
        }
    }
    assert!(failures.is_empty(), "FP8 cache drift beyond the bounds:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_cache_over_long_contexts_against_the_bf16_cache() {
    let dir = real_dims_dir();
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.max_position_embeddings = 16384;
    let chunk = 2048;
    for ctx in [4096usize, 12288] {
        let prompt: Vec<u32> =
            std::iter::once(0).chain((1..ctx as u32).map(|i| ((i * 2_654_435_761u32) >> 7) % 510 + 2)).collect();
        let blocks = (ctx + 64).div_ceil(64) + 1;
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let mut bf = backend(&dir, &cfg, KvCacheDtype::Auto, blocks, chunk);
        let mut f8 = backend(&dir, &cfg, KvCacheDtype::Fp8E4m3, blocks, chunk);
        // Free-running greedy continuations of 32 tokens from each cache.
        let greedy_run = |b: &mut CudaBackend| -> Vec<u32> {
            for (c, piece) in prompt[..ctx - 1].chunks(chunk).enumerate() {
                step(b, StepKind::Prefill, vec![seq(1, piece, c * chunk, &table, LogitsRequest::None, None)]);
            }
            let mut out = vec![];
            let mut last = prompt[ctx - 1];
            for j in 0..32 {
                let s = seq(1, &[last], ctx - 1 + j, &table, LogitsRequest::None, greedy());
                last = step(b, StepKind::Decode, vec![s]).seqs[0].sampled.as_ref().unwrap().token;
                out.push(last);
            }
            out
        };
        let (g_bf, g_f8) = (greedy_run(&mut bf), greedy_run(&mut f8));
        let same = g_bf.iter().zip(&g_f8).take_while(|(a, b)| a == b).count();
        // Teacher-forced rows over the bf16 cache's continuation (fresh sequences on the same
        // blocks: the prefill rewrites every slot it reads).
        let tail = &prompt[ctx - 256..];
        let head = &prompt[..ctx - 256];
        let mut rows = vec![];
        for b in [&mut bf, &mut f8] {
            for (c, piece) in head.chunks(chunk).enumerate() {
                step(b, StepKind::Prefill, vec![seq(2, piece, c * chunk, &table, LogitsRequest::None, None)]);
            }
            let out = step(b, StepKind::Prefill, vec![seq(2, tail, head.len(), &table, LogitsRequest::All, None)]);
            let mut r = out.seqs[0].logits.clone();
            for (j, &t) in g_bf.iter().enumerate() {
                let s = seq(2, &[t], ctx + j, &table, LogitsRequest::Last, None);
                r.extend(step(b, StepKind::Decode, vec![s]).seqs[0].logits.clone());
            }
            rows.push(r);
        }
        let d = drift(&rows[1], &rows[0]);
        println!(
            "context {ctx}: fp8 vs bf16 cache over the last 256 prompt rows and 32 decode rows: {}; greedy: {same} of 32 tokens agree before the first difference",
            show(&d)
        );
        assert!(rows[1].iter().flatten().all(|x| x.is_finite()), "context {ctx}: non-finite logits");
        assert!(d.top1 >= 0.8, "context {ctx}: top-1 agreement {:.3} with the bf16 cache", d.top1);
    }
}
