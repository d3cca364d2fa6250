//! Automatic prefix caching in the scheduler and block manager, checked against a stand-in KV
//! cache: every position a step writes records the token and position it holds, and every step
//! checks that each position its sequences attend to holds exactly that sequence's token. A
//! cached block reused for the wrong prompt, a block evicted while in use, a shared block
//! written to: each fails that check.

use mla_core::step::plan::{SampledToken, SeqResult, StepOutput};
use mla_core::{CacheLayout, SamplingParams, StepPlan};
use mla_engine::scheduler::{Scheduler, SchedulerConfig};
use mla_engine::{FinishReason, GenerateRequest};
use std::collections::HashMap;

const BS: usize = 4;

/// Steps mix decode rows and prompt chunks (the server's default); `sched_turns` alternates them.
fn sched(num_blocks: usize, max_num_seqs: usize, budget: usize) -> Scheduler {
    sched_with(num_blocks, max_num_seqs, budget, true)
}

fn sched_turns(num_blocks: usize, max_num_seqs: usize, budget: usize) -> Scheduler {
    sched_with(num_blocks, max_num_seqs, budget, false)
}

fn sched_with(num_blocks: usize, max_num_seqs: usize, budget: usize, mixed_steps: bool) -> Scheduler {
    let cfg = SchedulerConfig {
        spec_shaped: false,
        long_prefill_token_threshold: None,
        max_model_len: 4096,
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_extra_logit_rows: 512,
        prefix_caching: true,
        mixed_steps,
        mtp_drafts: 0,
        spec_disable_batch: None,
        spec_sampled: false,
        fork_blocks: false,
    };
    Scheduler::new(cfg, CacheLayout { block_size: BS, num_blocks })
}

fn req(prompt: Vec<u32>, n: usize, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { n, ..GenerateRequest::new(prompt, SamplingParams::greedy(), max_tokens) }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + salt) % 97 + 2).collect()
}

/// The stand-in device: the cache contents and each sequence's true tokens.
#[derive(Default)]
struct FakeKv {
    /// (block, offset) -> (token, position) written there.
    cells: HashMap<(u32, usize), (u32, usize)>,
    /// seq_id -> every token of that sequence so far (prompt, then outputs).
    truth: HashMap<u64, Vec<u32>>,
}

impl FakeKv {
    fn check_and_write(&mut self, s: &Scheduler, plan: &StepPlan, prompts: &HashMap<u64, Vec<u32>>) {
        for q in &plan.seqs {
            let request = q.seq_id >> 16;
            let truth = self.truth.entry(q.seq_id).or_insert_with(|| prompts[&request].clone());
            for (pos, &token) in truth.iter().enumerate().take(q.context_len) {
                let cell = (q.block_table[pos / BS], pos % BS);
                assert_eq!(
                    self.cells.get(&cell),
                    Some(&(token, pos)),
                    "seq {:#x} attends to position {pos} in block {} that does not hold its token",
                    q.seq_id,
                    cell.0
                );
            }
            assert_eq!(q.tokens[..], truth[q.context_len..q.end_pos()], "seq {:#x} feeds other tokens", q.seq_id);
            // The shared prefix of an n-way request writes blocks its own completions already
            // hold (they wait for it); any other writer must be a block's only holder.
            let is_prefix = q.seq_id & 0xFFFF == 0;
            for (k, &t) in q.tokens.iter().enumerate() {
                let pos = q.context_len + k;
                let block = q.block_table[pos / BS];
                let refs = s.block_manager().ref_count(block);
                assert!(refs == 1 || is_prefix, "seq {:#x} writes into block {block} shared {refs} ways", q.seq_id);
                self.cells.insert((block, pos % BS), (t, pos));
            }
        }
    }
}

/// Token sampled at the end of a chunk: depends on the sequence and position, so different
/// sequences grow different histories.
fn token_at(seq_id: u64, end_pos: usize) -> u32 {
    ((seq_id as usize * 31 + end_pos * 13) % 89 + 2) as u32
}

struct Harness {
    s: Scheduler,
    kv: FakeKv,
    prompts: HashMap<u64, Vec<u32>>,
    outputs: HashMap<(u64, usize), Vec<u32>>,
}

impl Harness {
    fn new(s: Scheduler) -> Self {
        Harness { s, kv: FakeKv::default(), prompts: HashMap::new(), outputs: HashMap::new() }
    }

    fn add(&mut self, id: u64, r: GenerateRequest) {
        self.prompts.insert(id, r.prompt_tokens.clone());
        self.s.add(id, r, 0);
    }

