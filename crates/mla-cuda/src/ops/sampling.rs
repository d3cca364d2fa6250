//! Device sampling (kernels/sampling.cu): one block per sampled row.

use super::{ensure_len, Kernels};
use crate::gpu::{Arg, DSlice};
use cudarc::driver::sys::CUstream;

pub const MAX_TOP_LOGPROBS: usize = 20;

/// Mirror of the kernel's `SampleParams` (same field order, sizes and alignment).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SampleParamsRaw {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: i32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Alternatives to report; negative: no log-probabilities at all.
    pub n_logprobs: i32,
    pub seed: u64,
    pub pen_begin: i32,
    pub pen_end: i32,
}

const _: () = assert!(std::mem::size_of::<SampleParamsRaw>() == 48);

/// Where the sampler writes, sized for the rows of one launch.
pub struct SamplerOutputs {
    pub token: DSlice<i32>,
    pub logprob: DSlice<f32>,
    /// [rows, MAX_TOP_LOGPROBS]
    pub top_ids: DSlice<i32>,
    pub top_lps: DSlice<f32>,
}

impl Kernels {
    /// Samples `rows` rows of `logits` ([rows, vocab] at `stride`). Penalty entries are triples
    /// (unique token, output count, seen-anywhere flag) indexed by each row's [pen_begin, pen_end).
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        s: CUstream,
        logits: DSlice<f32>,
        stride: usize,
        rows: usize,
        vocab: usize,
        params: DSlice<SampleParamsRaw>,
        pen: DSlice<i32>,
        work: DSlice<f32>,
        out: &SamplerOutputs,
    ) -> anyhow::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        anyhow::ensure!(stride >= vocab, "logits stride {stride} below vocab {vocab}");
        ensure_len!(logits, (rows - 1) * stride + vocab, "logits");
        ensure_len!(params, rows, "sampling parameters");
        ensure_len!(work, rows * vocab, "sampling workspace");
        ensure_len!(out.token, rows, "sampled tokens");
        ensure_len!(out.logprob, rows, "sampled log-probabilities");
        ensure_len!(out.top_ids, rows * MAX_TOP_LOGPROBS, "top log-probability ids");
        ensure_len!(out.top_lps, rows * MAX_TOP_LOGPROBS, "top log-probabilities");
        self.sample_tokens.launch(
            s,
            (rows as u32, 1, 1),
            512,
            0,
            &[
                Arg::Ptr(logits.ptr),
                Arg::I64(stride as i64),
                Arg::I32(vocab as i32),
                Arg::Ptr(params.ptr),
                Arg::Ptr(pen.ptr),
                Arg::Ptr(work.ptr),
                Arg::Ptr(out.token.ptr),
                Arg::Ptr(out.logprob.ptr),
                Arg::Ptr(out.top_ids.ptr),
                Arg::Ptr(out.top_lps.ptr),
            ],
        )?;
        Ok(())
    }
}
