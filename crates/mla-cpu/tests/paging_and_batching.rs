//! The paged cache and the batch layout must not change any result: block order, block size,
//! chunking and batching mates give the same logits, and the absorbed decode path agrees with
//! the normal path on the same cache contents. Runs on dummy weights of three small configs
//! (V2-Lite-like, V3-like, grouped V2 with tied embeddings).

use crate::common;

use common::*;
use mla_core::sampling::argmax;
use mla_core::step::plan::{LogitsRequest, SampleRequest, StepKind, StepPlan};
use mla_core::{Backend, SamplingParams};

const CONFIGS: [(&str, &str); 3] =
    [("v2-lite-like", V2_LITE_LIKE), ("v3-like", V3_LIKE), ("v2-grouped-tied", V2_GROUPED_TIED)];

/// Same-math comparisons (only the memory layout differs) must agree to f32 rounding.
const SAME_MATH: f32 = 1e-5;

#[test]
fn shuffled_block_table_matches_contiguous() {
    for (name, json) in CONFIGS {
        let (prompt, cont) = (tokens(23, 1, 64), tokens(6, 2, 64));
        let contiguous: Vec<u32> = (0..8).collect();
        let shuffled = [13, 2, 9, 0, 15, 6, 11, 4];
        let a = prefill_then_decode(&mut dummy_backend(json, 4, 16), &prompt, &cont, &contiguous);
        let b = prefill_then_decode(&mut dummy_backend(json, 4, 16), &prompt, &cont, &shuffled);
        let d = max_abs_diff(&a, &b);
        assert!(d <= SAME_MATH, "{name}: shuffled block table differs by {d}");
        assert!(max_abs(&a) > 0.1, "{name}: logits suspiciously small");
    }
}

#[test]
fn block_sizes_1_16_64_agree() {
    for (name, json) in CONFIGS {
        let (prompt, cont) = (tokens(70, 3, 64), tokens(5, 4, 64));
        let run = |bs: usize| {
            let blocks = 75usize.div_ceil(bs);
            // Reverse order so that non-trivial physical placement is exercised too.
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            prefill_then_decode(&mut dummy_backend(json, bs, blocks), &prompt, &cont, &table)
        };
        let (b1, b16, b64) = (run(1), run(16), run(64));
        let (d16, d64) = (max_abs_diff(&b1, &b16), max_abs_diff(&b1, &b64));
        assert!(d16 <= SAME_MATH && d64 <= SAME_MATH, "{name}: block size 1 vs 16: {d16}, vs 64: {d64}");
    }
}

#[test]
fn chunked_prefill_matches_one_piece() {
    for (name, json) in CONFIGS {
        let prompt = tokens(40, 5, 64);
        let table: Vec<u32> = (0..3).collect();
        let whole =
            step(&mut dummy_backend(json, 16, 3), StepKind::Prefill, vec![seq(1, &prompt, 0, &table)]).remove(0);
        let mut b = dummy_backend(json, 16, 3);
        let mut chunked = Vec::new();
        let mut start = 0;
        for len in [13, 1, 20, 6] {
            chunked.extend(
                step(&mut b, StepKind::Prefill, vec![seq(1, &prompt[start..start + len], start, &table)]).remove(0),
            );
            start += len;
        }
        let d = max_abs_diff(&whole, &chunked);
        assert!(d <= SAME_MATH, "{name}: chunked prefill differs by {d}");
    }
}

#[test]
fn absorbed_decode_agrees_with_normal_path_on_the_same_cache() {
    for (name, json) in CONFIGS {
        let (prompt, cont) = (tokens(30, 6, 64), tokens(8, 7, 64));
        let table: Vec<u32> = (0..4).collect();
        let mut absorbed = dummy_backend(json, 16, 4);
        let mut normal = dummy_backend(json, 16, 4);
        step(&mut absorbed, StepKind::Prefill, vec![seq(1, &prompt, 0, &table)]);
        step(&mut normal, StepKind::Prefill, vec![seq(1, &prompt, 0, &table)]);
        let mut worst = 0.0f32;
        for (j, &t) in cont.iter().enumerate() {
            let s = seq(1, &[t], prompt.len() + j, &table);
            let a = step(&mut absorbed, StepKind::Decode, vec![s.clone()]).remove(0);
            // A one-token prefill entry runs the normal (decompressed) path.
            let n = step(&mut normal, StepKind::Prefill, vec![s]).remove(0);
            worst = worst.max(max_abs_diff(&a, &n));
        }
        println!("{name}: absorbed vs normal worst logit difference {worst:.2e}");
        assert!(worst <= 1e-4, "{name}: absorbed and normal paths differ by {worst}");
    }
}

