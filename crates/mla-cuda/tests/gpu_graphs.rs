//! Serving decode steps from CUDA graphs (`CudaOptions::cuda_graph_batch_sizes`): a backend that
//! replays padded graphs must give the tokens of a backend that runs every step eagerly.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_graphs -- --ignored --test-threads 1`.

mod common;

use common::*;
use mla_core::step::plan::{LogitsRequest, SampleRequest, StepKind, StepOutput, StepPlan};
use mla_core::step::token_mask::{mask_words, MaskWriter, TokenMask};
use mla_core::{Backend, ModelConfig, SamplingParams};
use mla_cuda::{CudaBackend, CudaOptions, WeightsFrom};
use std::sync::Arc;
use std::time::Duration;

fn backend(graph_sizes: Vec<usize>) -> CudaBackend {
    let dir = real_dims_dir();
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let opts = CudaOptions {
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        num_blocks: Some(64),
        cuda_graph_batch_sizes: graph_sizes,
        ..Default::default()
    };
    CudaBackend::new(cfg, WeightsFrom::Checkpoint(dir), opts).unwrap()
}

fn sample(i: usize) -> Option<SampleRequest> {
    // Greedy rows and seeded top-p rows: a replay must reproduce both.
    let params = if i.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams { temperature: 0.8, top_p: 0.9, ..Default::default() }
    };
    Some(SampleRequest {
        params,
        seed: 77 + i as u64,
        top_logprobs: Some(2),
        penalty: None,
        logit_bias: Vec::new(),
        allowed: None,
    })
}

