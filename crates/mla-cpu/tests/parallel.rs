//! The sharded plans of tensor parallelism and DP attention on the CPU reference backend
//! (`CpuGroupBackend`: ranks on threads, a `ThreadGroup` for the collectives) give what one rank
//! gives, within f32 rounding, and what HF transformers gives (the fixtures' oracle logits):
//! - TP 2 and 4 on every fixture variant: one prefill of prompt + continuation, then the prompt
//!   prefilled and the continuation decoded through the paged cache (absorbed path);
//! - DP attention over 2 and 4 ranks with uneven work: in one step a rank prefills, another
//!   decodes, another prefills a later chunk of a cached prompt, and the rest sit idle;
//! - TP 8 on an 8-head model against TP 1.

use crate::common;

use common::{config, fixture_dir, load_prompts, max_abs_diff, seq, Prompt};
use mla_core::step::plan::{StepKind, StepOutput, StepPlan};
use mla_core::{
    Backend, CacheLayout, Checkpoint, DummyWeights, KvCacheDtype, ModelConfig, Parallel, StepLimits, WeightSource,
};
use mla_cpu::group::local_group;
use mla_cpu::{CpuBackend, CpuGroupBackend};
use std::sync::Arc;
use std::time::Duration;

/// Between ranks and one rank: the same sums in another order.
const RANKS_TOLERANCE: f32 = 1e-4;
/// Against HF's f32 logits (as tests/hf_fixtures.rs).
const HF_TOLERANCE: f32 = 2e-3;
const BLOCK_SIZE: usize = 16;
const VARIANTS: [&str; 5] = ["v2_lite", "v2", "v3", "v3_fp8", "real_dims"];

struct Fixture {
    cfg: ModelConfig,
    weights: Arc<dyn WeightSource + Send + Sync>,
    prompts: Vec<Prompt>,
}

fn fixture(variant: &'static str) -> Fixture {
    let dir = fixture_dir(variant);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let prompts = load_prompts(&dir, cfg.vocab_size);
    let weights = Arc::new(Checkpoint::open(&dir, &cfg).unwrap());
    Fixture { cfg, weights, prompts }
}

fn group(f: &Fixture, parallel: Parallel, blocks: usize) -> CpuGroupBackend {
    let cache = CacheLayout { block_size: BLOCK_SIZE, num_blocks: blocks };
    local_group(
        f.cfg.clone(),
        f.weights.clone(),
        parallel,
        cache,
        KvCacheDtype::Auto,
        StepLimits::unlimited(),
        Duration::from_secs(600),
        false,
    )
    .unwrap()
}

fn single(f: &Fixture, blocks: usize) -> CpuBackend {
    CpuBackend::new(f.cfg.clone(), f.weights.as_ref(), BLOCK_SIZE, blocks).unwrap()
}

fn table(blocks: usize) -> Vec<u32> {
    (0..blocks as u32).rev().collect()
}

fn full(p: &Prompt) -> Vec<u32> {
    p.prompt.iter().chain(&p.continuation).copied().collect()
}

/// Prefill of prompt + continuation, then prompt prefill + token-by-token decode: both row sets.
fn prefill_and_decode(b: &mut dyn Backend, p: &Prompt, blocks: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let t = table(blocks);
    let one = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &full(p), 0, &t)] }).unwrap();
    let mut rows = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![seq(2, &p.prompt, 0, &t)] }).unwrap().seqs[0]
        .logits
        .clone();
    for (j, &tok) in p.continuation.iter().enumerate() {
        let step = StepPlan { kind: StepKind::Decode, seqs: vec![seq(2, &[tok], p.prompt.len() + j, &t)] };
        rows.extend(b.step(&step).unwrap().seqs[0].logits.clone());
    }
    (one.seqs[0].logits.clone(), rows)
}

