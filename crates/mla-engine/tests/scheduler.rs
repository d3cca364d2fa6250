//! Scheduler policy: chunked prefill, fairness, limits, prefix sharing, preemption, finishing.
//! Tokens are answered by a stand-in that derives them from the position, so a recompute can
//! be checked against what was sampled before.

use mla_core::step::plan::{LogitsRequest, SampledToken, SeqResult, StepOutput};
use mla_core::{CacheLayout, SamplingParams, StepKind, StepPlan};
use mla_engine::scheduler::{Applied, EarlyFinish, Scheduler, SchedulerConfig};
use mla_engine::{FinishReason, GenerateRequest};
use std::collections::HashMap;

fn sched(block_size: usize, num_blocks: usize, max_num_seqs: usize, budget: usize) -> Scheduler {
    sched_with(block_size, num_blocks, max_num_seqs, budget, false)
}

fn sched_with(block_size: usize, num_blocks: usize, max_num_seqs: usize, budget: usize, mixed: bool) -> Scheduler {
    sched_full(block_size, num_blocks, max_num_seqs, budget, mixed, None)
}

/// Steps that take turns, at most `threshold` prompt tokens of one sequence each.
fn sched_threshold(
    block_size: usize,
    num_blocks: usize,
    max_num_seqs: usize,
    budget: usize,
    threshold: Option<usize>,
) -> Scheduler {
    sched_full(block_size, num_blocks, max_num_seqs, budget, false, threshold)
}

fn sched_full(
    block_size: usize,
    num_blocks: usize,
    max_num_seqs: usize,
    budget: usize,
    mixed: bool,
    threshold: Option<usize>,
) -> Scheduler {
    let cfg = SchedulerConfig {
        spec_shaped: false,
        long_prefill_token_threshold: threshold,
        max_model_len: 4096,
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_extra_logit_rows: 512,
        prefix_caching: false,
        mixed_steps: mixed,
        mtp_drafts: 0,
        spec_disable_batch: None,
        spec_sampled: false,
        fork_blocks: false,
    };
    Scheduler::new(cfg, CacheLayout { block_size, num_blocks })
}

fn req(prompt_len: usize, n: usize, max_tokens: usize) -> GenerateRequest {
    let prompt = (0..prompt_len as u32).map(|i| i % 50 + 2).collect();
    GenerateRequest { n, ..GenerateRequest::new(prompt, SamplingParams::greedy(), max_tokens) }
}

/// Token "sampled" at the end of a chunk: a function of the position, never 0 or 1.
fn token_at(end_pos: usize) -> u32 {
    (end_pos % 40 + 3) as u32
}

fn step(s: &mut Scheduler) -> (StepPlan, Applied) {
    let plan = s.schedule().expect("the scheduler has work");
    assert!(plan.validate(s.block_manager().block_size(), s.block_manager().num_blocks(), 1000, 4096).is_ok());
    let seqs = plan
        .seqs
        .iter()
        .map(|q| SeqResult {
            scores: vec![],
            seq_id: q.seq_id,
            logits: vec![],
            sampled: q.sample.as_ref().map(|_| SampledToken {
                token: token_at(q.end_pos()),
                logprob: 0.0,
                top_logprobs: vec![],
            }),
            extra_tokens: vec![],
            drafts: vec![],
        })
        .collect();
    let applied = s.apply(&plan, &StepOutput { seqs });
    (plan, applied)
}

fn run_to_end(s: &mut Scheduler) -> Vec<(StepPlan, Applied)> {
    let mut log = vec![];
    while s.has_work() {
        log.push(step(s));
        assert!(log.len() < 10_000, "no progress");
    }
    assert_eq!(s.block_manager().used_blocks(), 0, "blocks leaked");
    log
}