    fn step(&mut self) -> StepPlan {
        let plan = self.s.schedule().expect("work to do");
        let mut ids: Vec<u64> = plan.seqs.iter().map(|q| q.seq_id).collect();
        ids.sort_unstable();
        assert!(ids.windows(2).all(|w| w[0] != w[1]), "a sequence twice in one step: {:?}", plan.kind);
        self.kv.check_and_write(&self.s, &plan, &self.prompts);
        let seqs = plan
            .seqs
            .iter()
            .map(|q| SeqResult {
                scores: vec![],
                seq_id: q.seq_id,
                logits: vec![],
                sampled: q.sample.as_ref().map(|_| SampledToken {
                    token: token_at(q.seq_id, q.end_pos()),
                    logprob: 0.0,
                    top_logprobs: vec![],
                }),
                extra_tokens: vec![],
                drafts: vec![],
            })
            .collect();
        let applied = self.s.apply(&plan, &StepOutput { seqs });
        for t in applied.tokens {
            self.outputs.entry((t.request, t.index)).or_default().push(t.token.token);
            let seq_id = (t.request << 16) | (t.index as u64 + 1);
            let prompts = &self.prompts;
            self.kv.truth.entry(seq_id).or_insert_with(|| prompts[&t.request].clone()).push(t.token.token);
        }
        plan
    }

    fn run(&mut self) {
        let mut steps = 0;
        while self.s.has_work() {
            self.step();
            steps += 1;
            assert!(steps < 100_000, "no progress");
        }
    }

    /// Runs request `id` alone to its end; returns the prompt tokens it found cached.
    fn serve(&mut self, id: u64, r: GenerateRequest) -> usize {
        self.add(id, r);
        self.step();
        let (_, cached) = *self.s.take_admitted().iter().find(|(r, _)| *r == id).expect("admitted in its first step");
        self.run();
        cached
    }
}

#[test]
fn repeated_and_extended_prompts_reuse_their_full_blocks() {
    let mut h = Harness::new(sched(64, 8, 64));
    let p = prompt(22, 1);
    assert_eq!(h.serve(1, req(p.clone(), 1, 3)), 0, "cold cache");
    // The same prompt: every full block before the one holding the last token.
    assert_eq!(h.serve(2, req(p.clone(), 1, 3)), 20);
    assert_eq!(h.outputs[&(1, 0)].len(), h.outputs[&(2, 0)].len());
    // A prompt that is an exact block multiple still recomputes its last block.
    assert_eq!(h.serve(3, req(p[..16].to_vec(), 1, 2)), 12);
    // Shares one block, then two, then diverges.
    let mut q = p.clone();
    q[5] = 1;
    assert_eq!(h.serve(4, req(q, 1, 2)), 4);
    let mut q = p.clone();
    q[9] = 1;
    assert_eq!(h.serve(5, req(q, 1, 2)), 8);
    // A second chat turn: the first turn's prompt and reply, then more. The reply's full
    // blocks were registered as they were computed (all but the last sampled token).
    let mut turn2 = p.clone();
    turn2.extend(&h.outputs[&(1, 0)]);
    turn2.extend(prompt(9, 3));
    let computed = p.len() + h.outputs[&(1, 0)].len() - 1;
    assert_eq!(h.serve(6, req(turn2, 1, 2)), computed / BS * BS);
    let stats = h.s.prefix_cache_stats();
    assert_eq!(stats.hits, (20 + 12 + 4 + 8 + computed / BS * BS) as u64);
    assert_eq!(h.s.block_manager().used_blocks(), 0);
    assert_eq!(h.s.block_manager().free_blocks(), 64, "cached blocks count as free");
}

#[test]
fn n_way_requests_share_cached_blocks_without_a_prefix_pass() {
    let mut h = Harness::new(sched(64, 8, 64));
    let p = prompt(18, 2);
    h.serve(1, req(p.clone(), 1, 2));
    h.add(2, req(p.clone(), 3, 4));
    let first = h.step();
    // All 16 shared tokens come from the cache: the three completions prefill their own last
    // block straight away, no prefix sequence.
    assert_eq!(first.seqs.len(), 3);
    assert!(first.seqs.iter().all(|q| q.context_len == 16 && q.seq_id & 0xFFFF != 0));
    assert_eq!(h.s.take_admitted(), vec![(2, 16)]);
    h.run();
    // A prompt whose shared part is half cached: a prefix pass computes the rest once.
    let mut q = p.clone();
    q[10] = 1;
    h.add(3, req(q, 2, 2));
    let first = h.step();
    assert_eq!(first.seqs.len(), 1);
    assert_eq!((first.seqs[0].seq_id & 0xFFFF, first.seqs[0].context_len), (0, 8));
    h.run();
    assert_eq!(h.s.block_manager().used_blocks(), 0);
}