#[test]
fn tensor_parallel_matches_one_rank_and_hf_on_every_fixture() {
    for variant in VARIANTS {
        let f = fixture(variant);
        let blocks = f.prompts.iter().map(|p| full(p).len()).max().unwrap().div_ceil(BLOCK_SIZE);
        for tp in [2, 4] {
            let parallel = Parallel::from_flags(tp, None, false).unwrap();
            let (mut worst_ranks, mut worst_hf) = (0f32, 0f32);
            for p in &f.prompts {
                // Fresh caches per prompt: every sequence starts at block 0 of a reversed table.
                let (want_one, want_rows) = prefill_and_decode(&mut single(&f, blocks), p, blocks);
                let (one, rows) = prefill_and_decode(&mut group(&f, parallel, blocks), p, blocks);
                let vs_ranks = max_abs_diff(&one, &want_one).max(max_abs_diff(&rows, &want_rows));
                let vs_hf = max_abs_diff(&one, &p.oracle).max(max_abs_diff(&rows, &p.oracle));
                assert!(vs_ranks <= RANKS_TOLERANCE, "{variant} tp {tp} {}: {vs_ranks} from one rank", p.name);
                assert!(vs_hf <= HF_TOLERANCE, "{variant} tp {tp} {}: {vs_hf} from HF", p.name);
                (worst_ranks, worst_hf) = (worst_ranks.max(vs_ranks), worst_hf.max(vs_hf));
            }
            println!("{variant} tp {tp}: worst |tp - one rank| {worst_ranks:.2e}, worst |tp - HF| {worst_hf:.2e}");
        }
    }
}

/// Logits of `seq_id`'s rows in a step's output of rank `rank`.
fn rows_of(outs: &[StepOutput], rank: usize, seq_id: u64) -> Vec<Vec<f32>> {
    outs[rank].seqs.iter().find(|s| s.seq_id == seq_id).expect("sequence answered").logits.clone()
}

#[test]
fn dp_attention_with_idle_and_mixed_ranks_matches_one_rank_and_hf() {
    for variant in VARIANTS {
        let f = fixture(variant);
        let (a, b, c) = (&f.prompts[0], &f.prompts[1], &f.prompts[2]);
        let blocks = f.prompts.iter().map(|p| full(p).len()).max().unwrap().div_ceil(BLOCK_SIZE);
        let t = table(blocks);
        for ranks in [2, 4] {
            let parallel = Parallel::from_flags(ranks, None, true).unwrap();
            let mut g = group(&f, parallel, blocks);
            let empty = || StepPlan { kind: StepKind::Decode, seqs: vec![] };
            let mut plans = |by_rank: Vec<(usize, StepPlan)>| {
                let mut ps: Vec<StepPlan> = (0..ranks).map(|_| empty()).collect();
                for (r, p) in by_rank {
                    ps[r] = p;
                }
                g.start_step(&Arc::new(ps));
                g.finish_step().unwrap()
            };
            let last = ranks - 1;
            // Step 1: the last rank prefills all of A; rank 0 the first half of B's prompt; the
            // ranks between are idle.
            let half = b.prompt.len() / 2;
            let outs = plans(vec![
                (last, StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &full(a), 0, &t)] }),
                (0, StepPlan { kind: StepKind::Prefill, seqs: vec![seq(2, &b.prompt[..half], 0, &t)] }),
            ]);
            let a_rows = rows_of(&outs, last, 1);
            let mut b_rows = rows_of(&outs, 0, 2);
            // Step 2: rank 0 prefills the rest of B's prompt over its cached half (a chunked
            // prefill); the last rank prefills C's prompt into its own cache.
            let outs = plans(vec![
                (0, StepPlan { kind: StepKind::Prefill, seqs: vec![seq(2, &b.prompt[half..], half, &t)] }),
                (last, StepPlan { kind: StepKind::Prefill, seqs: vec![seq(3, &c.prompt, 0, &t)] }),
            ]);
            b_rows.extend(rows_of(&outs, 0, 2));
            let mut c_rows = rows_of(&outs, last, 3);
            // Then rank 0 decodes B's continuation while the last rank decodes C's: one decodes
            // while the other's plan differs in length; with 4 ranks, ranks 1-2 stay idle.
            for j in 0..b.continuation.len().max(c.continuation.len()) {
                let mut by_rank = vec![];
                if let Some(&tok) = b.continuation.get(j) {
                    by_rank.push((
                        0,
                        StepPlan { kind: StepKind::Decode, seqs: vec![seq(2, &[tok], b.prompt.len() + j, &t)] },
                    ));
                }
                if let Some(&tok) = c.continuation.get(j) {
                    by_rank.push((
                        last,
                        StepPlan { kind: StepKind::Decode, seqs: vec![seq(3, &[tok], c.prompt.len() + j, &t)] },
                    ));
                }
                let outs = plans(by_rank);
                if j < b.continuation.len() {
                    b_rows.extend(rows_of(&outs, 0, 2));
                }
                if j < c.continuation.len() {
                    c_rows.extend(rows_of(&outs, last, 3));
                }
            }
            let mut one = single(&f, blocks);
            let want_a = one.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &full(a), 0, &t)] }).unwrap();
            let (_, want_b) = prefill_and_decode(&mut single(&f, blocks), b, blocks);
            let (_, want_c) = prefill_and_decode(&mut single(&f, blocks), c, blocks);
            let mut worst = (0f32, 0f32);
            for (name, got, want, oracle) in [
                ("A", &a_rows, &want_a.seqs[0].logits, &a.oracle),
                ("B", &b_rows, &want_b, &b.oracle),
                ("C", &c_rows, &want_c, &c.oracle),
            ] {
                let (vs_one, vs_hf) = (max_abs_diff(got, want), max_abs_diff(got, oracle));
                assert!(vs_one <= RANKS_TOLERANCE, "{variant} dp {ranks} {name}: {vs_one} from one rank");
                assert!(vs_hf <= HF_TOLERANCE, "{variant} dp {ranks} {name}: {vs_hf} from HF");
                worst = (worst.0.max(vs_one), worst.1.max(vs_hf));
            }
            println!(
                "{variant} dp attention {ranks}: worst |dp - one rank| {:.2e}, worst |dp - HF| {:.2e}",
                worst.0, worst.1
            );
        }
    }
}