#[test]
fn long_prompt_is_prefilled_in_chunks_under_the_budget() {
    let mut s = sched(4, 64, 8, 8);
    s.add(1, req(20, 1, 2), 0);
    let chunks: Vec<(usize, usize, bool)> = (0..3)
        .map(|_| {
            let (p, _) = step(&mut s);
            assert_eq!(p.kind, StepKind::Prefill);
            assert_eq!(p.seqs.len(), 1);
            assert_eq!(p.seqs[0].block_table.len(), 5, "admission reserves the whole prompt");
            (p.seqs[0].context_len, p.seqs[0].tokens.len(), p.seqs[0].sample.is_some())
        })
        .collect();
    assert_eq!(chunks, vec![(0, 8, false), (8, 8, false), (16, 4, true)]);
    let (p, _) = step(&mut s);
    assert_eq!(p.kind, StepKind::Decode);
    assert_eq!((p.seqs[0].context_len, p.seqs[0].tokens.clone()), (20, vec![token_at(20)]));
}

#[test]
fn a_long_prompt_under_the_threshold_leaves_room_for_the_prompts_behind_it() {
    // A 64-token prompt is resident when a 5-token one arrives; budget 16. Without a threshold
    // the long prompt takes every step's budget until it is done (4 steps) and the short one
    // waits; with a threshold of 8 the short one is prefilled in the next step beside it.
    for (threshold, short_first_token_at) in [(None, 5), (Some(8), 2)] {
        let mut s = sched_threshold(4, 256, 8, 16, threshold);
        s.add(1, req(64, 1, 1), 0);
        let (first, _) = step(&mut s);
        assert_eq!(first.num_tokens(), threshold.unwrap_or(16));
        s.add(2, req(5, 1, 1), 0);
        let mut at = None;
        for i in 2..40 {
            let (p, a) = step(&mut s);
            if let Some(t) = threshold {
                assert!(p.seqs.iter().all(|q| q.tokens.len() <= t), "a chunk over the threshold");
            }
            if a.tokens.iter().any(|t| t.request == 2) {
                at = Some(i);
                break;
            }
        }
        assert_eq!(at, Some(short_first_token_at), "threshold {threshold:?}");
        run_to_end(&mut s);
    }
}

#[test]
fn decodes_are_not_starved_while_a_long_prompt_prefills() {
    let mut s = sched(4, 256, 8, 8);
    s.add(1, req(3, 1, 1000), 0);
    step(&mut s); // request 1's prompt
    s.add(2, req(40, 1, 5), 0);
    let mut kinds = vec![];
    let mut decodes_of_1 = 0;
    let mut prefill_of_2_done = false;
    while !prefill_of_2_done {
        let (p, a) = step(&mut s);
        kinds.push(p.kind);
        if p.kind == StepKind::Decode {
            assert!(p.seqs.iter().any(|q| q.seq_id >> 16 == 1), "request 1 left out of a decode step");
            decodes_of_1 += 1;
        } else {
            assert!(p.num_tokens() <= 8);
        }
        prefill_of_2_done = a.tokens.iter().any(|t| t.request == 2);
    }
    assert!(kinds.windows(2).all(|w| w != [StepKind::Prefill, StepKind::Prefill]), "{kinds:?}");
    assert_eq!(kinds.iter().filter(|&&k| k == StepKind::Prefill).count(), 5, "40 tokens in chunks of 8");
    assert!(decodes_of_1 >= 4, "{kinds:?}");
}

#[test]
fn mixed_steps_decode_in_every_step_while_a_long_prompt_prefills() {
    let mut s = sched_with(4, 256, 8, 8, true);
    s.add(1, req(3, 1, 1000), 0);
    step(&mut s); // request 1's prompt
    s.add(2, req(40, 1, 5), 0);
    let mut chunks = vec![];
    loop {
        let (p, a) = step(&mut s);
        assert!(p.num_tokens() <= 8, "over the budget: {p:?}");
        let (prompt, decode) = p.split();
        assert_eq!(p.kind, StepKind::Mixed { prefill: 1 }, "{p:?}");
        assert!(prompt.iter().all(|q| q.seq_id >> 16 == 2), "{p:?}");
        assert_eq!(decode.len(), 1);
        assert_eq!((decode[0].seq_id >> 16, decode[0].tokens.len()), (1, 1), "request 1 decodes in every step");
        chunks.push(prompt[0].tokens.len());
        if a.tokens.iter().any(|t| t.request == 2) {
            break;
        }
    }
    // The decode row takes one token of the budget: 40 prompt tokens in chunks of 7.
    assert_eq!(chunks, [7, 7, 7, 7, 7, 5]);
    // Then both decode together.
    let (p, _) = step(&mut s);
    assert_eq!((p.kind, p.seqs.len()), (StepKind::Decode, 2));
}