#[test]
fn eviction_takes_free_blocks_first_then_the_least_recently_released() {
    // 12 blocks. A and B leave 5 cached blocks each (20-token prompts plus outputs).
    let mut h = Harness::new(sched(12, 8, 64));
    let (a, b) = (prompt(20, 4), prompt(20, 5));
    h.serve(1, req(a.clone(), 1, 1));
    h.serve(2, req(b.clone(), 1, 1));
    assert_eq!(h.s.block_manager().cached_blocks(), 10);
    // C needs 5 blocks: 2 free ones, then 3 of A's (released first), tail first.
    h.serve(3, req(prompt(20, 6), 1, 1));
    // A finds its first two blocks; the three it computes again evict the oldest evictable
    // ones, B's last three.
    assert_eq!(h.serve(4, req(a.clone(), 1, 1)), 8, "A lost its last blocks, kept its first two");
    assert_eq!(h.serve(5, req(b.clone(), 1, 1)), 8, "B kept its first two");
}

#[test]
fn blocks_in_use_are_never_evicted_and_a_full_cache_still_admits() {
    let mut h = Harness::new(sched(8, 8, 64));
    let a = prompt(28, 7);
    // A runs long and holds its 8 blocks' worth: its prompt's 7 blocks plus one for outputs.
    h.add(1, req(a.clone(), 1, 4));
    h.step();
    // B cannot fit while A holds everything: it waits rather than taking A's blocks.
    h.add(2, req(prompt(8, 8), 1, 2));
    for _ in 0..3 {
        h.step();
    }
    assert!(h.s.contains(2) && h.s.num_waiting() == 1, "B waits for A");
    h.run();
    // Now every block is cached and unreferenced; an unrelated 30-token prompt takes them all.
    assert_eq!(h.s.block_manager().cached_blocks(), 7);
    assert_eq!(h.serve(3, req(prompt(30, 9), 1, 2)), 0);
    assert_eq!(h.s.block_manager().used_blocks(), 0);
}

/// 1000 requests drawn from a few shared prefixes, random lengths and n, aborts and early
/// finishes mid-flight, a cache small enough to preempt: every step passes the stand-in's
/// checks, and at the end every block is free or cached and unreferenced.
#[test]
fn a_thousand_random_requests_with_aborts_leak_nothing() {
    // Mixed steps once stopped here: a resumed completion admitted with all but its last token
    // cached has nothing to prefill, and the step held nothing else.
    for seed in 11..15 {
        random_requests_with_aborts(sched(20, 8, 24), seed);
    }
    random_requests_with_aborts(sched_turns(20, 8, 24), 11);
}

fn random_requests_with_aborts(s: Scheduler, seed: u64) {
    let mut rng = mla_core::SplitMix64::new(seed);
    let mut below = |n: u64| (rng.next_u64() % n) as usize;
    let mut h = Harness::new(s);
    let heads: Vec<Vec<u32>> = (0..4).map(|i| prompt(4 + 9 * i, 20 + i as u32)).collect();
    let (mut next, mut hits) = (1u64, 0);
    while next <= 1000 || h.s.has_work() {
        if next <= 1000 && h.s.num_waiting() < 8 {
            let mut p = heads[below(4)].clone();
            p.extend(prompt(1 + below(14), next as u32));
            h.add(next, req(p, 1 + below(3) * below(2), 1 + below(12)));
            next += 1;
        }
        if h.s.has_work() {
            h.step();
        }
        hits += h.s.take_admitted().iter().filter(|(_, c)| *c > 0).count();
        match below(20) {
            0 if next > 1 => {
                h.s.remove_request(below(next - 1) as u64 + 1);
            }
            1 if next > 1 => {
                h.s.finish_completion(below(next - 1) as u64 + 1, 0, FinishReason::Stop);
            }
            _ => {}
        }
    }
    let m = h.s.block_manager();
    assert_eq!(m.used_blocks(), 0, "blocks leaked");
    assert_eq!(m.free_blocks(), 20);
    assert!(hits > 300, "the shared prefixes should hit often: {hits} hits");
    assert!(h.s.preemptions() > 0, "the cache should have been tight enough to preempt");
}
