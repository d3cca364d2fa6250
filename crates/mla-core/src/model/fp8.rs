//! FP8 (E4M3, "fn" variant: no infinities, 0x7f/0xff are NaN) decoding and the block-wise
//! dequantization DeepSeek-V3 checkpoints need: `w[r][c] = fp8[r][c] * scale_inv[r / br][c / bc]`
//! with one fp32 scale per `br x bc` block; edge blocks may be partial. Also the inverse, the
//! block quantizer `--quantization fp8` applies to bf16 checkpoints, with DeepSeek's recipe
//! (`scale_inv = amax / 448` per block, `fp8 = e4m3(w / scale_inv)`), bit-exact with PyTorch's
//! `.to(torch.float8_e4m3fn)` and with the CUDA backend's device quantizer.

use crate::model::parallel::Shard;
use crate::model::weight_source::Fp8Tensor;

/// The largest finite E4M3FN value.
pub const E4M3_MAX: f32 = 448.0;

pub use crate::model::config::DEEPSEEK_BLOCK;

/// Decodes one E4M3FN byte: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits.
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0f) as i32;
    let man = (byte & 0x07) as f32;
    if exp == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: 0.mmm * 2^-6.
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// Encodes `x` as E4M3FN, rounding to nearest with ties to even and saturating to ±448 (as CUDA's
/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`; PyTorch gives the same bytes for the
/// values its quantizers clamp to ±448 first). NaN encodes as 0x7f.
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Subnormals (and the boundary below the smallest normal 2^-6) are multiples of 2^-9: round
    // a * 2^9 to an integer, ties to even (0..=8; 8 is the smallest normal, byte 0x08).
    if a < 2f32.powi(-6) {
        let q = round_half_even(a * 512.0) as u8;
        return sign | q;
    }
    // Normal: a = 2^e * (1 + m/8); quantise the mantissa at 2^(e-3). Rounding up may carry into
    // the next exponent, which the byte arithmetic handles (mantissa 8 -> exponent + 1).
    let e = a.log2().floor() as i32;
    let e = if 2f32.powi(e) > a {
        e - 1
    } else if 2f32.powi(e + 1) <= a {
        e + 1
    } else {
        e
    };
    let steps = round_half_even(a / 2f32.powi(e - 3)) as u32; // 8..=16
    let byte = (((e + 7) as u32) << 3) + (steps - 8);
    sign | byte.min(0x7e) as u8
}

fn round_half_even(v: f32) -> f32 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - v.signum()
    } else {
        r
    }
}

/// Block-quantizes a row-major `[rows, cols]` weight: per `block` tile `scale_inv = amax / 448`
/// (an all-zero tile gets `amax` 1e-12, as DeepSeek's and the fixtures' recipe clamps it), then
/// `fp8 = e4m3(w / scale_inv)` with f32 division.
pub fn quantize_block_fp8(w: &[f32], rows: usize, cols: usize, block: [usize; 2]) -> Fp8Tensor {
    assert_eq!(w.len(), rows * cols, "weight size");
    let [grid_rows, grid_cols] = scale_grid(rows, cols, block);
    let mut scale_inv = vec![0f32; grid_rows * grid_cols];
    for (r, row) in w.chunks(cols.max(1)).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            let s = &mut scale_inv[(r / block[0]) * grid_cols + c / block[1]];
            *s = s.max(x.abs());
        }
    }
    for s in scale_inv.iter_mut() {
        *s = s.max(1e-12) / E4M3_MAX;
    }
    let data = w
        .iter()
        .enumerate()
        .map(|(i, &x)| f32_to_fp8_e4m3(x / scale_inv[(i / cols / block[0]) * grid_cols + (i % cols) / block[1]]))
        .collect();
    Fp8Tensor { data, rows, cols, scale_inv, block }
}

impl Fp8Tensor {
    /// The tensor in f32: each byte's value times its block's scale (one f32 multiply).
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_block_fp8(&self.data, self.rows, self.cols, &self.scale_inv, self.block)
    }

    /// The part `shard` of this tensor with the scales that cover it. Only cuts on block
    /// boundaries keep the blocks intact; any other cut is an error naming the boundary.
    pub fn shard(&self, shard: &Shard) -> Result<Fp8Tensor, String> {
        let [grid_rows, grid_cols] = scale_grid(self.rows, self.cols, self.block);
        let full = [self.rows, self.cols];
        match shard {
            Shard::Whole => Ok(self.clone()),
            Shard::Rows(r) => {
                if !shard.on_blocks(&full, self.block[0]) {
                    return Err(format!(
                        "rows {r:?} of {} do not fall on {}-row scale blocks",
                        self.rows, self.block[0]
                    ));
                }
                let g = r.start / self.block[0]..r.end.div_ceil(self.block[0]);
                Ok(Fp8Tensor {
                    data: self.data[r.start * self.cols..r.end * self.cols].to_vec(),
                    rows: r.len(),
                    cols: self.cols,
                    scale_inv: self.scale_inv[g.start * grid_cols..g.end * grid_cols].to_vec(),
                    block: self.block,
                })
            }
            Shard::Cols(c) => {
                if !shard.on_blocks(&full, self.block[1]) {
                    return Err(format!(
                        "columns {c:?} of {} do not fall on {}-column scale blocks",
                        self.cols, self.block[1]
                    ));
                }
                let g = c.start / self.block[1]..c.end.div_ceil(self.block[1]);
                Ok(Fp8Tensor {
                    data: shard.take(&self.data, &full),
                    rows: self.rows,
                    cols: c.len(),
                    scale_inv: Shard::Cols(g).take(&self.scale_inv, &[grid_rows, grid_cols]),
                    block: self.block,
                })
            }
        }
    }
}

/// Number of scale blocks along each axis of a `[rows, cols]` weight.
pub fn scale_grid(rows: usize, cols: usize, block: [usize; 2]) -> [usize; 2] {
    [rows.div_ceil(block[0]), cols.div_ceil(block[1])]
}

/// Dequantizes a row-major `[rows, cols]` E4M3 weight with its `scale_grid` of fp32 scales.
/// Panics if the slices do not have the sizes the shape implies (callers check shapes first
/// and report them by tensor name).
pub fn dequantize_block_fp8(data: &[u8], rows: usize, cols: usize, scale_inv: &[f32], block: [usize; 2]) -> Vec<f32> {
    let [_, grid_cols] = scale_grid(rows, cols, block);
    assert_eq!(data.len(), rows * cols, "fp8 data size");
    assert_eq!(scale_inv.len(), rows.div_ceil(block[0]) * grid_cols, "fp8 scale grid size");
    let table: Vec<f32> = (0..=255u8).map(fp8_e4m3_to_f32).collect();
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let scales = &scale_inv[(r / block[0]) * grid_cols..][..grid_cols];
        for (c, &b) in data[r * cols..(r + 1) * cols].iter().enumerate() {
            out.push(table[b as usize] * scales[c / block[1]]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_representative_bytes() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x3c), 1.5); // man 4 -> 1 + 4/8
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert!(fp8_e4m3_to_f32(0x7f).is_nan() && fp8_e4m3_to_f32(0xff).is_nan());
        assert_eq!(fp8_e4m3_to_f32(0x78), 256.0); // exp 15 is an ordinary exponent in E4M3FN
    }

    #[test]
    fn dequantizes_partial_edge_blocks() {
        // A 3x5 weight with 2x2 blocks: a 2x3 grid whose last row and column are partial.
        let data = [
            0x38, 0x40, 0x38, 0x38, 0x3c, //
            0xb8, 0x00, 0x40, 0x38, 0x38, //
            0x38, 0x38, 0x38, 0xb8, 0x40,
        ];
        let scales = [0.5, 2.0, 10.0, -1.0, 3.0, 0.25];
        let w = dequantize_block_fp8(&data, 3, 5, &scales, [2, 2]);
        // Hand-computed: values 1, 2, 1, 1, 1.5 / -1, 0, 2, 1, 1 / 1, 1, 1, -1, 2 times their block scale.
        let expected = [
            0.5, 1.0, 2.0, 2.0, 15.0, //
            -0.5, 0.0, 4.0, 2.0, 10.0, //
            -1.0, -1.0, 3.0, -3.0, 0.5,
        ];
        assert_eq!(w, expected);
    }
}

#[cfg(test)]
mod quantize_tests {
    use super::*;

    /// Every finite byte decodes and re-encodes to itself (0x80, negative zero, included).
    #[test]
    fn encoder_inverts_the_decoder_on_every_finite_byte() {
        for b in 0..=255u8 {
            if b & 0x7f == 0x7f {
                continue;
            }
            assert_eq!(f32_to_fp8_e4m3(fp8_e4m3_to_f32(b)), b, "byte {b:#04x}");
        }
    }

    /// Midpoints between neighbouring codes round to the even code; just above or below, to the
    /// nearer one; past 448 saturates (PyTorch's quantizers clamp to ±448 before casting).
    #[test]
    fn encoder_rounds_to_nearest_even_and_saturates() {
        for b in 0..0x7eu8 {
            let (lo, hi) = (fp8_e4m3_to_f32(b), fp8_e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_fp8_e4m3(mid), even, "midpoint of {b:#04x} and {:#04x}", b + 1);
            assert_eq!(f32_to_fp8_e4m3(-mid), 0x80 | even);
            let nudge = (hi - lo) / 64.0;
            assert_eq!(f32_to_fp8_e4m3(mid - nudge), b);
            assert_eq!(f32_to_fp8_e4m3(mid + nudge), b + 1);
        }
        assert_eq!(f32_to_fp8_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(-464.0), 0xfe);
        assert_eq!(f32_to_fp8_e4m3(2f32.powi(-11)), 0); // below half the smallest subnormal
        assert_eq!(f32_to_fp8_e4m3(f32::NAN), 0x7f);
    }

    #[test]
    fn quantizer_follows_deepseeks_recipe_with_partial_blocks() {
        // 3 x 5 with 2 x 2 blocks: amax per block, scale amax / 448, the block's max maps to 448.
        let w: Vec<f32> = (0..15).map(|i| (i as f32 - 7.0) * 0.37).collect();
        let q = quantize_block_fp8(&w, 3, 5, [2, 2]);
        assert_eq!(q.scale_inv.len(), 6);
        let amax00 = [w[0], w[1], w[5], w[6]].iter().fold(0f32, |m, x| m.max(x.abs()));
        assert_eq!(q.scale_inv[0], amax00 / 448.0);
        assert_eq!(q.data[0], 0xfe); // w[0] is the block's largest magnitude, negative
        let back = q.dequantize();
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-6, "{a} vs {b}");
        }
        // An all-zero block gets a tiny positive scale, never 0 (no division by zero).
        let z = quantize_block_fp8(&[0.0; 4], 2, 2, [2, 2]);
        assert!(z.scale_inv[0] > 0.0 && z.data.iter().all(|&b| b == 0));
    }

    #[test]
    fn shards_cut_on_block_boundaries_only() {
        let w: Vec<f32> = (0..6 * 10).map(|i| i as f32).collect();
        let q = quantize_block_fp8(&w, 6, 10, [2, 4]);
        let rows = q.shard(&Shard::Rows(2..6)).unwrap();
        assert_eq!(rows.dequantize(), Shard::Rows(2..6).take(&q.dequantize(), &[6, 10]));
        let cols = q.shard(&Shard::Cols(4..10)).unwrap(); // the partial last block included
        assert_eq!(cols.dequantize(), Shard::Cols(4..10).take(&q.dequantize(), &[6, 10]));
        assert!(q.shard(&Shard::Rows(1..3)).unwrap_err().contains("scale blocks"));
        assert!(q.shard(&Shard::Cols(0..6)).is_err());
    }
}