#[test]
fn mixed_steps_give_every_request_the_same_tokens_through_preemption() {
    // A cache too small for the four requests at once: the newest are preempted and recomputed.
    let run = |mixed: bool| {
        let mut s = sched_with(4, 24, 8, 16, mixed);
        for id in 1..=4u64 {
            s.add(id, req(10 + 7 * id as usize, 1, 20), 0);
        }
        let log = run_to_end(&mut s);
        let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
        for (_, a) in &log {
            for t in &a.tokens {
                tokens.entry(t.request).or_default().push(t.token.token);
            }
        }
        let mixed_steps = log.iter().filter(|(p, _)| matches!(p.kind, StepKind::Mixed { .. })).count();
        (tokens, s.preemptions(), mixed_steps, log.len())
    };
    let (alternating, pre_a, mixed_a, steps_a) = run(false);
    let (mixed, pre_m, mixed_m, steps_m) = run(true);
    assert!(pre_a > 0 && pre_m > 0, "the cache must force preemption ({pre_a}, {pre_m})");
    assert_eq!(mixed_a, 0);
    assert!(mixed_m > 0, "no mixed step was built");
    assert!(steps_m < steps_a, "mixing should take fewer steps ({steps_m} against {steps_a})");
    assert_eq!(alternating.len(), 4);
    assert!(alternating.values().all(|t| t.len() == 20));
    assert_eq!(mixed, alternating);
}

#[test]
fn running_sequences_never_exceed_max_num_seqs() {
    let mut s = sched(4, 256, 2, 64);
    for id in 1..=5 {
        s.add(id, req(2 + id as usize, 1, 3), 0);
    }
    let mut finished = vec![];
    while s.has_work() {
        let (p, a) = step(&mut s);
        assert!(s.num_running() <= 2 && p.seqs.len() <= 2, "{} running", s.num_running());
        finished.extend(a.finished_requests);
    }
    assert_eq!(finished, vec![1, 2, 3, 4, 5], "first come, first served");
}

#[test]
fn n_completions_share_the_prompts_full_blocks() {
    let mut s = sched(4, 64, 8, 64);
    s.add(7, req(10, 3, 4), 0);
    let (p, _) = step(&mut s);
    assert_eq!(p.seqs.len(), 1, "the shared prefix is prefilled once");
    let prefix = &p.seqs[0];
    assert_eq!((prefix.context_len, prefix.tokens.len(), prefix.block_table.len()), (0, 8, 2));
    assert!(prefix.sample.is_none());
    let shared = prefix.block_table.clone();
    let (p, _) = step(&mut s);
    assert_eq!(p.kind, StepKind::Prefill);
    assert_eq!(p.seqs.len(), 3);
    let prompt = req(10, 1, 1).prompt_tokens;
    for q in &p.seqs {
        assert_eq!((q.context_len, &q.tokens[..]), (8, &prompt[8..10]), "each completion recomputes the partial block");
        assert_eq!(&q.block_table[..2], &shared[..]);
        assert!(q.sample.is_some());
    }
    let tails: Vec<u32> = p.seqs.iter().map(|q| q.block_table[2]).collect();
    assert!(tails[0] != tails[1] && tails[1] != tails[2] && tails[0] != tails[2]);
    let m = s.block_manager();
    assert_eq!(m.used_blocks(), 5, "2 shared + 3 private");
    assert!(shared.iter().all(|&b| m.ref_count(b) == 3));
    let seeds: Vec<u64> = p.seqs.iter().map(|q| q.sample.as_ref().unwrap().seed).collect();
    assert!(seeds[0] != seeds[1] && seeds[1] != seeds[2], "completions draw differently");
    run_to_end(&mut s);
}

