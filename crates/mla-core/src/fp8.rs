//! FP8 (E4M3, "fn" variant: no infinities, 0x7f/0xff are NaN) decoding and the block-wise
//! dequantization DeepSeek-V3 checkpoints need: `w[r][c] = fp8[r][c] * scale_inv[r / br][c / bc]`
//! with one fp32 scale per `br x bc` block; edge blocks may be partial.

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
