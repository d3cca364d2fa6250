//! The FP8 latent cache format (`--kv-cache-dtype fp8`): one cached token of one layer,
//! `[c_kv ; k_pe]` (576 values for every published DeepSeek model), stored as E4M3FN bytes with
//! one power-of-two scale per group of 64 columns, in rows of 592 bytes (1,152 in bf16: 1.95x
//! the tokens in the same memory):
//!
//! ```text
//! bytes [0, 576)    e4m3 codes of the 576 values
//! bytes [576, 585)  the 9 groups' scale exponents (group g = columns [64g, 64g + 64))
//! bytes [585, 592)  zero (rows stay 16-byte aligned for the GPU's vector loads)
//! ```
//!
//! Why these choices (accuracy measured in `docs/performance.md`, "FP8 latent cache"):
//! - Power-of-two scales (a byte `e`, scale `2^(e - 127)`, E8M0's encoding): a code times its
//!   scale is exact in bf16 and f32, so the decode kernel's dequantized keys equal the CPU
//!   reference's bit for bit, and E4M3's relative precision does not depend on the scale at all;
//!   only the top binade's headroom is given up (the group's largest value maps into (224, 448]).
//! - Groups of 64 columns: the nine exponents fit in the 16 bytes of padding the row needs anyway,
//!   so finer groups than vLLM's per-128 cost nothing, and the rope part (the last 64 columns)
//!   gets a scale of its own instead of sharing one with c_kv of a different magnitude.
//! - The rope part in FP8 too: bf16 k_pe would make rows of 656 bytes (1.76x, not 1.95x).
//! - Scales up to 2^7 ([`MAX_EXPONENT`]): values beyond ±57,344 saturate, so that the decode
//!   kernel dequantizes 16 codes with eight bf16 multiplies and no second path.
//!
//! Both backends quantize with these functions' arithmetic (the CUDA write in
//! `kernels/latent_cache.cu`), and the GPU tests hold the two to the same bytes.

use super::fp8::{f32_to_fp8_e4m3, fp8_e4m3_to_f32};

/// Columns per scale group.
pub const GROUP: usize = 64;

/// What the latent cache stores: vLLM's `--kv-cache-dtype` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The compute dtype (bf16 on the GPU, f32 in the CPU reference).
    #[default]
    Auto,
    /// E4M3 codes with per-group power-of-two scales (this module's format).
    Fp8E4m3,
}