#[test]
fn the_newest_sequence_is_preempted_and_recomputed_when_blocks_run_out() {
    let mut s = sched(4, 6, 8, 64);
    s.add(1, req(4, 1, 16), 0);
    s.add(2, req(4, 1, 16), 0);
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut saw_recompute = false;
    while s.has_work() {
        let before = s.preemptions();
        let used_before = s.block_manager().used_blocks();
        let (p, a) = step(&mut s);
        if s.preemptions() > before {
            assert_eq!(p.kind, StepKind::Decode);
            assert!(p.seqs.iter().all(|q| q.seq_id >> 16 == 1), "request 1 is older and keeps running");
            assert!(s.block_manager().used_blocks() < used_before, "the victim's blocks were freed");
        }
        for q in &p.seqs {
            let id = q.seq_id >> 16;
            if p.kind == StepKind::Prefill && q.context_len == 0 && outputs.contains_key(&id) {
                // Recompute: the prompt and every output so far, then the next sample.
                let mut expect = req(4, 1, 1).prompt_tokens;
                expect.extend(&outputs[&id]);
                assert_eq!(q.tokens, expect);
                assert!(q.sample.is_some());
                saw_recompute = true;
            }
        }
        for t in a.tokens {
            outputs.entry(t.request).or_default().push(t.token.token);
        }
        assert!(s.block_manager().used_blocks() <= 6);
    }
    assert!(s.preemptions() >= 1 && saw_recompute);
    // Outputs follow positions alone, so a correct recompute reproduces the unpreempted run.
    let expect: Vec<u32> = (4..20).map(token_at).collect();
    assert_eq!(outputs[&1], expect);
    assert_eq!(outputs[&2], expect);
    assert_eq!(s.block_manager().used_blocks(), 0);
}

#[test]
fn admission_waits_for_free_blocks() {
    let mut s = sched(4, 4, 8, 64);
    s.add(1, req(12, 1, 2), 0); // 3 blocks, a 4th when it decodes
    s.add(2, req(8, 1, 2), 0); // 2 blocks
    let (p, _) = step(&mut s);
    assert_eq!(p.seqs.len(), 1);
    assert_eq!((s.num_running(), s.num_waiting()), (1, 1));
    let log = run_to_end(&mut s);
    let first_of_2 = log.iter().position(|(p, _)| p.seqs.iter().any(|q| q.seq_id >> 16 == 2)).unwrap();
    let last_of_1 = log.iter().rposition(|(p, _)| p.seqs.iter().any(|q| q.seq_id >> 16 == 1)).unwrap();
    assert!(first_of_2 > last_of_1, "request 2 admitted only after request 1 freed its blocks");
    assert_eq!(s.preemptions(), 0);
}

#[test]
fn finishing_rules_and_removal_free_blocks() {
    let cfg = SchedulerConfig {
        spec_shaped: false,
        long_prefill_token_threshold: None,
        max_model_len: 12,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_extra_logit_rows: 512,
        prefix_caching: false,
        mixed_steps: false,
        mtp_drafts: 0,
        spec_disable_batch: None,
        spec_sampled: false,
        fork_blocks: false,
    };
    let mut s = Scheduler::new(cfg, CacheLayout { block_size: 4, num_blocks: 32 });
    let mut stop = req(5, 1, 100);
    stop.stop_token_ids = vec![token_at(7)];
    s.add(1, stop, 0); // samples token_at(5), token_at(6), then the stop token
    s.add(2, req(5, 1, 100), 0); // runs into the context limit of 12
    s.add(3, req(5, 1, 2), 0); // max_tokens
    s.add(4, req(5, 2, 100), 0); // removed while running
    let mut finishes = HashMap::new();
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for _ in 0..4 {
        for t in step(&mut s).1.tokens {
            *counts.entry(t.request).or_default() += 1;
            if let Some(r) = t.finish {
                finishes.insert(t.request, r);
            }
        }
    }
    assert!(s.block_manager().used_blocks() > 0);
    assert_eq!(s.remove_request(4), Some(vec![0, 1]));
    assert_eq!(s.remove_request(4), None);
    run_to_end(&mut s).into_iter().flat_map(|(_, a)| a.tokens).for_each(|t| {
        *counts.entry(t.request).or_default() += 1;
        if let Some(r) = t.finish {
            finishes.insert(t.request, r);
        }
    });
    assert_eq!(finishes[&1], FinishReason::Stop);
    assert_eq!(counts[&1], 3, "the stop token is reported");
    assert_eq!((finishes[&2], counts[&2]), (FinishReason::Length, 7));
    assert_eq!((finishes[&3], counts[&3]), (FinishReason::Length, 2));
}