const EIGHT_HEADS: &str = r#"{
  "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 3, "num_attention_heads": 8, "q_lora_rank": 24, "kv_lora_rank": 32,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 512,
  "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16, "n_shared_experts": 1,
  "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": true,
  "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000
}"#;

#[test]
fn tensor_parallel_over_eight_ranks_matches_one_rank() {
    let cfg = config(EIGHT_HEADS);
    let weights: Arc<dyn WeightSource + Send + Sync> = Arc::new(DummyWeights::new(5));
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 3) % 64).collect();
    let p = Prompt {
        name: "eight".into(),
        prompt: prompt[..30].to_vec(),
        continuation: prompt[30..].to_vec(),
        gaps: vec![],
        oracle: vec![],
    };
    let blocks = 4;
    let mut one = CpuBackend::new(cfg.clone(), weights.as_ref(), BLOCK_SIZE, blocks).unwrap();
    let cache = CacheLayout { block_size: BLOCK_SIZE, num_blocks: blocks };
    let tp8 = Parallel::from_flags(8, None, false).unwrap();
    let mut tp8 = local_group(
        cfg,
        weights,
        tp8,
        cache,
        KvCacheDtype::Auto,
        StepLimits::unlimited(),
        Duration::from_secs(600),
        false,
    )
    .unwrap();
    let (want_one, want_rows) = prefill_and_decode(&mut one, &p, blocks);
    let (got_one, got_rows) = prefill_and_decode(&mut tp8, &p, blocks);
    let e = max_abs_diff(&got_one, &want_one).max(max_abs_diff(&got_rows, &want_rows));
    let scale = want_one.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    println!("tp 8: worst |tp - one rank| {e:.2e} (largest logit {scale:.2})");
    assert!(e <= RANKS_TOLERANCE && scale > 0.1, "tp 8 differs from one rank by {e}");
}

#[test]
fn a_plan_that_does_not_fit_is_refused_before_any_rank_runs() {
    let f = fixture("v2_lite");
    let mut g = group(&f, Parallel::from_flags(2, None, true).unwrap(), 2);
    // Rank 1's table names block 9 of 2: the step is refused as a whole, and the group works on.
    let bad = StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &[1, 2, 3], 0, &[9])] };
    let ok = StepPlan { kind: StepKind::Prefill, seqs: vec![seq(2, &[1, 2, 3], 0, &[0])] };
    g.start_step(&Arc::new(vec![ok.clone(), bad]));
    let e = g.finish_step().unwrap_err().to_string();
    assert!(e.contains("outside the cache"), "{e}");
    g.start_step(&Arc::new(vec![ok, StepPlan { kind: StepKind::Decode, seqs: vec![] }]));
    assert_eq!(g.finish_step().unwrap().len(), 2);
}