fn decode(active: &[usize], lens: &[usize], last: &[u32], tables: &[Vec<u32>]) -> StepPlan {
    let seqs = active
        .iter()
        .map(|&i| seq(i as u64, &[last[i]], lens[i], &tables[i], LogitsRequest::None, sample(i)))
        .collect();
    StepPlan { kind: StepKind::Decode, seqs }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_replay_gives_the_eager_tokens_with_padding_and_fallback() {
    let mut eager = backend(vec![]);
    let mut graphs = backend(vec![1, 2, 4]);
    assert!(eager.graph_batch_sizes().is_empty());
    // max_num_seqs (8) is always captured, so 5..8 sequences pad to 8.
    assert_eq!(graphs.graph_batch_sizes(), &[1, 2, 4, 8]);
    let mut rng = Rng::new(5);
    let n = 6;
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| (0..5 + 9 * i).map(|_| rng.below(512) as u32).collect()).collect();
    let tables: Vec<Vec<u32>> = (0..n as u32).map(|i| vec![2 * i + 1, 40 + i]).collect();
    let prefill = StepPlan {
        kind: StepKind::Prefill,
        seqs: (0..n).map(|i| seq(i as u64, &prompts[i], 0, &tables[i], LogitsRequest::None, sample(i))).collect(),
    };
    let pe = eager.step(&prefill).unwrap();
    let pg = graphs.step(&prefill).unwrap();
    assert_eq!(pe, pg, "prefill runs eagerly on both");
    let mut last: Vec<u32> = pe.seqs.iter().map(|s| s.sampled.as_ref().unwrap().token).collect();
    let mut lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    // 6 sequences (bucket 8), 3 (bucket 4), 1 (bucket 1, no padding), 2 (bucket 2).
    let phases: [(&[usize], usize); 4] = [(&[0, 1, 2, 3, 4, 5], 4), (&[1, 3, 5], 4), (&[2], 3), (&[0, 4], 3)];
    let schedule: Vec<Vec<usize>> = phases.iter().flat_map(|&(a, k)| std::iter::repeat_n(a.to_vec(), k)).collect();
    let (mut compared, mut near_ties, mut worst_lp) = (0, 0, 0f32);
    for (j, active) in schedule.iter().enumerate() {
        let plan = decode(active, &lens, &last, &tables);
        let e: StepOutput = eager.step(&plan).unwrap();
        let g: StepOutput = graphs.step(&plan).unwrap();
        assert_eq!(e.seqs.len(), active.len());
        assert_eq!(g.seqs.len(), active.len(), "step {j}: padding rows leaked into the output");
        for (se, sg) in e.seqs.iter().zip(&g.seqs) {
            assert_eq!(se.seq_id, sg.seq_id);
            let (te, tg) = (se.sampled.as_ref().unwrap(), sg.sampled.as_ref().unwrap());
            // Split count and GEMM shapes differ between the padded graph and the eager step,
            // so logits agree to rounding; tokens must agree unless the eager top two are
            // closer than that rounding.
            let gap = te.top_logprobs[0].1 - te.top_logprobs[1].1;
            if gap >= 0.02 {
                assert_eq!(te.token, tg.token, "step {j} seq {}: graph token differs (eager gap {gap})", se.seq_id);
            } else {
                near_ties += 1;
            }
            if te.token == tg.token {
                worst_lp = worst_lp.max((te.logprob - tg.logprob).abs());
            }
            compared += 1;
        }
        for (k, &i) in active.iter().enumerate() {
            last[i] = e.seqs[k].sampled.as_ref().unwrap().token;
            lens[i] += 1;
        }
    }
    assert!(worst_lp < 0.02, "chosen-token logprobs differ by {worst_lp}");
    let (ce, cg) = (*eager.step_clock().lock().unwrap(), *graphs.step_clock().lock().unwrap());
    assert_eq!(ce.graph_steps, 0);
    assert_eq!(cg.graph_steps, schedule.len() as u64, "every decode step should have replayed a graph");
    println!("graph vs eager: {compared} tokens compared, {near_ties} near ties skipped, worst chosen-logprob diff {worst_lp:.2e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn unpadded_replay_is_bitwise_the_eager_step_with_the_same_split_count() {
    let mut b = backend(vec![1, 2, 4]);
    let mut rng = Rng::new(9);
    let prompt: Vec<u32> = (0..40).map(|_| rng.below(512) as u32).collect();
    let table = vec![3u32, 9];
    let first = b
        .step(&StepPlan {
            kind: StepKind::Prefill,
            seqs: vec![seq(0, &prompt, 0, &table, LogitsRequest::None, sample(1))],
        })
        .unwrap();
    let tok = first.seqs[0].sampled.as_ref().unwrap().token;
    let plan = decode(&[0], &[prompt.len()], &[tok], &[table]);
    let replayed = b.step(&plan).unwrap();
    assert_eq!(b.step_clock().lock().unwrap().graph_steps, 1);
    let p = plan.clone();
    let eager = b
        .with_worker(move |w| {
            w.model.decode_splits_override = Some(w.model.graph_decode_splits(&w.dev, 1));
            let out = w.model.step(&w.dev, &p);
            w.model.decode_splits_override = None;
            out
        })
        .unwrap()
        .unwrap();
    assert_eq!(replayed, eager);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_long_penalty_history_grows_its_buffer_under_the_graphs() {
    // Penalty entries live in a buffer of their own whose address the graphs read from the
    // metadata, so a large-vocabulary model's long history (more entries than the buffer holds
    // at start) grows that buffer and the step still replays its graph, equal to the eager step
    // bit for bit; no graph is ever captured again.
    let cfg = config("deepseek-v2-lite.json");
    let opts = CudaOptions {
        max_num_batched_tokens: 256,
        max_num_seqs: 4,
        max_model_len: Some(512),
        num_blocks: Some(16),
        cuda_graph_batch_sizes: vec![1, 2],
        ..Default::default()
    };
    let mut b = CudaBackend::new(cfg.clone(), WeightsFrom::DummyOnDevice { seed: 3 }, opts).unwrap();
    let tables = [vec![0u32, 1], vec![2u32, 3]];
    let prefill = StepPlan {
        kind: StepKind::Prefill,
        seqs: (0..2)
            .map(|i| seq(i as u64, &[5 + i as u32; 20], 0, &tables[i], LogitsRequest::None, sample(0)))
            .collect(),
    };
    let out = b.step(&prefill).unwrap();
    let mut last: Vec<u32> = out.seqs.iter().map(|s| s.sampled.as_ref().unwrap().token).collect();
    let history: Vec<u32> = (0..40_000u32).map(|t| (t * 7) % cfg.vocab_size as u32).collect();
    let penalised = |last: &[u32], pos: usize| {
        let mut p = decode(&[0, 1], &[pos, pos], last, &tables);
        let s = p.seqs[0].sample.as_mut().unwrap();
        s.params.repetition_penalty = 1.3;
        s.penalty = Some(mla_core::step::plan::PenaltyTokens { prompt: history.clone(), output: vec![] });
        p
    };
    let graph_steps = |b: &CudaBackend| b.step_clock().lock().unwrap().graph_steps;
    // 20: plain graph step; 21: the history outgrows the penalty buffer; 22: a graph again.
    let o = b.step(&decode(&[0, 1], &[20, 20], &last, &tables)).unwrap();
    assert_eq!(graph_steps(&b), 1);
    last = o.seqs.iter().map(|s| s.sampled.as_ref().unwrap().token).collect();
    let o = b.step(&penalised(&last, 21)).unwrap();
    assert_eq!(graph_steps(&b), 2, "the step that grows the penalty buffer replays its graph");
    last = o.seqs.iter().map(|s| s.sampled.as_ref().unwrap().token).collect();
    let plan = penalised(&last, 22);
    let replayed = b.step(&plan).unwrap();
    assert_eq!(graph_steps(&b), 3, "graphs keep replaying after the buffer moved");
    let eager = b
        .with_worker(move |w| {
            w.model.decode_splits_override = Some(w.model.graph_decode_splits(&w.dev, 2));
            let out = w.model.step(&w.dev, &plan);
            w.model.decode_splits_override = None;
            out
        })
        .unwrap()
        .unwrap();
    assert_eq!(replayed, eager);
}

/// The mask words allowing exactly `allowed` of the fixture's 512 tokens.
fn allow(allowed: &[u32]) -> Vec<u32> {
    let mut w = vec![0u32; mask_words(512)];
    for &t in allowed {
        w[t as usize / 32] |= 1 << (t % 32);
    }
    w
}

/// Gives every row of `plan` an empty mask slot (and row 0 a -inf bias on `banned`, as min_tokens
/// does); returns the writers, which the test fills after the step has started, as the engine does.
fn with_pending_masks(plan: &mut StepPlan, banned: u32) -> Vec<MaskWriter> {
    let mut writers = Vec::new();
    for (k, s) in plan.seqs.iter_mut().enumerate() {
        let (mask, writer) = TokenMask::pending();
        let r = s.sample.as_mut().unwrap();
        r.allowed = Some(mask);
        if k == 0 {
            r.logit_bias = vec![(banned, f32::NEG_INFINITY)];
        }
        writers.push(writer);
    }
    writers
}

/// Starts `plan`, fills its masks with `masks` only once the step is under way (the forward pass
/// queued, the sampler waiting), and returns the step's output.
fn step_filling_late(b: &mut CudaBackend, plan: &StepPlan, writers: Vec<MaskWriter>, masks: &[Vec<u32>]) -> StepOutput {
    b.start_step(&Arc::new(vec![plan.clone()]));
    std::thread::sleep(Duration::from_millis(30));
    for (w, m) in writers.into_iter().zip(masks) {
        w.fill(m.clone());
    }
    let mut outs = b.finish_step().unwrap();
    outs.pop().unwrap()
}

fn tokens(out: &StepOutput) -> Vec<u32> {
    out.seqs.iter().map(|s| s.sampled.as_ref().unwrap().token).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn masked_decode_steps_replay_the_graph_with_the_eager_tokens() {
    let mut b = backend(vec![1, 2, 4]);
    let graph_steps = |b: &CudaBackend| b.step_clock().lock().unwrap().graph_steps;
    // Whether the graph of `batch` rows has its sampler node enabled (off after a masked step).
    let samples_in_graph = |b: &CudaBackend, batch: usize| {
        b.with_worker(move |w| w.graphs.graphs().iter().find(|g| g.batch == batch).unwrap().samples_in_graph()).unwrap()
    };
    let mut rng = Rng::new(12);
    let n = 3;
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| (0..20 + 7 * i).map(|_| rng.below(512) as u32).collect()).collect();
    let tables: Vec<Vec<u32>> = (0..n as u32).map(|i| vec![4 * i + 2, 4 * i + 3]).collect();
    let prefill = StepPlan {
        kind: StepKind::Prefill,
        seqs: (0..n).map(|i| seq(i as u64, &prompts[i], 0, &tables[i], LogitsRequest::None, sample(i))).collect(),
    };
    let mut last = tokens(&b.step(&prefill).unwrap());
    let mut lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let advance = |last: &mut Vec<u32>, lens: &mut Vec<usize>, active: &[usize], out: &StepOutput| {
        for (k, &i) in active.iter().enumerate() {
            last[i] = out.seqs[k].sampled.as_ref().unwrap().token;
            lens[i] += 1;
        }
    };
    // The eager step of `plan` with the split count of the graph of `batch` rows (bitwise equal
    // to an unpadded replay).
    let eager_as_graph = |b: &CudaBackend, plan: &StepPlan, batch: usize| -> StepOutput {
        let p = plan.clone();
        b.with_worker(move |w| {
            w.model.decode_splits_override = Some(w.model.graph_decode_splits(&w.dev, batch));
            let out = w.model.step(&w.dev, &p);
            w.model.decode_splits_override = None;
            out
        })
        .unwrap()
        .unwrap()
    };

    // 1. Two sequences (the graph of 2, unpadded), greedy and seeded top-p, each with a few
    // allowed tokens and sequence 0's best one banned by a -inf bias.
    let active = [0usize, 1];
    let allowed = [vec![7u32, 100, 300, 511], vec![1u32, 42, 200, 333, 480]];
    let mut plan = decode(&active, &lens, &last, &tables);
    let writers = with_pending_masks(&mut plan, 300);
    let before = graph_steps(&b);
    let masks: Vec<Vec<u32>> = allowed.iter().map(|a| allow(a)).collect();
    let replayed = step_filling_late(&mut b, &plan, writers, &masks);
    assert_eq!(graph_steps(&b), before + 1, "a masked decode step replays its graph");
    for (k, t) in tokens(&replayed).iter().enumerate() {
        assert!(allowed[k].contains(t), "sequence {k} drew {t}, outside its mask {:?}", allowed[k]);
    }
    assert_ne!(tokens(&replayed)[0], 300, "the -inf bias bans token 300");
    // The plan's clone shares the (now filled) mask slots.
    assert_eq!(replayed, eager_as_graph(&b, &plan, 2), "masked replay vs eager");
    // The tokens are right either way; this is about the launch the split saves.
    let split = b.with_worker(|w| w.graphs.graphs().iter().map(|g| g.splits_sampler()).collect::<Vec<_>>()).unwrap();
    assert!(
        split.iter().all(|&x| x),
        "the sampler node was not found in every decode graph ({split:?}): masked steps still work, sampling twice"
    );
    assert!(!samples_in_graph(&b, 2), "disabling the sampler node failed (see the log): masked steps sample twice");
    advance(&mut last, &mut lens, &active, &replayed);

    // 2. The next step has no masks: the graph samples again itself, still the eager tokens.
    let plan = decode(&active, &lens, &last, &tables);
    let replayed = b.step(&plan).unwrap();
    assert_eq!(graph_steps(&b), before + 2);
    assert!(samples_in_graph(&b, 2), "an unmasked step runs the graph's own sampler again");
    assert_eq!(replayed, eager_as_graph(&b, &plan, 2), "unmasked replay after a masked one vs eager");
    advance(&mut last, &mut lens, &active, &replayed);

    // 3. Three sequences pad to the graph of 4: one allowed token each, so the tokens are known.
    let active = [0usize, 1, 2];
    let only = [vec![17u32], vec![256u32], vec![511u32]];
    let mut plan = decode(&active, &lens, &last, &tables);
    let writers = with_pending_masks(&mut plan, 5);
    let masks: Vec<Vec<u32>> = only.iter().map(|a| allow(a)).collect();
    let replayed = step_filling_late(&mut b, &plan, writers, &masks);
    assert_eq!(graph_steps(&b), before + 3, "a padded masked step replays its graph");
    assert_eq!(replayed.seqs.len(), 3, "padding rows leaked into the output");
    assert_eq!(tokens(&replayed), vec![17, 256, 511]);
    advance(&mut last, &mut lens, &active, &replayed);

    // 4. A mask that never comes (its writer dropped: the engine's constraint failed) fails the
    // step with an error naming the sequence; the backend goes on.
    let mut plan = decode(&active, &lens, &last, &tables);
    let writers = with_pending_masks(&mut plan, 5);
    b.start_step(&Arc::new(vec![plan.clone()]));
    let mut writers = writers.into_iter();
    writers.next().unwrap().fill(allow(&[9]));
    drop(writers);
    let err = format!("{:#}", b.finish_step().expect_err("a dropped mask writer fails the step"));
    assert!(err.contains("sequence 1"), "the error should name the sequence: {err}");
    let plan = decode(&active, &lens, &last, &tables);
    let out = b.step(&plan).unwrap();
    assert_eq!(out.seqs.len(), 3, "the backend steps on after a failed mask");
}