#[test]
fn finishing_one_completion_frees_its_blocks_and_keeps_the_others() {
    let mut s = sched(4, 64, 8, 64);
    s.add(7, req(10, 2, 6), 0);
    let (prefix_step, _) = step(&mut s);
    let shared = prefix_step.seqs[0].block_table.clone();
    let (_, tails) = step(&mut s);
    assert_eq!(s.block_manager().used_blocks(), 4, "2 shared + 1 private each");
    assert_eq!(s.finish_completion(7, 0, FinishReason::Stop), Some(EarlyFinish::Completion));
    assert_eq!(s.block_manager().used_blocks(), 3, "its private block is free at once");
    assert!(shared.iter().all(|&b| s.block_manager().ref_count(b) == 1), "the survivor still holds the prefix");
    assert_eq!(s.finish_completion(7, 0, FinishReason::Length), None, "already finished");
    assert_eq!(s.finish_completion(7, 2, FinishReason::Stop), None, "no such completion");
    assert_eq!(s.finish_completion(8, 0, FinishReason::Stop), None, "no such request");
    let log = run_to_end(&mut s);
    assert!(log.iter().all(|(p, _)| p.seqs.iter().all(|q| q.seq_id != (7 << 16 | 1))), "completion 0 ran again");
    let survivor: Vec<u32> = tails
        .tokens
        .iter()
        .chain(log.iter().flat_map(|(_, a)| &a.tokens))
        .filter(|t| t.index == 1)
        .map(|t| t.token.token)
        .collect();
    // Outputs follow positions alone: the survivor samples at ends 10..16 as if alone.
    assert_eq!(survivor, (10..16).map(token_at).collect::<Vec<_>>());
    assert_eq!(log.last().unwrap().1.finished_requests, vec![7]);
}

#[test]
fn finishing_a_preempted_completion_drops_it_from_the_resume_queue() {
    // Three sequences growing to 5 blocks each in a 7-block cache: the newest, completion 1 of
    // request 2, is preempted first.
    let mut s = sched(4, 7, 8, 64);
    s.add(1, req(4, 1, 16), 0);
    s.add(2, req(4, 2, 16), 0);
    let mut outputs: HashMap<(u64, usize), Vec<u32>> = HashMap::new();
    let mut record = |a: &Applied| {
        a.tokens.iter().for_each(|t| outputs.entry((t.request, t.index)).or_default().push(t.token.token))
    };
    while s.preemptions() == 0 {
        record(&step(&mut s).1);
    }
    assert!(s.num_waiting() >= 1);
    assert_eq!(s.finish_completion(2, 1, FinishReason::Stop), Some(EarlyFinish::Completion));
    assert_eq!(s.finish_completion(2, 1, FinishReason::Stop), None);
    let log = run_to_end(&mut s);
    log.iter().for_each(|(_, a)| record(a));
    assert!(
        log.iter().all(|(p, _)| p.seqs.iter().all(|q| q.seq_id != (2 << 16 | 2))),
        "the finished completion came back"
    );
    let expect: Vec<u32> = (4..20).map(token_at).collect();
    assert_eq!(outputs[&(1, 0)], expect);
    assert_eq!(outputs[&(2, 0)], expect, "its sibling ran to the end, recomputed if preempted too");
    assert!(outputs[&(2, 1)].len() < 16);
}

fn owned(prompt_len: usize, n: usize, max_tokens: usize, owner: u64) -> GenerateRequest {
    GenerateRequest { owner: Some(owner), ..req(prompt_len, n, max_tokens) }
}

