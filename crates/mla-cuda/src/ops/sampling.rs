//! kernels/sampling.cu: device sampling, one block per sampled row, and the scoring of prompt
//! rows (prompt logprobs) where they were computed.

use super::dims::{MAX_TOP_LOGPROBS, SAMPLER_THREADS};
use super::ensure_len;
use crate::gpu::{Arg, DSlice, Kernel, Modules};
use cudarc::driver::sys::{CUfunction, CUstream};

pub struct SamplingKernels {
    sample_tokens: Kernel,
    score_rows: Kernel,
}

/// Mirror of the kernel's `SampleParams` (same field order, sizes and alignment).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// This row's penalty entries, `[pen_begin, pen_end)` of the step's penalty table.
    pub pen_begin: i32,
    pub pen_end: i32,
    /// This row's logit-bias entries, `[bias_begin, bias_end)` of the step's bias table.
    pub bias_begin: i32,
    pub bias_end: i32,
    /// This row's row of the step's mask table; negative: every token allowed.
    pub mask_row: i32,
    /// The row's token when it is decided already (a speculative verdict writes it on the
    /// device); -1: the sampler draws. Either way the sampler reports its log-probabilities.
    pub forced_token: i32,
}

/// Zero everywhere but `mask_row` and `forced_token`, which are -1: no mask (row 0 would be a
/// mask), and a token to draw.
impl Default for SampleParamsRaw {
    fn default() -> Self {
        SampleParamsRaw {
            temperature: 0.0,
            top_p: 0.0,
            min_p: 0.0,
            top_k: 0,
            repetition_penalty: 0.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            n_logprobs: 0,
            seed: 0,
            pen_begin: 0,
            pen_end: 0,
            bias_begin: 0,
            bias_end: 0,
            mask_row: -1,
            forced_token: -1,
        }
    }
}

const _: () = assert!(std::mem::size_of::<SampleParamsRaw>() == 64);

/// Where the sampler writes, sized for the rows of one launch.
pub struct SamplerOutputs<'a> {
    pub token: DSlice<'a, i32>,
    pub logprob: DSlice<'a, f32>,
    /// [rows, MAX_TOP_LOGPROBS]
    pub top_ids: DSlice<'a, i32>,
    pub top_lps: DSlice<'a, f32>,
}

/// One launch: `rows` rows of `logits` (`[rows, vocab]` at `stride`), each drawn as its
/// `params` row says.
pub struct Sample<'a> {
    pub logits: DSlice<'a, f32>,
    pub stride: usize,
    pub rows: usize,
    pub vocab: usize,
    pub params: DSlice<'a, SampleParamsRaw>,
    /// One device word holding the address of the penalty entries: triples (unique token, output
    /// count, seen-anywhere flag) that the rows index by `[pen_begin, pen_end)`. Read at run time,
    /// so the entries may move between steps without invalidating a captured graph.
    pub penalty_table: DSlice<'a, u64>,
    /// Likewise one word holding the address of the logit-bias entries: pairs (token, bias as
    /// `f32` bits) that the rows index by `[bias_begin, bias_end)`.
    pub bias_table: DSlice<'a, u64>,
    /// `[mask rows, vocab.div_ceil(32)]` allowed-token bits, indexed by the rows' `mask_row`
    /// (bit `t % 32` of word `t / 32`: token `t` may be drawn). Read only by rows with a mask.
    pub mask_table: DSlice<'a, u32>,
    /// `[rows, vocab]` scratch for the shaped (biased, masked, penalised) logits.
    pub work: DSlice<'a, f32>,
    pub out: SamplerOutputs<'a>,
}

/// Words of one scored row in the step metadata: (logits row, token scored, alternatives), the
/// kernel's `ScoreRow`.
pub const SCORE_ROW_WORDS: usize = 3;

/// One `score_rows` launch: the `n` rows `rows` names (`SCORE_ROW_WORDS` words each) of
/// `logits` (`stride` apart), each scored into its own entry of the outputs.
pub struct Scores<'a> {
    pub logits: DSlice<'a, f32>,
    pub stride: usize,
    pub vocab: usize,
    pub rows: DSlice<'a, i32>,
    pub n: usize,
    pub out: ScoreOutputs<'a>,
}

