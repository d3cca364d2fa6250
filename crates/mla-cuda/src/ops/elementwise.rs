//! kernels/elementwise.cu: embedding, RMSNorm variants, SiLU·mul, conversion, random fills and
//! the row gather (latent rows for prefill, token rows for the MoE experts and the output head).

use super::{count_knob, ensure_len, grid_for};
use crate::gpu::{Arg, DSlice, GpuInfo, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

const ROW_THREADS: u32 = 256;
/// The norm kernels keep a row in registers: 256 threads x 32 values.
const MAX_NORM_WIDTH: usize = 256 * 32;
/// The split norms (`*_split` in kernels/elementwise.cu): a row over a cluster of this many CTAs
/// of `SPLIT_NORM_THREADS`, each thread keeping at most 8 values.
const NORM_SPLIT: usize = 8;
const SPLIT_NORM_THREADS: u32 = 128;
const MAX_SPLIT_NORM_WIDTH: usize = NORM_SPLIT * SPLIT_NORM_THREADS as usize * 8;
/// Steps of at most this many rows take the split norms where they are loaded (`MLA_NORM_SPLIT_MAX_ROWS`
/// overrides it at load for A/B runs; 0 keeps one CTA per row everywhere). Run S32 (H200, launches
/// back to back): at hidden 7168 the split kernel takes 3.4-3.9 us from 1 to 32 rows against
/// 5.5-6.6 for one CTA per row, 4.5 against 6.7 at 64, 10.9 against 8.3 at 256; at 2048 the
/// two are even up to 64 rows.
pub const NORM_SPLIT_MAX_ROWS: usize = 64;

/// The split norms, loaded from the sm_90a cubin only (clusters).
struct SplitNorms {
    rmsnorm_f32: Kernel,
    add_rmsnorm: Kernel,
    add_rmsnorm_f32_delta: Kernel,
    max_rows: usize,
}

pub struct ElementwiseKernels {
    embedding_gather: Kernel,
    rmsnorm_f32: Kernel,
    add_rmsnorm: Kernel,
    add_rmsnorm_f32_delta: Kernel,
    rmsnorm_bf16: Kernel,
    silu_mul: Kernel,
    bf16_to_f32: Kernel,
    fill_normal_bf16: Kernel,
    fill_normal_f32: Kernel,
    gather_rows: Kernel,
    sm_count: usize,
    split: Option<SplitNorms>,
}

/// Distribution of a random fill: `mean + std * N(0, 1)`.
#[derive(Debug, Clone, Copy)]
pub struct Normal {
    pub mean: f32,
    pub std: f32,
    pub seed: u64,
}

/// `out[t] = table[ids[t]]` for `tokens` rows of `hidden` (f32 out: the residual stream).
pub struct Embedding<'a> {
    /// `[vocab, hidden]`.
    pub table: DSlice<'a, bf16>,
    pub vocab: usize,
    pub ids: DSlice<'a, i32>,
    pub out: DSlice<'a, f32>,
    pub tokens: usize,
    pub hidden: usize,
}

/// `out = rmsnorm(x) * weight` over `rows` f32 rows of `hidden` (the first layer's input norm).
pub struct RmsNormF32<'a> {
    pub x: DSlice<'a, f32>,
    pub weight: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// `residual += delta; out = rmsnorm(residual) * weight` (every later norm of the decoder).
pub struct AddRmsNorm<'a> {
    pub residual: DSlice<'a, f32>,
    pub delta: NormDelta<'a>,
    pub weight: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// What `add_rmsnorm` adds to the residual: a block's bf16 output, or (tensor parallel) the f32
/// sum of the ranks' partial outputs.
#[derive(Clone, Copy)]
pub enum NormDelta<'a> {
    Bf16(DSlice<'a, bf16>),
    F32(DSlice<'a, f32>),
}

/// RMSNorm of `rows` strided bf16 rows of `width` (q_a_layernorm).
pub struct RmsNormBf16<'a> {
    pub x: DSlice<'a, bf16>,
    pub x_stride: usize,
    pub weight: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
    pub out_stride: usize,
    pub rows: usize,
    pub width: usize,
    pub eps: f32,
}