impl KvCacheDtype {
    /// vLLM's spellings: `auto`, `bfloat16` (the CUDA backend's compute dtype: the server refuses
    /// it on the CPU), `fp8`, `fp8_e4m3`; `fp8_e5m2` and the others are refused.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "bfloat16" => Ok(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8E4m3),
            "fp8_e5m2" => Err("--kv-cache-dtype fp8_e5m2: only fp8 (fp8_e4m3) is implemented; e5m2 keeps one \
                               mantissa bit less for a range the per-group scales already give"
                .into()),
            other => Err(format!("--kv-cache-dtype {other}: expected auto, fp8 or fp8_e4m3 (bfloat16 on cuda)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    pub fn is_fp8(self) -> bool {
        self == KvCacheDtype::Fp8E4m3
    }
}

/// Scale groups of a row of `dim` values.
pub fn groups(dim: usize) -> usize {
    dim.div_ceil(GROUP)
}

/// Bytes of one FP8 row of `dim` values: the codes, one exponent per group, padded to 16.
pub fn row_bytes(dim: usize) -> usize {
    (dim + groups(dim)).div_ceil(16) * 16
}

/// The largest exponent byte: scales up to 2^7, so a group's values saturate at ±57,344
/// (448 * 2^7). The decode kernel dequantizes with one bf16 multiply by 2^(120 + k), which is a
/// bf16 value only for k <= 7; cached latents of the published models stay far below (c_kv is
/// normalized, k_pe a projection of a normalized hidden state).
pub const MAX_EXPONENT: u8 = 127 + 7;
/// Where values saturate.
pub const MAX_VALUE: f32 = 448.0 * 128.0;

/// The scale exponent byte of a group whose largest magnitude is `amax`: the smallest power of
/// two `2^k` with `amax / 2^k <= 448`, as `k + 127`, clamped to [1, MAX_EXPONENT] (so that the
/// scale, its inverse and the decode kernel's factor are normal). Integer arithmetic on the bits
/// (no log2), so the CUDA quantizer computes the same byte: with `amax = 1.m * 2^(E-127)`,
/// `amax <= 448 * 2^k` holds for `k = E - 135` when `1.m <= 1.75` (448 = 1.75 * 2^8) and needs
/// one more otherwise.
pub fn scale_exponent(amax: f32) -> u8 {
    if amax.is_nan() || amax <= 0.0 {
        return 127;
    }
    let bits = amax.to_bits();
    let (exp, man) = ((bits >> 23) & 0xff, bits & 0x7f_ffff);
    let e = exp as i32 - 8 + i32::from(man > 0x60_0000);
    e.clamp(1, MAX_EXPONENT as i32) as u8
}

/// `2^(e - 127)`.
pub fn scale_of(e: u8) -> f32 {
    f32::from_bits((e as u32) << 23)
}

/// Quantizes one row of values into `out` (`row_bytes(row.len())` bytes).
pub fn quantize_row(row: &[f32], out: &mut [u8]) {
    let dim = row.len();
    assert_eq!(out.len(), row_bytes(dim), "fp8 latent row width");
    out.fill(0);
    for (g, chunk) in row.chunks(GROUP).enumerate() {
        let amax = chunk.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let e = scale_exponent(amax);
        let inv = f32::from_bits((254 - e as u32) << 23); // 2^(127 - e), exact
        for (j, &x) in chunk.iter().enumerate() {
            out[g * GROUP + j] = f32_to_fp8_e4m3(x * inv);
        }
        out[dim + g] = e;
    }
}

/// The values of one FP8 row of `out.len()` values (exact: code times a power of two).
pub fn dequantize_row(bytes: &[u8], out: &mut [f32]) {
    let dim = out.len();
    assert_eq!(bytes.len(), row_bytes(dim), "fp8 latent row width");
    for (g, chunk) in out.chunks_mut(GROUP).enumerate() {
        let s = scale_of(bytes[dim + g]);
        for (j, y) in chunk.iter_mut().enumerate() {
            *y = fp8_e4m3_to_f32(bytes[g * GROUP + j]) * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SplitMix64;

    #[test]
    fn rows_of_the_published_dims_are_592_bytes() {
        assert_eq!(groups(576), 9);
        assert_eq!(row_bytes(576), 592);
        assert_eq!(row_bytes(16 + 4), 32); // the tiny test models: 20 codes + 1 exponent
    }

    #[test]
    fn the_exponent_is_the_smallest_that_fits() {
        for &amax in &[448.0f32, 449.0, 1.0, 0.875, 1.75, 1.7500001, 3.0e-3, 12345.0, MAX_VALUE, 1e-30] {
            let e = scale_exponent(amax);
            let s = scale_of(e);
            assert!(amax / s <= 448.0, "{amax}: scale {s} too small");
            assert!(amax / (s / 2.0) > 448.0 || e == 1, "{amax}: scale {s} not the smallest");
        }
        assert_eq!(scale_exponent(448.0), 127);
        assert_eq!(scale_exponent(449.0), 128);
        assert_eq!(scale_exponent(0.0), 127);
        // Beyond the largest scale, values saturate at MAX_VALUE.
        assert_eq!(scale_exponent(MAX_VALUE * 1.01), MAX_EXPONENT);
        assert_eq!(scale_exponent(f32::INFINITY), MAX_EXPONENT);
        let mut bytes = vec![0u8; row_bytes(2)];
        quantize_row(&[1e6, -3.0], &mut bytes);
        let mut back = [0f32; 2];
        dequantize_row(&bytes, &mut back);
        assert_eq!(back[0], MAX_VALUE);
    }

    #[test]
    fn dequantized_values_are_within_e4m3s_rounding() {
        let mut rng = SplitMix64::new(3);
        let dim = 576;
        // Groups of very different magnitudes, as c_kv and k_pe are.
        let row: Vec<f32> =
            (0..dim).map(|i| ((rng.next_f64() * 2.0 - 1.0) * 10f64.powi((i / GROUP) as i32 - 4)) as f32).collect();
        let mut bytes = vec![0u8; row_bytes(dim)];
        quantize_row(&row, &mut bytes);
        assert!(bytes[dim + groups(dim)..].iter().all(|&b| b == 0), "padding must be zero");
        let mut back = vec![0f32; dim];
        dequantize_row(&bytes, &mut back);
        for (g, (a, b)) in row.chunks(GROUP).zip(back.chunks(GROUP)).enumerate() {
            let amax = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (x, y) in a.iter().zip(b) {
                // Half a unit in the last place of 3 mantissa bits, or half the smallest
                // subnormal step (2^-9 of the scale) for the group's small values.
                let bound = (x.abs() / 16.0).max(scale_of(bytes[dim + g]) * 2f32.powi(-10));
                assert!((x - y).abs() <= bound, "group {g}: {x} -> {y} (amax {amax})");
            }
        }
        // Quantizing the dequantized row gives the same bytes (the format is a fixed point).
        let mut again = vec![0u8; row_bytes(dim)];
        quantize_row(&back, &mut again);
        assert_eq!(again, bytes);
    }

    #[test]
    fn dtype_names_follow_vllm() {
        assert_eq!(KvCacheDtype::parse("auto"), Ok(KvCacheDtype::Auto));
        assert_eq!(KvCacheDtype::parse("fp8"), Ok(KvCacheDtype::Fp8E4m3));
        assert_eq!(KvCacheDtype::parse("fp8_e4m3"), Ok(KvCacheDtype::Fp8E4m3));
        assert!(KvCacheDtype::parse("fp8_e5m2").unwrap_err().contains("e5m2"));
        assert!(KvCacheDtype::parse("int8").is_err());
    }
}