/// Where `score_rows` writes, an entry per scored row.
pub struct ScoreOutputs<'a> {
    pub logprob: DSlice<'a, f32>,
    pub rank: DSlice<'a, i32>,
    /// [rows, MAX_TOP_LOGPROBS]
    pub top_ids: DSlice<'a, i32>,
    pub top_lps: DSlice<'a, f32>,
}

impl SamplingKernels {
    pub fn load(m: &Modules) -> anyhow::Result<Self> {
        Ok(SamplingKernels {
            sample_tokens: m.kernel("sampling", "sample_tokens")?,
            score_rows: m.kernel("sampling", "score_rows")?,
        })
    }

    /// The sampler's function, to find its node in a captured graph.
    pub fn sample_tokens_func(&self) -> CUfunction {
        self.sample_tokens.func()
    }

    pub fn sample(&self, s: CUstream, p: &Sample) -> anyhow::Result<()> {
        let (rows, vocab, stride) = (p.rows, p.vocab, p.stride);
        if rows == 0 {
            return Ok(());
        }
        anyhow::ensure!(stride >= vocab, "logits stride {stride} below vocab {vocab}");
        ensure_len!(p.logits, (rows - 1) * stride + vocab, "logits");
        ensure_len!(p.params, rows, "sampling parameters");
        ensure_len!(p.penalty_table, 1, "penalty table address");
        ensure_len!(p.bias_table, 1, "logit-bias table address");
        ensure_len!(p.work, rows * vocab, "sampling workspace");
        ensure_len!(p.out.token, rows, "sampled tokens");
        ensure_len!(p.out.logprob, rows, "sampled log-probabilities");
        ensure_len!(p.out.top_ids, rows * MAX_TOP_LOGPROBS, "top log-probability ids");
        ensure_len!(p.out.top_lps, rows * MAX_TOP_LOGPROBS, "top log-probabilities");
        self.sample_tokens.launch(
            s,
            (rows as u32, 1, 1),
            SAMPLER_THREADS as u32,
            0,
            &[
                Arg::Ptr(p.logits.ptr),
                Arg::I64(stride as i64),
                Arg::I32(vocab as i32),
                Arg::Ptr(p.params.ptr),
                Arg::Ptr(p.penalty_table.ptr),
                Arg::Ptr(p.bias_table.ptr),
                Arg::Ptr(p.mask_table.ptr),
                Arg::Ptr(p.work.ptr),
                Arg::Ptr(p.out.token.ptr),
                Arg::Ptr(p.out.logprob.ptr),
                Arg::Ptr(p.out.top_ids.ptr),
                Arg::Ptr(p.out.top_lps.ptr),
            ],
        )?;
        Ok(())
    }

    /// Scores the rows `p` names (`Scores`).
    pub fn score_rows(&self, s: CUstream, p: &Scores) -> anyhow::Result<()> {
        if p.n == 0 {
            return Ok(());
        }
        anyhow::ensure!(p.stride >= p.vocab, "logits stride {} below vocab {}", p.stride, p.vocab);
        ensure_len!(p.rows, p.n * SCORE_ROW_WORDS, "scored rows");
        ensure_len!(p.out.logprob, p.n, "scored log-probabilities");
        ensure_len!(p.out.rank, p.n, "scored ranks");
        ensure_len!(p.out.top_ids, p.n * MAX_TOP_LOGPROBS, "scored top ids");
        ensure_len!(p.out.top_lps, p.n * MAX_TOP_LOGPROBS, "scored top log-probabilities");
        self.score_rows.launch(
            s,
            (p.n as u32, 1, 1),
            SAMPLER_THREADS as u32,
            0,
            &[
                Arg::Ptr(p.logits.ptr),
                Arg::I64(p.stride as i64),
                Arg::I32(p.vocab as i32),
                Arg::Ptr(p.rows.ptr),
                Arg::Ptr(p.out.logprob.ptr),
                Arg::Ptr(p.out.rank.ptr),
                Arg::Ptr(p.out.top_ids.ptr),
                Arg::Ptr(p.out.top_lps.ptr),
            ],
        )?;
        Ok(())
    }
}