/// Builds each request's history alone, then the same final step batched together.
#[test]
fn mixed_batch_gives_each_request_its_solo_logits() {
    for (name, json) in CONFIGS {
        let p = [tokens(19, 8, 64), tokens(12, 9, 64), tokens(7, 10, 64)];
        // Request 0: a fresh 10-token prefill chunk; 1: a 5-token chunk after 7 cached tokens;
        // 2: a one-token entry after 6 cached tokens. Disjoint block tables in one cache.
        let tables: [Vec<u32>; 3] = [vec![0, 1], vec![5, 3], vec![4]];
        let history = [0usize, 7, 6];
        let fed = [10usize, 5, 1];
        let last_step = |i: usize| seq(i as u64, &p[i][history[i]..history[i] + fed[i]], history[i], &tables[i]);

        let mut solo = Vec::new();
        for i in 0..3 {
            let mut b = dummy_backend(json, 8, 6);
            if history[i] > 0 {
                step(&mut b, StepKind::Prefill, vec![seq(i as u64, &p[i][..history[i]], 0, &tables[i])]);
            }
            solo.push(step(&mut b, StepKind::Prefill, vec![last_step(i)]).remove(0));
        }
        let mut b = dummy_backend(json, 8, 6);
        step(&mut b, StepKind::Prefill, vec![seq(1, &p[1][..7], 0, &tables[1]), seq(2, &p[2][..6], 0, &tables[2])]);
        let batched = step(&mut b, StepKind::Prefill, (0..3).map(last_step).collect());
        for i in 0..3 {
            let d = max_abs_diff(&solo[i], &batched[i]);
            assert!(d <= SAME_MATH, "{name}: request {i} differs by {d} when batched");
        }

        // A decode batch of requests at different lengths: one token each, absorbed path.
        let next = [3u32, 50, 17];
        let decode_step = |i: usize| seq(i as u64, &[next[i]], history[i] + fed[i], &tables[i]);
        let batched = step(&mut b, StepKind::Decode, (0..3).map(decode_step).collect());
        for i in 0..3 {
            let mut alone = dummy_backend(json, 8, 6);
            step(&mut alone, StepKind::Prefill, vec![seq(i as u64, &p[i][..history[i] + fed[i]], 0, &tables[i])]);
            let a = step(&mut alone, StepKind::Decode, vec![decode_step(i)]).remove(0);
            let d = max_abs_diff(&a, &batched[i]);
            assert!(d <= SAME_MATH, "{name}: decode request {i} differs by {d} when batched");
        }
    }
}

/// A mixed step (prompt chunks on the normal path, decode rows on the absorbed path, one batch
/// for everything else) gives every sequence what the separate prefill and decode steps give it,
/// and caches the same rows. A row read or cached at a position off by one changes the logits by
/// about 0.5 (planted in the CPU rank: it fails). Which path a row takes is invisible here, the
/// two agreeing to f32 rounding on the CPU; the GPU test `gpu_mixed_step` covers that.
#[test]
fn mixed_step_matches_its_prefill_and_decode_steps() {
    for (name, json) in CONFIGS {
        let p = [tokens(21, 11, 64), tokens(9, 12, 64), tokens(30, 13, 64)];
        let tables: [Vec<u32>; 3] = [vec![0, 1, 2], vec![3, 4], vec![5, 6, 7, 8]];
        // Sequences 0 and 1 are decoding; sequence 2 prefills its second chunk over a cached
        // first one, so the mixed step's prompt rows also read cached keys.
        let history = [20usize, 8];
        let (chunk0, chunk1) = (12usize, 30usize);
        let warm = |b: &mut mla_cpu::CpuBackend| {
            step(b, StepKind::Prefill, (0..2).map(|i| seq(i as u64, &p[i][..history[i]], 0, &tables[i])).collect());
            step(b, StepKind::Prefill, vec![seq(2, &p[2][..chunk0], 0, &tables[2])]);
        };
        let decode_row = |i: usize| seq(i as u64, &p[i][history[i]..history[i] + 1], history[i], &tables[i]);
        let chunk = seq(2, &p[2][chunk0..chunk1], chunk0, &tables[2]);

        let mut apart = dummy_backend(json, 8, 9);
        warm(&mut apart);
        let prefilled = step(&mut apart, StepKind::Prefill, vec![chunk.clone()]).remove(0);
        let decoded = step(&mut apart, StepKind::Decode, (0..2).map(decode_row).collect());

        let mut mixed = dummy_backend(json, 8, 9);
        warm(&mut mixed);
        let seqs = vec![chunk, decode_row(0), decode_row(1)];
        let out = step(&mut mixed, StepKind::Mixed { prefill: 1 }, seqs);
        let d = max_abs_diff(&prefilled, &out[0]);
        assert!(d <= SAME_MATH, "{name}: the prompt chunk differs by {d} in a mixed step");
        for i in 0..2 {
            let d = max_abs_diff(&decoded[i], &out[1 + i]);
            assert!(d <= SAME_MATH, "{name}: decode row {i} differs by {d} in a mixed step");
        }
        // The next decode step reads what the mixed step cached, for all three sequences.
        let next = |i: usize, at: usize| seq(i as u64, &[7 + i as u32], at, &tables[i]);
        let after = |b: &mut mla_cpu::CpuBackend| {
            step(b, StepKind::Decode, vec![next(0, history[0] + 1), next(1, history[1] + 1), next(2, chunk1)])
        };
        let (a, m) = (after(&mut apart), after(&mut mixed));
        for i in 0..3 {
            let d = max_abs_diff(&a[i], &m[i]);
            assert!(d <= SAME_MATH, "{name}: sequence {i} decodes differently after a mixed step ({d})");
        }
    }
}

