//! Dense projections and the MLA weight absorption through cuBLAS (bf16 in, f32 accumulate).

use super::dims::{LATENT, NOPE, ROPE, V_HEAD};
use super::ensure_len;
use crate::gpu::{Blas, DSlice, Gemm, GemmOut};
use half::bf16;

/// Rows and columns of one scale block (DeepSeek-V3's `weight_block_size`).
pub const FP8_BLOCK: usize = 128;

/// A block-FP8 weight `[out, inp]` on the device.
#[derive(Clone, Copy)]
pub struct Fp8Linear<'a> {
    pub w: DSlice<'a, u8>,
    /// `[ceil(out / 128), ceil(inp / 128)]`, row-major.
    pub scale_inv: DSlice<'a, f32>,
    pub out: usize,
    pub inp: usize,
}

impl Fp8Linear<'_> {
    /// Checks that the bytes and the scale grid hold the whole `[out, inp]` weight (`what` names
    /// the caller in the error).
    pub fn check(&self, what: &str) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.out > 0 && self.inp > 0 && self.out * self.inp < i32::MAX as usize,
            "{what}: fp8 weight [{}, {}]",
            self.out,
            self.inp
        );
        anyhow::ensure!(
            self.w.len >= self.out * self.inp,
            "{what}: {} bytes for [{}, {}]",
            self.w.len,
            self.out,
            self.inp
        );
        let grid = self.out.div_ceil(FP8_BLOCK) * self.inp.div_ceil(FP8_BLOCK);
        anyhow::ensure!(self.scale_inv.len >= grid, "{what}: {} scales for a grid of {grid}", self.scale_inv.len);
        Ok(())
    }
}

/// An nn.Linear weight `[out, inp]` (row-major, PyTorch layout) on the device.
#[derive(Clone, Copy)]
pub struct Linear<'a> {
    pub w: DSlice<'a, bf16>,
    pub out: usize,
    pub inp: usize,
}

impl<'a> Linear<'a> {
    pub fn new(w: DSlice<'a, bf16>, out: usize, inp: usize) -> Self {
        assert!(w.len >= out * inp, "linear weight holds {} elements, [{out}, {inp}] needs {}", w.len, out * inp);
        Linear { w, out, inp }
    }
}

/// A dense projection's weight as the model holds it: bf16, or block-FP8 as DeepSeek-V3
/// checkpoints (and `--quantization fp8`) give it. Which kernel runs it is `model::small_linear`'s
/// decision.
#[derive(Clone, Copy)]
pub enum Proj<'a> {
    Bf16(Linear<'a>),
    /// `lt_scales`: the scale grid as cuBLASLt's block-scaled GEMM reads it, rows padded to a
    /// multiple of 4 scales (see `fp8_lt_scale_ld`); `w.scale_inv` itself when no padding is due.
    Fp8 {
        w: Fp8Linear<'a>,
        lt_scales: DSlice<'a, f32>,
    },
}

/// Row stride cuBLASLt's BLK128x128 scales have for a weight of `inp` columns: `ceil(inp / 128)`
/// rounded up to a multiple of 4 (16 bytes). With the checkpoint's unpadded grid it reads the
/// wrong scales whenever that count is not a multiple of 4 (K = 256, 10944: H100, cuBLASLt 13.1).
pub fn fp8_lt_scale_ld(inp: usize) -> usize {
    inp.div_ceil(FP8_BLOCK).next_multiple_of(4)
}

impl<'a> Proj<'a> {
    /// An FP8 projection whose scale grid needs no padding for cuBLASLt (panics otherwise).
    pub fn fp8(w: Fp8Linear<'a>) -> Self {
        assert_eq!(fp8_lt_scale_ld(w.inp), w.inp.div_ceil(FP8_BLOCK), "this grid needs a padded copy for cuBLASLt");
        Proj::Fp8 { w, lt_scales: w.scale_inv }
    }

    pub fn out(&self) -> usize {
        match self {
            Proj::Bf16(l) => l.out,
            Proj::Fp8 { w, .. } => w.out,
        }
    }

    pub fn inp(&self) -> usize {
        match self {
            Proj::Bf16(l) => l.inp,
            Proj::Fp8 { w, .. } => w.inp,
        }
    }
}

/// Row-major activations: row `r` starts at element `r * stride` of `data`.
#[derive(Clone, Copy)]
pub struct Strided<'a, T> {
    pub data: DSlice<'a, T>,
    pub stride: usize,
}

impl<'a, T> Strided<'a, T> {
    pub fn new(data: DSlice<'a, T>, stride: usize) -> Self {
        Strided { data, stride }
    }

    /// Elements `rows` rows of `width` need at this stride.
    pub fn need(&self, rows: usize, width: usize) -> usize {
        if rows == 0 {
            0
        } else {
            (rows - 1) * self.stride + width
        }
    }
}

impl Blas {
    /// `y[r, :] = x[r, :] · Wᵀ` for `rows` rows.
    pub fn linear(&self, lin: &Linear, x: Strided<bf16>, rows: usize, y: Strided<bf16>) -> anyhow::Result<()> {
        self.linear_any(lin, x, rows, y, GemmOut::Bf16)
    }

    /// Same with f32 output (logits).
    pub fn linear_f32_out(&self, lin: &Linear, x: Strided<bf16>, rows: usize, y: Strided<f32>) -> anyhow::Result<()> {
        self.linear_any(lin, x, rows, y, GemmOut::F32)
    }

