//! The device sampler against mla-core's host sampler: greedy rows with log-probabilities and
//! penalties on a full vocabulary, then the distribution, the filters and the seeds on a small one;
//! then logit bias (-inf included) and structured-output masks, alone and with the filters and
//! penalties: greedy and deterministic rows must draw the host's token, seeded rows only allowed
//! tokens, in the renormalised proportions.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_sampling -- --ignored`.

mod common;

use common::*;
use mla_core::sampling::{log_softmax, top_k_entries};
use mla_core::step::plan::{LogitsRequest, PenaltyTokens, SampleRequest, StepKind, StepPlan};
use mla_core::step::token_mask::{mask_words, TokenMask, MASK_WAIT};
use mla_core::SamplingParams;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::model::meta_words::to_words;
use mla_cuda::model::{MetaLimits, StepMeta};
use mla_cuda::ops::*;

/// (token, logprob, top alternatives) of one sampled row.
type Sampled = (i32, f32, Vec<(i32, f32)>);

fn sample_rows(dev: &mla_cuda::Device, logits: &[f32], vocab: usize, reqs: &[SampleRequest]) -> Vec<Sampled> {
    let rows = reqs.len();
    let plan = StepPlan {
        kind: StepKind::Decode,
        seqs: reqs
            .iter()
            .enumerate()
            .map(|(i, r)| seq(i as u64, &[0], 0, &[0], LogitsRequest::None, Some(r.clone())))
            .collect(),
    };
    let lim = MetaLimits {
        max_tokens: rows,
        max_seqs: rows,
        max_logit_rows: rows,
        max_kv_chunk: rows,
        max_blocks_per_seq: 1,
        vocab,
    };
    let mut meta = StepMeta::build(&plan, &lim).unwrap();
    // The penalty and bias entries in buffers of their own, their addresses in the words, and the
    // masked rows' words in a table in their order (as MetaBuffers does).
    let d_pen = up(&[meta.penalties.as_slice(), &[0]].concat());
    let pen_addr = d_pen.ptr();
    meta.words[meta.penalty_table.words()].copy_from_slice(to_words(&pen_addr));
    let d_bias = up(&[meta.biases.as_slice(), &[0]].concat());
    let bias_addr = d_bias.ptr();
    meta.words[meta.bias_table.words()].copy_from_slice(to_words(&bias_addr));
    let mut masks: Vec<u32> = meta.masks.iter().flat_map(|m| m.mask.wait(vocab, MASK_WAIT).unwrap().to_vec()).collect();
    assert_eq!(masks.len(), meta.masks.len() * mask_words(vocab));
    masks.push(0);
    let d_masks = up(&masks);
    let d_meta = up(&meta.words);
    let w = d_meta.slice();
    let d_logits = up(logits);
    let work = DeviceBuffer::<f32>::alloc(rows * vocab).unwrap();
    let tok = DeviceBuffer::<i32>::alloc(rows).unwrap();
    let lp = DeviceBuffer::<f32>::alloc(rows).unwrap();
    let tids = DeviceBuffer::<i32>::alloc(rows * MAX_TOP_LOGPROBS).unwrap();
    let tlps = DeviceBuffer::<f32>::alloc(rows * MAX_TOP_LOGPROBS).unwrap();
    let out = SamplerOutputs { token: tok.slice(), logprob: lp.slice(), top_ids: tids.slice(), top_lps: tlps.slice() };
    let p = Sample {
        logits: d_logits.slice(),
        stride: vocab,
        rows,
        vocab,
        params: meta.sampling.on(w),
        penalty_table: meta.penalty_table.on(w),
        bias_table: meta.bias_table.on(w),
        mask_table: d_masks.slice(),
        work: work.slice(),
        out,
    };
    dev.k.sampling.sample(dev.stream(), &p).unwrap();
    dev.gpu.sync().unwrap();
    let (t, l, ti, tl) = (down(tok.slice()), down(lp.slice()), down(tids.slice()), down(tlps.slice()));
    (0..rows)
        .map(|r| {
            let n = reqs[r].top_logprobs.unwrap_or(0);
            (t[r], l[r], (0..n).map(|j| (ti[r * MAX_TOP_LOGPROBS + j], tl[r * MAX_TOP_LOGPROBS + j])).collect())
        })
        .collect()
}

