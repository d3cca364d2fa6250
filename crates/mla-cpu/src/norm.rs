//! RMSNorm as HF computes it: `w * x / sqrt(mean(x²) + eps)`, in f32.

/// Normalises one vector. Reference for GPU kernels.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    assert_eq!(x.len(), weight.len(), "rms_norm: input and weight lengths differ");
    let mean_sq = x.iter().map(|&v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    x.iter().zip(weight).map(|(&v, &w)| w * (v * inv)).collect()
}

/// Normalises every `weight.len()`-wide row of `x`.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    x.chunks(weight.len()).flat_map(|row| rms_norm(row, weight, eps)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed() {
        // mean(9, 16) = 12.5 -> 1/sqrt(12.5 + 0.5) = 1/sqrt(13).
        let y = rms_norm(&[3.0, -4.0], &[1.0, 2.0], 0.5);
        let s = 13f32.sqrt();
        assert!((y[0] - 3.0 / s).abs() < 1e-6 && (y[1] + 8.0 / s).abs() < 1e-6, "{y:?}");
    }
}
