//! The device sampler against mla-core's host sampler: greedy rows with log-probabilities and
//! penalties on a full vocabulary, then the distribution, the filters and the seeds on a small one.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_sampling -- --ignored`.

mod common;

use common::*;
use mla_core::plan::{LogitsRequest, SampleRequest, StepKind, StepPlan};
use mla_core::sampling::{log_softmax, top_k_entries};
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
    // The penalty entries in a buffer of their own, its address in the words (as MetaBuffers does).
    let d_pen = up(&[meta.penalties.as_slice(), &[0]].concat());
    let pen_addr = d_pen.ptr();
    meta.words[meta.penalty_table.words()].copy_from_slice(to_words(&pen_addr));
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
    reqs[1].penalty = Some(mla_core::plan::PenaltyTokens { prompt: vec![best, 7], output: vec![] });
    reqs[2].params.frequency_penalty = 0.7;
    reqs[2].params.presence_penalty = 0.4;
    reqs[2].penalty = Some(mla_core::plan::PenaltyTokens {
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