/// Steps until request `id` has produced its first token; returns how many steps that took.
fn steps_until_first_token(s: &mut Scheduler, id: u64) -> usize {
    for k in 1..1000 {
        let (_, a) = step(s);
        if a.tokens.iter().any(|t| t.request == id) {
            return k;
        }
    }
    panic!("request {id} never produced a token");
}

#[test]
fn a_single_prompt_is_admitted_before_the_rest_of_a_many_prompt_request() {
    // Three prompts of one HTTP request (one owner) arrive before a lone request; two slots.
    let mut s = sched(4, 256, 2, 64);
    for id in 1..=3 {
        s.add(id, owned(5, 1, 50, 7), 0);
    }
    s.add(4, req(5, 1, 3), 0);
    let (first, _) = step(&mut s);
    let admitted: Vec<u64> = first.seqs.iter().map(|q| q.seq_id >> 16).collect();
    // Request 1 takes a slot; the other slot goes to the owner holding none, not to prompt 2.
    assert_eq!(admitted, vec![1, 4]);
    run_to_end(&mut s);
}

#[test]
fn an_owner_above_its_fair_share_makes_room_for_a_newcomer() {
    // One request with n = 4 holds every slot and decodes for long.
    let mut s = sched(4, 256, 4, 64);
    s.add(1, req(5, 4, 200), 0);
    for _ in 0..4 {
        step(&mut s);
    }
    assert_eq!(s.num_running(), 4);
    // A newcomer's fair share is 4 / 2 owners = 2: request 1 gives up one completion for it.
    s.add(2, req(5, 1, 3), 0);
    let waited = steps_until_first_token(&mut s, 2);
    assert!(waited <= 2, "the newcomer waited {waited} steps");
    assert_eq!(s.preemptions(), 1, "one completion makes room, no more");
    assert_eq!(s.num_running(), 4);
    // Every completion of request 1 still runs to its length, the preempted one after recompute.
    let log = run_to_end(&mut s);
    let ends = log.iter().flat_map(|(_, a)| a.tokens.iter()).filter(|t| t.request == 1 && t.finish.is_some());
    assert_eq!(ends.filter(|t| t.finish == Some(FinishReason::Length)).count(), 4);
}

#[test]
fn a_completion_preempted_for_fairness_leaves_the_mixed_step_it_was_decoding_in() {
    // As above, with mixed steps: the completion that makes room had its decode row in the
    // step being built when the newcomer was admitted; the row must go with it (a row whose
    // blocks are freed would be applied to a recomputing sequence: the engine panicked here).
    let mut s = sched_with(4, 256, 4, 64, true);
    s.add(1, req(5, 4, 200), 0);
    for _ in 0..4 {
        step(&mut s);
    }
    s.add(2, req(5, 1, 3), 0);
    let (p, _) = step(&mut s);
    assert_eq!(s.preemptions(), 1);
    assert_eq!(p.kind, StepKind::Mixed { prefill: 1 }, "{p:?}");
    assert_eq!(p.split().1.len(), 3, "the preempted completion's row left the step");
    let log = run_to_end(&mut s);
    let ends = log.iter().flat_map(|(_, a)| a.tokens.iter()).filter(|t| t.request == 1 && t.finish.is_some());
    assert_eq!(ends.filter(|t| t.finish == Some(FinishReason::Length)).count(), 4);
}

#[test]
fn fair_shares_do_not_preempt_within_the_share_or_ping_pong() {
    // Two owners with n = 2 each fill 4 slots exactly: a third owner's n = 3 is above its share
    // (4 / 3 = 1) and waits instead of evicting anyone.
    let mut s = sched(4, 256, 4, 64);
    s.add(1, req(5, 2, 30), 0);
    s.add(2, req(5, 2, 30), 0);
    step(&mut s);
    s.add(3, req(5, 3, 5), 0);
    for _ in 0..10 {
        step(&mut s);
    }
    assert_eq!(s.preemptions(), 0);
    let log = run_to_end(&mut s);
    assert!(log.len() < 200, "{} steps: admissions went back and forth", log.len());
}

