//! End-to-end agreement with HF transformers 5.17 (f32 oracle logits in tests/fixtures/<variant>,
//! see CONTRIBUTING.md) for every fixture variant:
//! - one-piece prefill of prompt + continuation reproduces every oracle row;
//! - prefill of the prompt, then teacher-forced token-by-token decode through the paged cache
//!   (absorbed path) reproduces the rows at those positions;
//! - free-running greedy decoding reproduces HF's continuation up to the first step whose
//!   top1-top2 gap is below 1e-3 (where f32 rounding may legitimately flip the choice).
//!
//! The fixtures are committed (tests/fixtures/README.md says how they were made, with HF
//! transformers on a GPU machine): a variant whose directory is absent fails, since a test that
//! passes without its oracle proves nothing.

use crate::common;

use common::{fixture_dir, load_prompts, max_abs_diff, seq};
use mla_core::step::plan::{LogitsRequest, SampleRequest, StepKind, StepPlan};
use mla_core::{Backend, Checkpoint, ModelConfig, SamplingParams};
use mla_cpu::CpuBackend;

const TOLERANCE: f32 = 2e-3;
const GAP_FLOOR: f32 = 1e-3;
const BLOCK_SIZE: usize = 16;

fn backend(dir: &std::path::Path, cfg: &ModelConfig, blocks: usize) -> CpuBackend {
    let ckpt = Checkpoint::open(dir, cfg).unwrap();
    CpuBackend::new(cfg.clone(), &ckpt, BLOCK_SIZE, blocks).unwrap()
}

/// Worst per-row error, with the row index, for the report.
fn worst_row(ours: &[Vec<f32>], oracle: &[Vec<f32>]) -> (f32, usize) {
    (0..ours.len()).map(|i| (max_abs_diff(&ours[i..=i], &oracle[i..=i]), i)).fold((0.0, 0), |a, b| {
        if b.0 > a.0 {
            b
        } else {
            a
        }
    })
}

fn greedy_request() -> SampleRequest {
    SampleRequest::new(SamplingParams::greedy(), 0)
}

fn check_variant(variant: &str) {
    let dir = fixture_dir(variant);
    assert!(
        dir.is_dir(),
        "{variant}: fixture directory {} is absent; the HF fixtures are committed (tests/fixtures/README.md)",
        dir.display()
    );
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let prompts = load_prompts(&dir, cfg.vocab_size);
    let longest = prompts.iter().map(|p| p.oracle.len()).max().unwrap();
    let blocks = longest.div_ceil(BLOCK_SIZE);
    // A reversed block table, so logical and physical order differ.
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let (mut worst_prefill, mut worst_decode) = (0.0f32, 0.0f32);

    for p in &prompts {
        let full: Vec<u32> = p.prompt.iter().chain(&p.continuation).copied().collect();
        let n = p.prompt.len();

        // One forward over prompt + continuation on the normal path.
        let mut b = backend(&dir, &cfg, blocks);
        let out = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &full, 0, &table)] }).unwrap();
        let (err, row) = worst_row(&out.seqs[0].logits, &p.oracle);
        worst_prefill = worst_prefill.max(err);
        assert!(err <= TOLERANCE, "{variant}/{}: prefill logits off by {err} at row {row}", p.name);

        // Prompt prefill, then teacher-forced decode of HF's continuation on the absorbed path.
        let mut b = backend(&dir, &cfg, blocks);
        let mut rows =
            b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &p.prompt, 0, &table)] }).unwrap().seqs[0]
                .logits
                .clone();
        for (j, &t) in p.continuation.iter().enumerate() {
            let out = b.step(&StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, &[t], n + j, &table)] }).unwrap();
            rows.extend(out.seqs[0].logits.iter().cloned());
        }
        let (err, row) = worst_row(&rows, &p.oracle);
        worst_decode = worst_decode.max(err);
        assert!(err <= TOLERANCE, "{variant}/{}: prefill+decode logits off by {err} at row {row}", p.name);

        // Free-running greedy generation with the backend's sampler.
        let mut b = backend(&dir, &cfg, blocks);
        let mut first = seq(1, &p.prompt, 0, &table);
        first.logits = LogitsRequest::None;
        first.sample = Some(greedy_request());
        let mut token = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![first] }).unwrap().seqs[0]
            .sampled
            .as_ref()
            .unwrap()
            .token;
        for j in 0..p.continuation.len() {
            if p.gaps[j] < GAP_FLOOR {
                println!("{variant}/{}: greedy comparison stops at step {j} (HF gap {:.1e})", p.name, p.gaps[j]);
                break;
            }
            assert_eq!(
                token, p.continuation[j],
                "{variant}/{}: greedy token {j} differs from HF (gap {})",
                p.name, p.gaps[j]
            );
            let mut s = seq(1, &[token], n + j, &table);
            s.logits = LogitsRequest::None;
            s.sample = Some(greedy_request());
            token = b.step(&StepPlan { kind: StepKind::Decode, seqs: vec![s] }).unwrap().seqs[0]
                .sampled
                .as_ref()
                .unwrap()
                .token;
        }
    }
    println!(
        "{variant}: worst |logit - HF f32| prefill {worst_prefill:.3e}, prefill+decode {worst_decode:.3e} ({} prompts)",
        prompts.len()
    );
}

#[test]
fn v2_lite_matches_hf() {
    check_variant("v2_lite");
}

#[test]
fn v2_matches_hf() {
    check_variant("v2");
}

#[test]
fn v3_matches_hf() {
    check_variant("v3");
}

#[test]
fn v3_fp8_matches_hf() {
    check_variant("v3_fp8");
}

#[test]
fn real_dims_matches_hf() {
    check_variant("real_dims");
}

#[test]
fn v3_fp8_real_dims_matches_hf() {
    check_variant("v3_fp8_real_dims");
}
