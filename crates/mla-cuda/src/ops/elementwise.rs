//! Embedding, RMSNorm variants, SiLU·mul, conversion and random fills.

use super::{ensure_len, grid_for, Kernels};
use crate::gpu::{Arg, DSlice};
use cudarc::driver::sys::CUstream;
use half::bf16;

const ROW_THREADS: u32 = 256;
/// The norm kernels keep a row in registers: 256 threads x 32 values.
const MAX_NORM_WIDTH: usize = 256 * 32;

/// Distribution of a random fill: `mean + std * N(0, 1)`.
#[derive(Debug, Clone, Copy)]
pub struct Normal {
    pub mean: f32,
    pub std: f32,
    pub seed: u64,
}

impl Kernels {
    /// residual[t] = table[ids[t]] for `tokens` rows.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        s: CUstream,
        table: DSlice<bf16>,
        vocab: usize,
        ids: DSlice<i32>,
        residual: DSlice<f32>,
        tokens: usize,
        hidden: usize,
    ) -> anyhow::Result<()> {
        ensure_len!(table, vocab * hidden, "embedding table");
        ensure_len!(ids, tokens, "token ids");
        ensure_len!(residual, tokens * hidden, "residual");
        self.embedding_gather.launch(
            s,
            (tokens as u32, 1, 1),
            ROW_THREADS,
            0,
            &[Arg::Ptr(table.ptr), Arg::Ptr(ids.ptr), Arg::Ptr(residual.ptr), Arg::I32(hidden as i32)],
        )?;
        Ok(())
    }

    /// out = rmsnorm(residual) * w.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_f32(
        &self,
        s: CUstream,
        residual: DSlice<f32>,
        w: DSlice<bf16>,
        out: DSlice<bf16>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(hidden <= MAX_NORM_WIDTH, "hidden size {hidden} above the norm kernel's {MAX_NORM_WIDTH}");
        ensure_len!(residual, rows * hidden, "rmsnorm input");
        ensure_len!(w, hidden, "rmsnorm weight");
        ensure_len!(out, rows * hidden, "rmsnorm output");
        self.rmsnorm_f32.launch(
            s,
            (rows as u32, 1, 1),
            ROW_THREADS,
            0,
            &[Arg::Ptr(residual.ptr), Arg::Ptr(w.ptr), Arg::Ptr(out.ptr), Arg::I32(hidden as i32), Arg::F32(eps)],
        )?;
        Ok(())
    }

    /// residual += delta; out = rmsnorm(residual) * w.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        s: CUstream,
        residual: DSlice<f32>,
        delta: DSlice<bf16>,
        w: DSlice<bf16>,
        out: DSlice<bf16>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(hidden <= MAX_NORM_WIDTH, "hidden size {hidden} above the norm kernel's {MAX_NORM_WIDTH}");
        ensure_len!(residual, rows * hidden, "residual");
        ensure_len!(delta, rows * hidden, "residual delta");
        ensure_len!(w, hidden, "rmsnorm weight");
        ensure_len!(out, rows * hidden, "rmsnorm output");
        self.add_rmsnorm.launch(
            s,
            (rows as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(residual.ptr),
                Arg::Ptr(delta.ptr),
                Arg::Ptr(w.ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(hidden as i32),
                Arg::F32(eps),
            ],
        )?;
        Ok(())
    }

    /// RMSNorm of `rows` strided bf16 rows of width `n`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bf16(
        &self,
        s: CUstream,
        x: DSlice<bf16>,
        x_stride: usize,
        w: DSlice<bf16>,
        out: DSlice<bf16>,
        out_stride: usize,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            x_stride >= n && out_stride >= n,
            "rmsnorm_bf16: strides {x_stride}/{out_stride} below width {n}"
        );
        if rows == 0 {
            return Ok(());
        }
        ensure_len!(x, (rows - 1) * x_stride + n, "rmsnorm_bf16 input");
        ensure_len!(w, n, "rmsnorm_bf16 weight");
        ensure_len!(out, (rows - 1) * out_stride + n, "rmsnorm_bf16 output");
        self.rmsnorm_bf16.launch(
            s,
            (rows as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(x.ptr),
                Arg::I32(x_stride as i32),
                Arg::Ptr(w.ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(out_stride as i32),
                Arg::I32(n as i32),
                Arg::F32(eps),
            ],
        )?;
        Ok(())
    }

    /// out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:].
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
            (grid_for(self, total, 256), 1, 1),
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
            (grid_for(self, n, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::I64(n as i64)],
        )?;
        Ok(())
    }

    pub fn fill_normal_bf16(&self, s: CUstream, out: DSlice<bf16>, d: Normal) -> anyhow::Result<()> {
        self.fill_normal_bf16.launch(
            s,
            (grid_for(self, out.len, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(out.ptr), Arg::I64(out.len as i64), Arg::U64(d.seed), Arg::F32(d.mean), Arg::F32(d.std)],
        )?;
        Ok(())
    }

    pub fn fill_normal_f32(&self, s: CUstream, out: DSlice<f32>, d: Normal) -> anyhow::Result<()> {
        self.fill_normal_f32.launch(
            s,
            (grid_for(self, out.len, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(out.ptr), Arg::I64(out.len as i64), Arg::U64(d.seed), Arg::F32(d.mean), Arg::F32(d.std)],
        )?;
        Ok(())
    }
}