/// Logits a stand-in model gives position `p` (64 ids): a function of the position alone, so
/// a recomputed position gets the row it had before.
fn logits_at(p: usize) -> Vec<f32> {
    (0..64).map(|v| ((p * 31 + v * 17) % 97) as f32 / 10.0).collect()
}

/// `step`, answering `LogitsRequest::Scored` with a score per scored fed position, as a
/// backend scores `logits_at` rows.
fn step_with_logits(s: &mut Scheduler) -> (StepPlan, Applied) {
    let plan = s.schedule().expect("the scheduler has work");
    let seqs = plan
        .seqs
        .iter()
        .map(|q| SeqResult {
            scores: match q.logits {
                LogitsRequest::Scored { top, after } => {
                    let rows: Vec<Vec<f32>> = (q.context_len..q.end_pos()).map(logits_at).collect();
                    mla_core::sampling::score_rows(&rows, &q.tokens, top, after)
                }
                _ => vec![],
            },
            seq_id: q.seq_id,
            logits: vec![],
            sampled: q.sample.as_ref().map(|_| SampledToken {
                token: token_at(q.end_pos()),
                logprob: 0.0,
                top_logprobs: vec![],
            }),
            extra_tokens: vec![],
            drafts: vec![],
        })
        .collect();
    let applied = s.apply(&plan, &StepOutput { seqs });
    (plan, applied)
}

#[test]
fn prompt_logprobs_are_complete_and_exact_when_preempted_mid_prefill() {
    let mut preempted_mid_prefill = false;
    // 8 blocks hold either request at its longest (30 and 26 tokens), not both.
    for num_blocks in 8..16 {
        let cfg = SchedulerConfig {
            spec_shaped: false,
            long_prefill_token_threshold: None,
            max_model_len: 4096,
            max_num_seqs: 8,
            max_num_batched_tokens: 4,
            max_extra_logit_rows: 512,
            prefix_caching: true,
            mixed_steps: false,
            mtp_drafts: 0,
            spec_disable_batch: None,
            spec_sampled: false,
            fork_blocks: false,
        };
        let mut s = Scheduler::new(cfg, CacheLayout { block_size: 4, num_blocks });
        s.add(1, req(4, 1, 26), 0);
        let scored = req(24, 1, 2);
        let prompt = scored.prompt_tokens.clone();
        s.add(2, GenerateRequest { prompt_logprobs: Some(2), ..scored }, 0);
        let (mut fed, mut got, mut first_token) = (false, None, false);
        while s.has_work() {
            let (p, a) = step_with_logits(&mut s);
            for q in p.seqs.iter().filter(|q| q.seq_id >> 16 == 2) {
                // A request-2 chunk from position 0 after an earlier one, before any token: it was
                // preempted during its prefill and is recomputed from scratch (not from the cache).
                preempted_mid_prefill |= q.context_len == 0 && fed && !first_token;
                fed = true;
            }
            for (id, entries) in a.prompt_logprobs {
                assert!(id == 2 && got.replace(entries).is_none(), "sent once, to request 2");
            }
            if a.tokens.iter().any(|t| t.request == 2) {
                assert!(got.is_some(), "prompt logprobs come before the first token");
                first_token = true;
            }
        }
        let got = got.expect("prompt logprobs delivered");
        assert_eq!(got.len(), prompt.len() - 1);
        for (p, e) in got.iter().enumerate() {
            let lp = mla_core::sampling::log_softmax(&logits_at(p));
            assert_eq!((e.token, e.logprob), (prompt[p + 1], lp[prompt[p + 1] as usize]), "blocks {num_blocks}");
            assert_eq!(e.top, mla_core::sampling::top_k_entries(&lp, 2));
        }
        assert_eq!(s.block_manager().used_blocks(), 0);
    }
    assert!(preempted_mid_prefill, "no cache size preempted the scored request during its prefill");
}

