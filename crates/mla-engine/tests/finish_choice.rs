//! Ending one completion of a request from outside (`RequestStream::finish_choice`, used for
//! stop strings): its blocks come back before the next step, the others run on unchanged
//! (checked against the cache-free reference), and the statistics count the given reason.

use crate::common;

use common::*;
use mla_core::{CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineEvent, FinishReason};
use std::sync::Arc;
use std::time::Duration;

const MAX_LEN: usize = 64;
const NUM_BLOCKS: usize = 64;

fn seq_id(request: u64, completion: u64) -> u64 {
    request << 16 | (completion + 1)
}

#[test]
fn finishing_one_choice_frees_it_within_a_step_and_leaves_the_other_untouched() {
    let gate = Arc::new(StepGate::default());
    let mut b = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: NUM_BLOCKS }, MAX_LEN);
    b.gate = Some(gate.clone());
    let log = b.log.clone();
    let engine = Engine::start(Box::new(b), engine_config(MAX_LEN)).unwrap();
    // 10 prompt tokens in blocks of 4: two shared blocks, then a private tail per completion.
    let prompt: Vec<u32> = (0..10).map(|i| i * 5 % 60 + 1).collect();
    let params = SamplingParams { temperature: 1.0, ..Default::default() };
    let mut req = request(prompt.clone(), params.clone(), Some(7), 30);
    req.n = 2;
    let mut stream = engine.submit(req).unwrap();
    let (c0, c1) = (seq_id(stream.id, 0), seq_id(stream.id, 1));

    // Run four steps (shared prefix, both tails, two decodes) and park at the start of the fifth,
    // which was scheduled with both completions before anyone asked to finish one.
    gate.allow(4);
    gate.wait_parked_at(5);
    let mut early: Vec<Vec<u32>> = vec![vec![]; 2];
    while let Ok(ev) = stream.events.try_recv() {
        if matches!(ev, EngineEvent::Admitted { .. }) {
            continue;
        }
        let EngineEvent::Token { index, token, finish: None, .. } = ev else { panic!("{ev:?}") };
        early[index].push(token);
    }
    assert_eq!(early.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3], "steps 2, 3 and 4 each sampled both");
    let used_by_both = {
        let log = log.lock().unwrap();
        let (t0, t1) = (&log.tables[&c0], &log.tables[&c1]);
        t0.iter().chain(t1).collect::<std::collections::HashSet<_>>().len()
    };
    assert_eq!(used_by_both, (engine.stats().kv_usage * NUM_BLOCKS as f64).round() as usize);

    stream.finish_choice(0, FinishReason::Stop);
    // Finishing what has already finished does nothing: no second event, no second count.
    stream.finish_choice(0, FinishReason::Length);
    gate.allow(1); // step 5 runs; the finish is handled before step 6 is built
    gate.wait_parked_at(6);
    gate.allow(1); // step 6 runs and its statistics are published
    gate.wait_parked_at(7);
    {
        let log = log.lock().unwrap();
        assert!(log.seqs[4].contains(&c0), "step 5 was built before the finish");
        assert!(!log.seqs[5].contains(&c0), "the finished completion is not fed again");
        assert!(log.seqs[5].contains(&c1), "the other completion keeps decoding");
        let used = (engine.stats().kv_usage * NUM_BLOCKS as f64).round() as usize;
        assert_eq!(used, log.tables[&c1].len(), "only the survivor's blocks (shared ones included) are held");
        let (t0, t1) = (&log.tables[&c0], &log.tables[&c1]);
        assert!(t0.iter().any(|b| !t1.contains(b)), "choice 0 had private blocks, now free");
    }
    let s = engine.stats();
    assert_eq!((s.finished_stop, s.finished_length, s.finished_abort), (1, 0, 0));
    assert_eq!(s.running, 1);

    // A request allocating right after the finish must not get any block the survivor still
    // reads (a wrongly freed shared block would be handed out first and overwritten).
    let other: Vec<u32> = (0..20).map(|i| i * 11 % 60 + 2).collect();
    let mut other_stream = engine.submit(request(other.clone(), SamplingParams::greedy(), None, 8)).unwrap();
    gate.open();

    let mut c = collect(&mut stream, 2);
    assert_eq!(c.error, None);
    for (i, e) in early.into_iter().enumerate() {
        c.tokens[i].splice(0..0, e);
    }
    assert_eq!(c.finish, vec![Some(FinishReason::Stop), Some(FinishReason::Length)]);
    let full0 = reference(&prompt, 0, &params, 7, 30, &[], MAX_LEN);
    let got0 = c.tokens[0].len();
    assert_eq!(got0, 4, "three tokens before the finish, one from the step already built");
    assert_eq!(c.tokens[0], full0[..got0]);
    assert_eq!(c.tokens[1], reference(&prompt, 1, &params, 7, 30, &[], MAX_LEN), "as if choice 0 had run on");
    assert_eq!(
        collect(&mut other_stream, 1).tokens[0],
        reference(&other, 0, &SamplingParams::greedy(), 0, 8, &[], MAX_LEN)
    );
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0 && engine.stats().running == 0);
    let s = engine.stats();
    assert_eq!((s.finished_stop, s.finished_length, s.finished_abort), (1, 2, 0));
    assert_eq!(s.e2e_latency.count, 2);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn a_choice_finished_while_waiting_is_never_admitted_and_its_sibling_needs_no_room_for_it() {
    let mut b = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: NUM_BLOCKS }, MAX_LEN);
    b.delay = Duration::from_millis(1);
    let log = b.log.clone();
    let mut cfg = engine_config(MAX_LEN);
    cfg.max_num_seqs = 2;
    let engine = Engine::start(Box::new(b), cfg).unwrap();
    let ps = prompts(2);
    let greedy = SamplingParams::greedy();
    let mut running = engine.submit(request(ps[0].clone(), greedy.clone(), None, 50)).unwrap();
    assert!(matches!(next_event(&mut running.events), Some(EngineEvent::Token { .. })));
    // Two completions do not fit next to the running one (max_num_seqs = 2) ...
    let params = SamplingParams { temperature: 1.0, ..Default::default() };
    let mut req = request(ps[1].clone(), params.clone(), Some(3), 10);
    req.n = 2;
    let mut waiting = engine.submit(req).unwrap();
    // ... but once one of them is finished, the other does.
    waiting.finish_choice(0, FinishReason::Stop);
    let c = collect(&mut waiting, 2);
    assert_eq!(c.finish, vec![Some(FinishReason::Stop), Some(FinishReason::Length)]);
    assert!(c.tokens[0].is_empty());
    assert_eq!(c.tokens[1], reference(&ps[1], 1, &params, 3, 10, &[], MAX_LEN));
    let r = collect(&mut running, 1);
    assert_eq!(r.finish[0], Some(FinishReason::Length), "the first request ran to the end");
    let log = log.lock().unwrap();
    let (gone, survivor, first) = (seq_id(waiting.id, 0), seq_id(waiting.id, 1), seq_id(running.id, 0));
    assert!(log.seqs.iter().all(|s| !s.contains(&gone)), "the finished completion never ran");
    assert!(
        log.seqs.iter().any(|s| s.contains(&survivor) && s.contains(&first)),
        "the survivor was admitted next to the running request"
    );
    drop(log);
    wait_until("idle", || engine.stats().kv_usage == 0.0 && engine.stats().waiting == 0);
    let s = engine.stats();
    assert_eq!((s.finished_stop, s.finished_length, s.finished_abort), (1, 2, 0));
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn abort_and_drop_after_a_finished_choice_count_only_the_rest() {
    let mut b = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: NUM_BLOCKS }, MAX_LEN);
    b.delay = Duration::from_millis(1);
    let engine = Engine::start(Box::new(b), engine_config(MAX_LEN)).unwrap();
    let mut req = request(prompts(1).remove(0), SamplingParams::greedy(), None, 50);
    req.n = 2;
    let mut s = engine.submit(req).unwrap();
    assert!(matches!(next_event(&mut s.events), Some(EngineEvent::Token { .. })));
    s.finish_choice(1, FinishReason::Stop);
    s.abort();
    let c = collect(&mut s, 2);
    assert_eq!(c.finish, vec![Some(FinishReason::Abort), Some(FinishReason::Stop)]);
    wait_until("counted", || engine.stats().finished_abort == 1);
    assert_eq!(engine.stats().finished_stop, 1);

    // Finishing the last live completion and dropping the stream at once (what the server does
    // when a stop string ends the last choice) counts a stop, not an abort.
    let s = engine.submit(request(prompts(2).remove(1), SamplingParams::greedy(), None, 50)).unwrap();
    s.finish_choice(0, FinishReason::Stop);
    drop(s);
    wait_until("counted", || engine.stats().finished_stop == 2);
    wait_until("idle", || engine.stats().kv_usage == 0.0 && engine.stats().running + engine.stats().waiting == 0);
    assert_eq!(engine.stats().finished_abort, 1);
    engine.shutdown(Duration::from_secs(1));
}