    fn linear_any<T>(
        &self,
        lin: &Linear,
        x: Strided<bf16>,
        rows: usize,
        y: Strided<T>,
        out: GemmOut,
    ) -> anyhow::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let (x_stride, y_stride) = (x.stride, y.stride);
        anyhow::ensure!(
            x_stride >= lin.inp && y_stride >= lin.out,
            "linear [{}, {}]: strides {x_stride}/{y_stride} too small",
            lin.out,
            lin.inp
        );
        ensure_len!(x.data, x.need(rows, lin.inp), "linear input");
        ensure_len!(y.data, y.need(rows, lin.out), "linear output");
        self.gemm(&Gemm {
            trans_a: true,
            trans_b: false,
            m: lin.out,
            n: rows,
            k: lin.inp,
            a: lin.w.ptr,
            lda: lin.inp,
            b: x.data.ptr,
            ldb: x_stride,
            c: y.data.ptr,
            ldc: y_stride,
            f32_inputs: false,
            out,
            batch: None,
        })?;
        Ok(())
    }

    /// f32 `y = x · Wᵀ` with x [rows, inp] and W [out, inp] contiguous (the MoE router, which HF
    /// runs in f32).
    pub fn linear_f32(
        &self,
        w: DSlice<f32>,
        out_features: usize,
        inp: usize,
        x: DSlice<f32>,
        rows: usize,
        y: DSlice<f32>,
    ) -> anyhow::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        ensure_len!(w, out_features * inp, "f32 weight");
        ensure_len!(x, rows * inp, "f32 input");
        ensure_len!(y, rows * out_features, "f32 output");
        self.gemm(&Gemm {
            trans_a: true,
            trans_b: false,
            m: out_features,
            n: rows,
            k: inp,
            a: w.ptr,
            lda: inp,
            b: x.ptr,
            ldb: inp,
            c: y.ptr,
            ldc: out_features,
            f32_inputs: true,
            out: GemmOut::F32,
            batch: None,
        })?;
        Ok(())
    }

    /// Absorbed query: for each head h, `q_lat[b, h] = W_UK[h]ᵀ · q_nope[b, h]`, written to the
    /// first 512 values of each 576-wide row of `q_abs` ([batch, heads, 576]). `q` holds rows of
    /// `heads * 192` ([q_nope 128 | q_pe 64] per head); `kv_b` is kv_b_proj [heads * 256, 512].
    pub fn absorb_q(
        &self,
        kv_b: &Linear,
        heads: usize,
        q: DSlice<bf16>,
        batch: usize,
        q_abs: DSlice<bf16>,
    ) -> anyhow::Result<()> {
        if batch == 0 {
            return Ok(());
        }
        let (qd, d) = (NOPE + ROPE, LATENT + ROPE);
        anyhow::ensure!(
            kv_b.out == heads * (NOPE + V_HEAD) && kv_b.inp == LATENT,
            "kv_b_proj is [{}, {}]",
            kv_b.out,
            kv_b.inp
        );
        ensure_len!(q, batch * heads * qd, "queries");
        ensure_len!(q_abs, batch * heads * d, "absorbed queries");
        // Column-major: q_lat_hᵀ [512, B] = W_UK_hᵀ [512, 128] · q_nope_hᵀ [128, B].
        self.gemm(&Gemm {
            trans_a: false,
            trans_b: false,
            m: LATENT,
            n: batch,
            k: NOPE,
            a: kv_b.w.ptr,
            lda: LATENT,
            b: q.ptr,
            ldb: heads * qd,
            c: q_abs.ptr,
            ldc: heads * d,
            f32_inputs: false,
            out: GemmOut::Bf16,
            batch: Some((heads, (NOPE + V_HEAD) * LATENT, qd, d)),
        })?;
        Ok(())
    }

    /// Absorbed output: `o[b, h] = W_UV[h] · o_lat[b, h]` into rows of `heads * 128`.
    pub fn absorb_o(
        &self,
        kv_b: &Linear,
        heads: usize,
        o_lat: DSlice<bf16>,
        batch: usize,
        o: DSlice<bf16>,
    ) -> anyhow::Result<()> {
        if batch == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            kv_b.out == heads * (NOPE + V_HEAD) && kv_b.inp == LATENT,
            "kv_b_proj is [{}, {}]",
            kv_b.out,
            kv_b.inp
        );
        ensure_len!(o_lat, batch * heads * LATENT, "latent attention output");
        ensure_len!(o, batch * heads * V_HEAD, "attention output");
        // Column-major: o_hᵀ [128, B] = (W_UV_h as [512, 128] col-major)ᵀ · o_lat_hᵀ [512, B].
        self.gemm(&Gemm {
            trans_a: true,
            trans_b: false,
            m: V_HEAD,
            n: batch,
            k: LATENT,
            a: kv_b.w.ptr + (NOPE * LATENT * 2) as u64,
            lda: LATENT,
            b: o_lat.ptr,
            ldb: heads * LATENT,
            c: o.ptr,
            ldc: heads * V_HEAD,
            f32_inputs: false,
            out: GemmOut::Bf16,
            batch: Some((heads, (NOPE + V_HEAD) * LATENT, LATENT, V_HEAD)),
        })?;
        Ok(())
    }
}