#[test]
fn prompt_logprob_chunks_share_the_steps_logit_rows() {
    // Four prompts of 300 tokens asking for prompt logprobs, a step budget of 1024 tokens and
    // room for 200 rows of logits beyond the sampled ones: one step may not return 4 x 256
    // rows (a backend sized for 200 would refuse it), so the chunks wait their turn.
    let cfg = SchedulerConfig {
        spec_shaped: false,
        long_prefill_token_threshold: None,
        max_model_len: 4096,
        max_num_seqs: 8,
        max_num_batched_tokens: 1024,
        max_extra_logit_rows: 200,
        prefix_caching: false,
        mixed_steps: false,
        mtp_drafts: 0,
        spec_disable_batch: None,
        spec_sampled: false,
        fork_blocks: false,
    };
    let mut s = Scheduler::new(cfg, CacheLayout { block_size: 16, num_blocks: 256 });
    for id in 0..4 {
        s.add(id, GenerateRequest { prompt_logprobs: Some(1), ..req(300, 1, 2) }, 0);
    }
    let (mut steps, mut most) = (0, 0);
    while let Some(plan) = s.schedule() {
        steps += 1;
        assert!(steps < 100, "no progress");
        let sampled = plan.seqs.iter().filter(|q| q.sample.is_some()).count();
        let extra = plan.logit_rows() - sampled;
        assert!(extra <= 200, "a step returns {extra} prompt rows of logits");
        most = most.max(extra);
        let seqs = plan
            .seqs
            .iter()
            .map(|q| SeqResult {
                scores: vec![mla_core::step::plan::RowScore::default(); q.logits.scored_rows(q.tokens.len())],
                seq_id: q.seq_id,
                logits: vec![],
                sampled: q.sample.as_ref().map(|_| SampledToken {
                    token: token_at(q.end_pos()),
                    logprob: 0.0,
                    top_logprobs: vec![],
                }),
                extra_tokens: vec![],
                drafts: vec![],
            })
            .collect();
        s.apply(&plan, &StepOutput { seqs });
    }
    assert_eq!(most, 200, "the steps use the rows they have");
    assert!(!s.has_work(), "every request finished");
}

#[test]
fn each_prompt_position_s_logits_are_asked_for_once_whatever_n() {
    // 4-token blocks, a 10-token prompt: the shared prefix feeds 0..8, then each of the n
    // completions feeds 8..10. Only one of them asks for those rows in its plan.
    for n in [1, 4, 8] {
        let cfg = SchedulerConfig {
            spec_shaped: false,
            long_prefill_token_threshold: None,
            max_model_len: 4096,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            max_extra_logit_rows: 512,
            prefix_caching: true,
            mixed_steps: false,
            mtp_drafts: 0,
            spec_disable_batch: None,
            spec_sampled: false,
            fork_blocks: false,
        };
        let mut s = Scheduler::new(cfg, CacheLayout { block_size: 4, num_blocks: 64 });
        let scored = req(10, n, 2);
        let prompt = scored.prompt_tokens.clone();
        s.add(1, GenerateRequest { prompt_logprobs: Some(1), ..scored }, 0);
        let (mut rows, mut got, mut tokens) = (vec![0usize; prompt.len()], None, 0);
        while s.has_work() {
            let (p, a) = step_with_logits(&mut s);
            for q in p.seqs.iter().filter(|q| matches!(q.logits, LogitsRequest::Scored { .. })) {
                (q.context_len..q.end_pos()).for_each(|pos| rows[pos] += 1);
            }
            if let Some((_, entries)) = a.prompt_logprobs.into_iter().next() {
                assert_eq!(tokens, 0, "n = {n}: prompt logprobs come before the first token");
                got = Some(entries);
            }
            tokens += a.tokens.len();
        }
        assert_eq!(rows, vec![1; prompt.len()], "n = {n}: each position's row once");
        let got = got.expect("prompt logprobs delivered");
        let want: Vec<u32> = prompt[1..].to_vec();
        assert_eq!(got.iter().map(|e| e.token).collect::<Vec<_>>(), want, "n = {n}");
        assert_eq!(tokens, n * 2, "n = {n}: every completion ran");
    }
}