impl ElementwiseKernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let k = |name| m.kernel("elementwise", name);
        Ok(ElementwiseKernels {
            embedding_gather: k("embedding_gather")?,
            rmsnorm_f32: k("rmsnorm_f32")?,
            add_rmsnorm: k("add_rmsnorm")?,
            add_rmsnorm_f32_delta: k("add_rmsnorm_f32_delta")?,
            rmsnorm_bf16: k("rmsnorm_bf16")?,
            silu_mul: k("silu_mul")?,
            bf16_to_f32: k("bf16_to_f32")?,
            fill_normal_bf16: k("fill_normal_bf16")?,
            fill_normal_f32: k("fill_normal_f32")?,
            gather_rows: k("gather_rows")?,
            sm_count: info.sm_count,
            split: match m.used_ptx {
                true => None,
                false => Some(SplitNorms {
                    rmsnorm_f32: k("rmsnorm_f32_split")?,
                    add_rmsnorm: k("add_rmsnorm_split")?,
                    add_rmsnorm_f32_delta: k("add_rmsnorm_f32_delta_split")?,
                    max_rows: count_knob("MLA_NORM_SPLIT_MAX_ROWS", NORM_SPLIT_MAX_ROWS)?,
                }),
            },
        })
    }

    /// Whether a norm of `rows` rows of `hidden` takes the split kernels.
    pub fn splits_norm(&self, rows: usize, hidden: usize) -> bool {
        self.split.as_ref().is_some_and(|sp| rows <= sp.max_rows)
            && hidden.is_multiple_of(NORM_SPLIT)
            && hidden <= MAX_SPLIT_NORM_WIDTH
    }

    /// Launches a norm kernel over `rows` rows of `hidden`: `split`, a cluster per row, where the
    /// caller chose it, else `row`, one CTA per row.
    fn launch_norm(
        &self,
        s: CUstream,
        row: &Kernel,
        split: Option<&Kernel>,
        rows: usize,
        hidden: usize,
        args: &[Arg],
    ) -> anyhow::Result<()> {
        match split {
            Some(k) => {
                anyhow::ensure!(
                    hidden.is_multiple_of(NORM_SPLIT) && hidden <= MAX_SPLIT_NORM_WIDTH,
                    "hidden size {hidden} does not split over {NORM_SPLIT} CTAs of at most {} values",
                    MAX_SPLIT_NORM_WIDTH / NORM_SPLIT
                );
                let grid = (NORM_SPLIT as u32, rows as u32, 1);
                k.launch_cluster(s, grid, SPLIT_NORM_THREADS, 0, NORM_SPLIT as u32, args)?
            }
            None => row.launch(s, (rows as u32, 1, 1), ROW_THREADS, 0, args)?,
        }
        Ok(())
    }

    pub fn embedding(&self, s: CUstream, p: &Embedding) -> anyhow::Result<()> {
        ensure_len!(p.table, p.vocab * p.hidden, "embedding table");
        ensure_len!(p.ids, p.tokens, "token ids");
        ensure_len!(p.out, p.tokens * p.hidden, "residual");
        self.embedding_gather.launch(
            s,
            (p.tokens as u32, 1, 1),
            ROW_THREADS,
            0,
            &[Arg::Ptr(p.table.ptr), Arg::Ptr(p.ids.ptr), Arg::Ptr(p.out.ptr), Arg::I32(p.hidden as i32)],
        )?;
        Ok(())
    }

    pub fn rmsnorm_f32(&self, s: CUstream, p: &RmsNormF32) -> anyhow::Result<()> {
        anyhow::ensure!(
            p.hidden <= MAX_NORM_WIDTH,
            "hidden size {} above the norm kernel's {MAX_NORM_WIDTH}",
            p.hidden
        );
        ensure_len!(p.x, p.rows * p.hidden, "rmsnorm input");
        ensure_len!(p.weight, p.hidden, "rmsnorm weight");
        ensure_len!(p.out, p.rows * p.hidden, "rmsnorm output");
        let split = self.split.as_ref().map(|sp| &sp.rmsnorm_f32);
        let args = [
            Arg::Ptr(p.x.ptr),
            Arg::Ptr(p.weight.ptr),
            Arg::Ptr(p.out.ptr),
            Arg::I32(p.hidden as i32),
            Arg::F32(p.eps),
        ];
        let use_split = self.splits_norm(p.rows, p.hidden);
        self.launch_norm(s, &self.rmsnorm_f32, split.filter(|_| use_split), p.rows, p.hidden, &args)
    }

    pub fn add_rmsnorm(&self, s: CUstream, p: &AddRmsNorm) -> anyhow::Result<()> {
        self.add_rmsnorm_as(s, p, self.splits_norm(p.rows, p.hidden))
    }

    /// `add_rmsnorm` with the kernel chosen by the caller (`split`: the cluster kernels, which
    /// must be loaded; benchmarks compare the two).
    pub fn add_rmsnorm_as(&self, s: CUstream, p: &AddRmsNorm, split: bool) -> anyhow::Result<()> {
        anyhow::ensure!(!split || self.split.is_some(), "the split norm kernels need the sm_90a cubin");
        anyhow::ensure!(
            p.hidden <= MAX_NORM_WIDTH,
            "hidden size {} above the norm kernel's {MAX_NORM_WIDTH}",
            p.hidden
        );
        ensure_len!(p.residual, p.rows * p.hidden, "residual");
        ensure_len!(p.weight, p.hidden, "rmsnorm weight");
        ensure_len!(p.out, p.rows * p.hidden, "rmsnorm output");
        let sp = self.split.as_ref();
        let (kernel, split_kernel, delta) = match p.delta {
            NormDelta::Bf16(d) => {
                ensure_len!(d, p.rows * p.hidden, "residual delta");
                (&self.add_rmsnorm, sp.map(|k| &k.add_rmsnorm), d.ptr)
            }
            NormDelta::F32(d) => {
                ensure_len!(d, p.rows * p.hidden, "residual delta");
                (&self.add_rmsnorm_f32_delta, sp.map(|k| &k.add_rmsnorm_f32_delta), d.ptr)
            }
        };
        let args = [
            Arg::Ptr(p.residual.ptr),
            Arg::Ptr(delta),
            Arg::Ptr(p.weight.ptr),
            Arg::Ptr(p.out.ptr),
            Arg::I32(p.hidden as i32),
            Arg::F32(p.eps),
        ];
        self.launch_norm(s, kernel, split_kernel.filter(|_| split), p.rows, p.hidden, &args)
    }

    pub fn rmsnorm_bf16(&self, s: CUstream, p: &RmsNormBf16) -> anyhow::Result<()> {
        let n = p.width;
        anyhow::ensure!(
            p.x_stride >= n && p.out_stride >= n,
            "rmsnorm_bf16: strides {}/{} below width {n}",
            p.x_stride,
            p.out_stride
        );
        if p.rows == 0 {
            return Ok(());
        }
        ensure_len!(p.x, (p.rows - 1) * p.x_stride + n, "rmsnorm_bf16 input");
        ensure_len!(p.weight, n, "rmsnorm_bf16 weight");
        ensure_len!(p.out, (p.rows - 1) * p.out_stride + n, "rmsnorm_bf16 output");
        self.rmsnorm_bf16.launch(
            s,
            (p.rows as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(p.x.ptr),
                Arg::I32(p.x_stride as i32),
                Arg::Ptr(p.weight.ptr),
                Arg::Ptr(p.out.ptr),
                Arg::I32(p.out_stride as i32),
                Arg::I32(n as i32),
                Arg::F32(p.eps),
            ],
        )?;
        Ok(())
    }

    /// `out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:]`.
    pub fn silu_mul(
        &self,
        s: CUstream,
        gate_up: DSlice<bf16>,
        out: DSlice<bf16>,
        rows: usize,
        inter: usize,
    ) -> anyhow::Result<()> {
        ensure_len!(gate_up, rows * 2 * inter, "silu_mul input");
        ensure_len!(out, rows * inter, "silu_mul output");
        let total = rows * inter;
        self.silu_mul.launch(
            s,
            (grid_for(self.sm_count, total, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(gate_up.ptr), Arg::Ptr(out.ptr), Arg::I32(inter as i32), Arg::I64(total as i64)],
        )?;
        Ok(())
    }

    pub fn bf16_to_f32(&self, s: CUstream, x: DSlice<bf16>, y: DSlice<f32>, n: usize) -> anyhow::Result<()> {
        ensure_len!(x, n, "conversion input");
        ensure_len!(y, n, "conversion output");
        self.bf16_to_f32.launch(
            s,
            (grid_for(self.sm_count, n, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::I64(n as i64)],
        )?;
        Ok(())
    }

    pub fn fill_normal_bf16(&self, s: CUstream, out: DSlice<bf16>, d: Normal) -> anyhow::Result<()> {
        self.fill_normal(s, &self.fill_normal_bf16, out.ptr, out.len, d)
    }

    pub fn fill_normal_f32(&self, s: CUstream, out: DSlice<f32>, d: Normal) -> anyhow::Result<()> {
        self.fill_normal(s, &self.fill_normal_f32, out.ptr, out.len, d)
    }

    fn fill_normal(&self, s: CUstream, kernel: &Kernel, ptr: u64, len: usize, d: Normal) -> anyhow::Result<()> {
        kernel.launch(
            s,
            (grid_for(self.sm_count, len, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(ptr), Arg::I64(len as i64), Arg::U64(d.seed), Arg::F32(d.mean), Arg::F32(d.std)],
        )?;
        Ok(())
    }

    /// `out[i] = x[idx[i]]` for `rows` rows of `width` bf16 values (width % 8 == 0): latent rows
    /// of the cache by slot, token rows of the MoE input by routed assignment, hidden rows of the
    /// output head by logits request.
    pub fn gather_rows(
        &self,
        s: CUstream,
        x: DSlice<bf16>,
        idx: DSlice<i32>,
        out: DSlice<bf16>,
        rows: usize,
        width: usize,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(width.is_multiple_of(8), "row width {width} is not a multiple of 8");
        ensure_len!(idx, rows, "row indices");
        ensure_len!(out, rows * width, "gathered rows");
        self.gather_rows.launch(
            s,
            (grid_for(self.sm_count, rows * width / 8, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(x.ptr), Arg::Ptr(idx.ptr), Arg::Ptr(out.ptr), Arg::I32(rows as i32), Arg::I32(width as i32)],
        )?;
        Ok(())
    }
}
