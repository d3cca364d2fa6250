//! kernels/speculative.cu: the verdict on sampled drafts, and keeping the rows they were drawn
//! from until it.

use super::dims::{MAX_SPEC_DRAFTS, SAMPLER_THREADS};
use super::ensure_len;
use super::sampling::SampleParamsRaw;
use crate::gpu::{Arg, DSlice, Kernel, Modules};
use cudarc::driver::sys::CUstream;

pub struct SpeculativeKernels {
    distributions: Kernel,
    verdicts: Kernel,
    keep_rows: Kernel,
}

/// Mirror of the kernel's `SpecRow`: a logits row whose distribution a verdict needs.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecRowRaw {
    /// Device address of the row.
    pub logits: u64,
    /// The sampler row whose parameters shape it.
    pub params_row: i32,
    /// 1: a target row, shaped by its request's bias and penalties into that sampler row's
    /// working copy first (as the sampler will shape it); 0: a kept draft row, taken as is.
    pub shape: i32,
}

const _: () = assert!(std::mem::size_of::<SpecRowRaw>() == 16);

/// Bytes of the kernel's `RowDistribution` (a row's kept set and normaliser), the only thing
/// the host needs of it: room.
pub const ROW_DISTRIBUTION_BYTES: usize = 24;

/// Mirror of the kernel's `SpecVerdict`: one sequence's drafts to verify.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecVerdictRaw {
    /// Device address of the first draft's MTP logits row (the others follow, a vocabulary
    /// apart); 0: the drafts are verified against their point masses.
    pub q_logits: u64,
    /// Its first verify row among the sampler's rows.
    pub row0: i32,
    pub fed: i32,
    /// Its target rows' distributions among the launch's rows, then (with `q_logits`) its drafts'.
    pub dist0: i32,
    pub reserved: i32,
    pub drafts: [i32; MAX_SPEC_DRAFTS],
}

const _: () = assert!(std::mem::size_of::<SpecVerdictRaw>() == 24 + 4 * MAX_SPEC_DRAFTS);

/// A verdict launch: `verdicts` over the sampler's `logits` rows (`stride` apart), with the
/// distributions of `rows` computed into `dists` first. The verdicts write the decided rows'
/// `forced_token` into `params`, which the sampler reads next.
pub struct Verdicts<'a> {
    pub rows: DSlice<'a, SpecRowRaw>,
    pub n_rows: usize,
    /// Room for `n_rows` distributions, `ROW_DISTRIBUTION_BYTES` each.
    pub dists: DSlice<'a, u8>,
    pub verdicts: DSlice<'a, SpecVerdictRaw>,
    pub n_verdicts: usize,
    pub logits: DSlice<'a, f32>,
    pub stride: usize,
    pub vocab: usize,
    pub params: DSlice<'a, SampleParamsRaw>,
    /// The sampler's tables and working rows (`Sample`'s): target rows that shape their logits
    /// are shaped into `work` by the same code as the sampler's.
    pub penalty_table: DSlice<'a, u64>,
    pub bias_table: DSlice<'a, u64>,
    pub mask_table: DSlice<'a, u32>,
    pub work: DSlice<'a, f32>,
}

/// Kept draft rows (`SpeculativeKernels::keep_rows`): `n` (sampler row, store row) `pairs`,
/// each sampler row taken from `logits`, or from the sampler's `work` row where its `params`
/// shaped it, into `dst`.
pub struct KeepRows<'a> {
    pub logits: DSlice<'a, f32>,
    pub work: DSlice<'a, f32>,
    pub params: DSlice<'a, SampleParamsRaw>,
    pub pairs: DSlice<'a, i32>,
    pub n: usize,
    pub dst: DSlice<'a, f32>,
    pub vocab: usize,
}

impl SpeculativeKernels {
    pub fn load(m: &Modules) -> anyhow::Result<Self> {
        Ok(SpeculativeKernels {
            distributions: m.kernel("speculative", "spec_distributions")?,
            verdicts: m.kernel("speculative", "spec_verdicts")?,
            keep_rows: m.kernel("speculative", "spec_keep_rows")?,
        })
    }

    pub fn verdicts(&self, s: CUstream, v: &Verdicts) -> anyhow::Result<()> {
        if v.n_verdicts == 0 {
            return Ok(());
        }
        ensure_len!(v.rows, v.n_rows, "verdict rows");
        ensure_len!(v.dists, v.n_rows * ROW_DISTRIBUTION_BYTES, "row distributions");
        ensure_len!(v.verdicts, v.n_verdicts, "verdicts");
        anyhow::ensure!(v.stride >= v.vocab, "logits stride {} below vocab {}", v.stride, v.vocab);
        if v.n_rows > 0 {
            self.distributions.launch(
                s,
                (v.n_rows as u32, 1, 1),
                // The sampler's shape: the kept set's sums depend on it.
                SAMPLER_THREADS as u32,
                0,
                &[
                    Arg::Ptr(v.rows.ptr),
                    Arg::Ptr(v.params.ptr),
                    Arg::I32(v.vocab as i32),
                    Arg::Ptr(v.penalty_table.ptr),
                    Arg::Ptr(v.bias_table.ptr),
                    Arg::Ptr(v.mask_table.ptr),
                    Arg::Ptr(v.work.ptr),
                    Arg::Ptr(v.dists.ptr),
                ],
            )?;
        }
        self.verdicts.launch(
            s,
            (v.n_verdicts as u32, 1, 1),
            512,
            0,
            &[
                Arg::Ptr(v.verdicts.ptr),
                Arg::Ptr(v.logits.ptr),
                Arg::I64(v.stride as i64),
                Arg::I32(v.vocab as i32),
                Arg::Ptr(v.dists.ptr),
                Arg::Ptr(v.params.ptr),
                Arg::Ptr(v.work.ptr),
            ],
        )?;
        Ok(())
    }

    /// Copies the kept draft rows `k` names (`KeepRows`).
    pub fn keep_rows(&self, s: CUstream, k: &KeepRows) -> anyhow::Result<()> {
        if k.n == 0 {
            return Ok(());
        }
        ensure_len!(k.pairs, 2 * k.n, "row pairs");
        self.keep_rows.launch(
            s,
            (k.n as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(k.logits.ptr),
                Arg::Ptr(k.work.ptr),
                Arg::Ptr(k.params.ptr),
                Arg::Ptr(k.pairs.ptr),
                Arg::Ptr(k.dst.ptr),
                Arg::I32(k.vocab as i32),
            ],
        )?;
        Ok(())
    }
}