#[test]
fn a_mixed_step_names_its_prompt_chunks_and_decode_rows_feed_one_token() {
    let mut b = dummy_backend(V2_LITE_LIKE, 4, 4);
    let too_many = StepPlan { kind: StepKind::Mixed { prefill: 2 }, seqs: vec![seq(1, &[1, 2], 0, &[0])] };
    let e = b.step(&too_many).unwrap_err().to_string();
    assert!(e.contains("names 2 prompt chunks but holds only 1"), "{e}");
    let long_row = StepPlan {
        kind: StepKind::Mixed { prefill: 1 },
        seqs: vec![seq(1, &[1, 2], 0, &[0]), seq(2, &[3, 4], 0, &[1])],
    };
    let e = b.step(&long_row).unwrap_err().to_string();
    assert!(
        e.contains(
            "sequence 2: a decode step feeds exactly one token per row (plus the drafts it verifies: 0), found 2"
        ),
        "{e}"
    );
}

#[test]
fn logits_requests_and_greedy_sampling_follow_the_plan() {
    let mut b = dummy_backend(V3_LIKE, 16, 4);
    let prompt = tokens(9, 11, 64);
    let table = [2u32, 0];
    let mut s = seq(7, &prompt, 0, &table);
    s.logits = LogitsRequest::Last;
    s.sample = Some(SampleRequest {
        params: SamplingParams::greedy(),
        seed: 0,
        top_logprobs: Some(3),
        penalty: None,
        logit_bias: Vec::new(),
        allowed: None,
    });
    let mut other = seq(8, &prompt[..4], 0, &[3]);
    other.logits = LogitsRequest::None;
    let out = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![s, other] }).unwrap();
    assert_eq!(out.seqs.len(), 2);
    assert_eq!((out.seqs[0].seq_id, out.seqs[0].logits.len()), (7, 1));
    assert!(out.seqs[1].logits.is_empty() && out.seqs[1].sampled.is_none());
    let sampled = out.seqs[0].sampled.as_ref().unwrap();
    assert_eq!(sampled.token, argmax(&out.seqs[0].logits[0]));
    assert_eq!(sampled.top_logprobs[0].0, sampled.token);
    assert!(sampled.logprob < 0.0 && sampled.top_logprobs.len() == 3);
}

#[test]
fn invalid_plans_are_rejected_before_touching_the_cache() {
    let mut b = dummy_backend(V2_LITE_LIKE, 4, 4);
    let too_long = StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &tokens(9, 0, 64), 0, &[0, 1])] };
    let msg = b.step(&too_long).unwrap_err().to_string();
    assert!(msg.contains("block table has 2 blocks"), "{msg}");
    let two_tokens = StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, &[1, 2], 0, &[0])] };
    assert!(b.step(&two_tokens).unwrap_err().to_string().contains("exactly one token"));
    let out_of_vocab = StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, &[64], 0, &[0])] };
    assert!(b.step(&out_of_vocab).unwrap_err().to_string().contains("outside the vocabulary"));
}

#[test]
fn empty_plan_is_a_no_op() {
    // Data-parallel ranks step in lockstep and may have nothing to run.
    let mut b = dummy_backend(V2_LITE_LIKE, 4, 4);
    for kind in [StepKind::Prefill, StepKind::Decode] {
        assert!(b.step(&StepPlan { kind, seqs: vec![] }).unwrap().seqs.is_empty());
    }
}