fn req(params: SamplingParams, seed: u64, top_logprobs: Option<usize>) -> SampleRequest {
    SampleRequest { params, seed, top_logprobs, penalty: None, logit_bias: Vec::new(), allowed: None }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sampling_greedy_logprobs_filters_penalties_and_seeds() {
    let dev = device();
    let mut rng = Rng::new(14);
    // Greedy with logprobs, and penalties that change the winner, on a 102400-token vocabulary.
    let vocab = 102_400;
    let rows = 6;
    let logits = rng.uniform(rows * vocab, 8.0);
    let mut reqs: Vec<SampleRequest> = (0..rows).map(|i| req(SamplingParams::greedy(), i as u64, Some(5))).collect();
    let best = mla_core::sampling::argmax(&logits[vocab..2 * vocab]);
    reqs[1].params.repetition_penalty = 3.0;
    reqs[1].penalty = Some(mla_core::step::plan::PenaltyTokens { prompt: vec![best, 7], output: vec![] });
    reqs[2].params.frequency_penalty = 0.7;
    reqs[2].params.presence_penalty = 0.4;
    reqs[2].penalty = Some(mla_core::step::plan::PenaltyTokens {
        prompt: vec![],
        output: vec![mla_core::sampling::argmax(&logits[2 * vocab..3 * vocab]); 30],
    });
    reqs[3].params = SamplingParams { top_k: Some(1), ..Default::default() };
    let got = sample_rows(&dev, &logits, vocab, &reqs);
    for r in 0..rows {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let want = mla_core::sampling::sample(row, &reqs[r]).expect("no mask");
        assert_eq!(got[r].0 as u32, want.token, "row {r}: token");
        let lp = log_softmax(row);
        assert!(
            (got[r].1 - lp[want.token as usize]).abs() < 1e-3,
            "row {r}: logprob {} vs {}",
            got[r].1,
            lp[want.token as usize]
        );
        let top = top_k_entries(&lp, 5);
        assert_eq!(
            got[r].2.iter().map(|x| x.0 as u32).collect::<Vec<_>>(),
            top.iter().map(|x| x.0).collect::<Vec<_>>(),
            "row {r}: top ids"
        );
        for (g, w) in got[r].2.iter().zip(&top) {
            assert!((g.1 - w.1).abs() < 1e-3);
        }
    }
    assert_ne!(got[1].0 as u32, best, "the repetition penalty should move the argmax");

    // Distribution, filters and seeds on a 4-token vocabulary: p = 0.1, 0.2, 0.3, 0.4.
    let vocab = 4;
    let base = [0.1f32.ln(), 0.2f32.ln(), 0.3f32.ln(), 0.4f32.ln()];
    let n = 4000;
    let run = |params: SamplingParams, seed0: u64| -> Vec<i32> {
        let logits: Vec<f32> = (0..n).flat_map(|_| base).collect();
        let reqs: Vec<SampleRequest> = (0..n).map(|i| req(params.clone(), seed0 + i as u64, None)).collect();
        sample_rows(&dev, &logits, vocab, &reqs).into_iter().map(|x| x.0).collect()
    };
    let plain = run(SamplingParams::default(), 0);
    for (tk, p) in [0.1, 0.2, 0.3, 0.4].iter().enumerate() {
        let f = plain.iter().filter(|&&x| x == tk as i32).count() as f64 / n as f64;
        assert!((f - p).abs() < 0.03, "token {tk}: frequency {f} for probability {p}");
    }
    assert_eq!(plain, run(SamplingParams::default(), 0), "same seeds, same tokens");
    // Same seed at a different batch position draws the same token.
    let shifted = run(SamplingParams::default(), 1);
    assert_eq!(&plain[1..], &shifted[..n - 1]);
    for params in [
        SamplingParams { top_p: 0.5, ..Default::default() },
        SamplingParams { min_p: 0.6, ..Default::default() },
        SamplingParams { top_k: Some(2), ..Default::default() },
    ] {
        let got = run(params.clone(), 7);
        assert!(got.iter().all(|&x| x == 2 || x == 3), "{params:?} kept a token outside the top two");
        assert!(got.contains(&2) && got.contains(&3), "{params:?} should keep both of the top two");
    }
    let t_low = run(SamplingParams { temperature: 0.05, ..Default::default() }, 3);
    assert!(t_low.iter().filter(|&&x| x == 3).count() > n * 99 / 100, "low temperature is nearly greedy");
}

/// A ready mask allowing exactly `allowed`.
fn mask_of(vocab: usize, allowed: &[u32]) -> TokenMask {
    let mut w = vec![0u32; mask_words(vocab)];
    for &t in allowed {
        w[t as usize / 32] |= 1 << (t % 32);
    }
    TokenMask::ready(w)
}

/// A logit-bias list as the engine sends it: sorted by token, each token once.
fn bias(mut entries: Vec<(u32, f32)>) -> Vec<(u32, f32)> {
    entries.sort_by_key(|e| e.0);
    entries.dedup_by_key(|e| e.0);
    entries
}

/// `k` distinct random tokens below `vocab`.
fn distinct(rng: &mut Rng, vocab: usize, k: usize) -> Vec<u32> {
    let mut v: Vec<u32> = Vec::new();
    while v.len() < k {
        let t = rng.below(vocab) as u32;
        if !v.contains(&t) {
            v.push(t);
        }
    }
    v
}

/// The allowed tokens of a row get logits below every other token's (which are uniform in
/// [-8, 8)), 0.5 apart in the order given, so that a mask that leaks shows at once and the best
/// allowed token wins even the near-greedy draws by a margin no Gumbel noise bridges.
fn sink(row: &mut [f32], allowed: &[u32]) {
    for (j, &t) in allowed.iter().enumerate() {
        row[t as usize] = -9.0 - 0.5 * j as f32;
    }
}

/// Greedy and deterministic rows (filters that keep one token) with bias and masks: the device
/// must draw the host sampler's token and report the unmodified distribution's log-probabilities.
fn check_against_host(dev: &mla_cuda::Device, logits: &[f32], vocab: usize, reqs: &[SampleRequest]) -> Vec<u32> {
    let got = sample_rows(dev, logits, vocab, reqs);
    let mut tokens = Vec::new();
    for (r, req) in reqs.iter().enumerate() {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let want = mla_core::sampling::sample(row, req).expect("ready masks");
        assert_eq!(got[r].0 as u32, want.token, "vocab {vocab} row {r}: token");
        let lp = log_softmax(row);
        assert!(
            (got[r].1 - lp[want.token as usize]).abs() < 1e-3,
            "vocab {vocab} row {r}: logprob {} vs the raw {}",
            got[r].1,
            lp[want.token as usize]
        );
        let k = req.top_logprobs.unwrap_or(0);
        let top = top_k_entries(&lp, k);
        assert_eq!(
            got[r].2.iter().map(|x| x.0 as u32).collect::<Vec<_>>(),
            top.iter().map(|x| x.0).collect::<Vec<_>>(),
            "vocab {vocab} row {r}: top ids are of the raw distribution"
        );
        tokens.push(want.token);
    }
    tokens
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sampling_bias_and_masks_match_the_host_on_greedy_and_single_token_rows() {
    let dev = device();
    let mut rng = Rng::new(21);
    let greedy = || req(SamplingParams::greedy(), 0, Some(5));
    let warm = |p: SamplingParams, seed: u64| req(SamplingParams { temperature: 1.0, ..p }, seed, Some(3));
    // 102400 tokens (a multiple of 32) and 1000 (the last mask word is partial).
    for vocab in [102_400usize, 1000] {
        let rows = 14;
        let mut logits = rng.uniform(rows * vocab, 8.0);
        let mut reqs: Vec<SampleRequest> = (0..rows).map(|_| greedy()).collect();
        let row = |logits: &[f32], r: usize| logits[r * vocab..(r + 1) * vocab].to_vec();
        let mut want: Vec<Option<u32>> = vec![None; rows];
        // 0: a +30 bias makes a token the argmax.
        let t0 = rng.below(vocab) as u32;
        reqs[0].logit_bias = vec![(t0, 30.0)];
        want[0] = Some(t0);
        // 1: -inf (min_tokens) on the argmax and -100 on the runner-up: the third best.
        let top3 = top_k_entries(&row(&logits, 1), 3);
        reqs[1].logit_bias = bias(vec![(top3[0].0, f32::NEG_INFINITY), (top3[1].0, -100.0)]);
        want[1] = Some(top3[2].0);
        // 2: one allowed token, among the worst logits; the last token of the vocabulary for
        // the partial last word.
        let t2 = if vocab == 1000 { 999 } else { rng.below(vocab) as u32 };
        logits[2 * vocab + t2 as usize] = -20.0;
        reqs[2].allowed = Some(mask_of(vocab, &[t2]));
        want[2] = Some(t2);
        // 3..=9: seven allowed tokens, sunk below the rest; the best allowed is a[0].
        let allowed: Vec<Vec<u32>> = (0..rows).map(|_| distinct(&mut rng, vocab, 7)).collect();
        for r in 3..=9 {
            sink(&mut logits[r * vocab..(r + 1) * vocab], &allowed[r]);
            reqs[r].allowed = Some(mask_of(vocab, &allowed[r]));
        }
        // 3: the mask alone.
        want[3] = Some(allowed[3][0]);
        // 4: mask and bias: -inf on the best allowed, +0.7 lifts the third over the second.
        reqs[4].logit_bias = bias(vec![(allowed[4][0], f32::NEG_INFINITY), (allowed[4][2], 0.7)]);
        want[4] = Some(allowed[4][2]);
        // 5: mask and penalties: the best allowed token repeated in the output.
        reqs[5].params.frequency_penalty = 1.2;
        reqs[5].params.repetition_penalty = 1.5;
        reqs[5].penalty = Some(PenaltyTokens { prompt: vec![allowed[5][1]], output: vec![allowed[5][0]; 2] });
        // 6..=8: filters that keep one token (top-k 1, top-p 0.01, min-p 1) behind the mask.
        reqs[6] = warm(SamplingParams { top_k: Some(1), ..Default::default() }, 6);
        reqs[7] = warm(SamplingParams { top_p: 0.01, ..Default::default() }, 7);
        reqs[8] = warm(SamplingParams { min_p: 1.0, ..Default::default() }, 8);
        // 9: top-k 50 with only 7 tokens allowed, at a temperature low enough (0.5 logits apart)
        // that the best allowed token always wins.
        reqs[9] = warm(SamplingParams { top_k: Some(50), ..Default::default() }, 9);
        reqs[9].params.temperature = 0.01;
        for r in 6..=9 {
            reqs[r].allowed = Some(mask_of(vocab, &allowed[r]));
            want[r] = Some(allowed[r][0]);
        }
        // 10: all tokens but one disallowed, seeded with every filter: always that token.
        let t10 = rng.below(vocab) as u32;
        reqs[10] = warm(SamplingParams { top_k: Some(3), top_p: 0.9, min_p: 0.1, ..Default::default() }, 10);
        reqs[10].allowed = Some(mask_of(vocab, &[t10]));
        want[10] = Some(t10);
        // 11: a mask allowing nothing: token 0, as the host's argmax of a row of -inf.
        reqs[11].allowed = Some(mask_of(vocab, &[]));
        want[11] = Some(0);
        // 12: a bias on a masked-out token leaves it out.
        let t12 = distinct(&mut rng, vocab, 2);
        reqs[12].allowed = Some(mask_of(vocab, &[t12[0]]));
        reqs[12].logit_bias = vec![(t12[1], 100.0)];
        want[12] = Some(t12[0]);
        // 13: no bias and no mask in the same launch: unchanged.
        want[13] = Some(mla_core::sampling::argmax(&row(&logits, 13)));
        let got = check_against_host(&dev, &logits, vocab, &reqs);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            if let Some(w) = w {
                assert_eq!(
                    g, w,
                    "vocab {vocab} row {r}: the host sampler itself disagrees with the test's expectation"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn seeded_draws_pick_only_allowed_tokens_in_renormalised_proportions() {
    let dev = device();
    let mut rng = Rng::new(33);
    // Five allowed tokens of 1000 (two in the partial last word) with close logits, every other
    // token far more likely: a single leaked draw shows.
    let vocab = 1000;
    let allowed = [3u32, 64, 500, 998, 999];
    let base: Vec<f32> = {
        let mut row: Vec<f32> = rng.uniform(vocab, 1.0).iter().map(|x| x + 6.0).collect();
        for (t, v) in allowed.iter().zip([0.0f32, 0.3, -0.2, 0.5, 0.1]) {
            row[*t as usize] = v;
        }
        row
    };
    let mask = mask_of(vocab, &allowed);
    let variants = [
        SamplingParams::default(),
        SamplingParams { top_k: Some(50), ..Default::default() },
        SamplingParams { top_k: Some(3), ..Default::default() },
        SamplingParams { top_p: 0.8, ..Default::default() },
        SamplingParams { min_p: 0.5, ..Default::default() },
        SamplingParams { temperature: 1.7, top_p: 0.95, ..Default::default() },
        SamplingParams { repetition_penalty: 2.0, presence_penalty: 0.5, ..Default::default() },
    ];
    let n = 700;
    let mut reqs = Vec::with_capacity(n);
    for i in 0..n {
        let mut r = req(variants[i % variants.len()].clone(), 1000 + i as u64, None);
        r.allowed = Some(mask.clone());
        if r.params.has_penalties() {
            r.penalty = Some(PenaltyTokens { prompt: vec![998], output: vec![999, 17] });
        }
        // Every other row: min_tokens' -inf on the best allowed token.
        if i % 2 == 1 {
            r.logit_bias = vec![(998, f32::NEG_INFINITY)];
        }
        reqs.push(r);
    }
    let logits: Vec<f32> = (0..n).flat_map(|_| base.iter().copied()).collect();
    let got = sample_rows(&dev, &logits, vocab, &reqs);
    let mut seen = std::collections::BTreeSet::new();
    for (i, g) in got.iter().enumerate() {
        let t = g.0 as u32;
        assert!(allowed.contains(&t), "row {i} ({:?}): drew disallowed token {t}", reqs[i].params);
        assert!(i % 2 == 0 || t != 998, "row {i}: drew token 998 despite its -inf bias");
        seen.insert(t);
    }
    assert!(seen.len() >= 4, "seeded draws should spread over the allowed tokens, saw {seen:?}");
    // The top-k 3 rows keep the three best allowed tokens (998 at 0.5, 64 at 0.3, 999 at 0.1);
    // with 998 at -inf, the three best left (64, 999, 3 at 0.0).
    for (i, g) in got.iter().enumerate().filter(|(i, _)| i % variants.len() == 2) {
        let keep: &[i32] = if i % 2 == 0 { &[998, 64, 999] } else { &[64, 999, 3] };
        assert!(keep.contains(&g.0), "row {i}: top-k 3 drew {}", g.0);
    }

    // Proportions on 4 tokens with p = 0.1, 0.2, 0.3, 0.4: a mask of {0, 2} leaves 0.25 / 0.75;
    // a bias of ln 4 on token 0 makes the weights 0.4, 0.2, 0.3, 0.4 (over 1.3).
    let vocab = 4;
    let base = [0.1f32.ln(), 0.2f32.ln(), 0.3f32.ln(), 0.4f32.ln()];
    let n = 4000;
    let run = |shape: &dyn Fn(&mut SampleRequest)| -> Vec<f64> {
        let logits: Vec<f32> = (0..n).flat_map(|_| base).collect();
        let reqs: Vec<SampleRequest> = (0..n)
            .map(|i| {
                let mut r = req(SamplingParams::default(), 50_000 + i as u64, None);
                shape(&mut r);
                r
            })
            .collect();
        let got = sample_rows(&dev, &logits, vocab, &reqs);
        (0..vocab as i32).map(|t| got.iter().filter(|g| g.0 == t).count() as f64 / n as f64).collect()
    };
    let masked = run(&|r| r.allowed = Some(mask_of(4, &[0, 2])));
    for (f, p) in masked.iter().zip([0.25, 0.0, 0.75, 0.0]) {
        assert!((f - p).abs() < 0.03, "masked frequencies {masked:?}");
    }
    assert!(masked[1] == 0.0 && masked[3] == 0.0, "masked frequencies {masked:?}");
    let biased = run(&|r| r.logit_bias = vec![(0, 4f32.ln())]);
    for (f, p) in biased.iter().zip([0.4 / 1.3, 0.2 / 1.3, 0.3 / 1.3, 0.4 / 1.3]) {
        assert!((f - p).abs() < 0.03, "biased frequencies {biased:?}");
    }
}

/// Prompt logprobs on the device (`LogitsRequest::Scored`, `score_rows`) against the host's
/// `mla_core::sampling::score` on DeepSeek's vocabulary: each fed row scored against the next
/// fed token, the last against `after` (or not at all), with ties in the row (the rank counts
/// only larger logits; the alternatives break ties by lower id). Log-probabilities within 1e-3
/// (the device normalises in f32, the host in f64), ranks and alternative ids exact.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn scored_rows_match_the_host_scores() {
    let dev = device();
    let mut rng = Rng::new(21);
    let vocab = 129_280;
    let plan = StepPlan {
        kind: StepKind::Prefill,
        seqs: vec![
            seq(0, &[5, 17, 17, 900, 3], 0, &[0], LogitsRequest::Scored { top: 5, after: Some(77) }, None),
            seq(1, &[128_000, 2, 44], 0, &[1], LogitsRequest::Scored { top: 20, after: None }, None),
        ],
    };
    let rows = 8;
    let mut logits = rng.uniform(rows * vocab, 8.0);
    // Row 1 ties its scored token (17) with the best logit and another id; row 6 scores a token
    // below several equal larger ones.
    logits[vocab + 17] = 9.0;
    logits[vocab + 4] = 9.0;
    logits[vocab + 100] = 9.0;
    for t in [1, 9, 30] {
        logits[6 * vocab + t] = 8.5;
    }
    logits[6 * vocab + 44] = 8.25;
    let lim = MetaLimits {
        max_tokens: rows,
        max_seqs: 2,
        max_logit_rows: rows,
        max_kv_chunk: rows,
        max_blocks_per_seq: 1,
        vocab,
    };
    let meta = StepMeta::build(&plan, &lim).unwrap();
    // No row samples: the logits rows are the scored fed rows in order (the last row of the
    // second sequence, with no token after it, is not even computed).
    assert_eq!((meta.logit_rows(), meta.scored_rows()), (7, 7));
    let d_meta = up(&meta.words);
    let d_logits = up(&logits);
    let n = meta.scored_rows();
    let (lp, rank) = (DeviceBuffer::<f32>::alloc(n).unwrap(), DeviceBuffer::<i32>::alloc(n).unwrap());
    let tids = DeviceBuffer::<i32>::alloc(n * MAX_TOP_LOGPROBS).unwrap();
    let tlps = DeviceBuffer::<f32>::alloc(n * MAX_TOP_LOGPROBS).unwrap();
    let p = Scores {
        logits: d_logits.slice(),
        stride: vocab,
        vocab,
        rows: meta.scored.on(d_meta.slice()),
        n,
        out: ScoreOutputs { logprob: lp.slice(), rank: rank.slice(), top_ids: tids.slice(), top_lps: tlps.slice() },
    };
    dev.k.sampling.score_rows(dev.stream(), &p).unwrap();
    dev.gpu.sync().unwrap();
    let (lp, rank, tids, tlps) = (down(lp.slice()), down(rank.slice()), down(tids.slice()), down(tlps.slice()));
    let row = |r: usize| logits[r * vocab..(r + 1) * vocab].to_vec();
    let want: Vec<_> =
        mla_core::sampling::score_rows(&(0..5).map(row).collect::<Vec<_>>(), &[5, 17, 17, 900, 3], 5, Some(77))
            .into_iter()
            .map(|s| (s, 5))
            .chain(
                mla_core::sampling::score_rows(&(5..8).map(row).collect::<Vec<_>>(), &[128_000, 2, 44], 20, None)
                    .into_iter()
                    .map(|s| (s, 20)),
            )
            .collect();
    assert_eq!(want.len(), n);
    assert_eq!((want[1].0.rank, want[6].0.rank), (1, 4), "the planted ties");
    for (i, (w, k)) in want.iter().enumerate() {
        assert!((lp[i] - w.logprob).abs() < 1e-3, "row {i}: logprob {} vs {}", lp[i], w.logprob);
        assert_eq!(rank[i] as u32, w.rank, "row {i}: rank");
        let got: Vec<(u32, f32)> =
            (0..*k).map(|j| (tids[i * MAX_TOP_LOGPROBS + j] as u32, tlps[i * MAX_TOP_LOGPROBS + j])).collect();
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            w.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            "row {i}: top ids"
        );
        for (g, t) in got.iter().zip(&w.top) {
            assert!((g.1 - t.1).abs() < 1e-3, "row {i}: top logprob {} vs {}", g.1, t.1);
        }
    }
}
