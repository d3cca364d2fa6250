//! Rotary position embedding with DeepSeek's YaRN context extension: the numbers both backends
//! derive from the parsed `rope_scaling` (inverse frequencies, the cos/sin multiplier and the
//! softmax-scale correction). Formulas as HF transformers 5.17 computes them; `ModelConfig`'s
//! `rope_inv_freq`, `rope_attention_factor` and `softmax_scale` are the front door.

/// DeepSeek YaRN parameters, with HF transformers' defaults and semantics.
#[derive(Debug, Clone, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub original_max_position_embeddings: usize,
    /// Explicit cos/sin multiplier; inferred from the mscales when absent.
    pub attention_factor: Option<f64>,
    /// Round the correction range to whole dimensions (DeepSeek's behaviour, HF's default).
    pub truncate: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Yarn(YarnScaling),
}

/// YaRN magnitude correction `0.1·m·ln(scale) + 1` (1 when not extending).
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The factor the softmax scale is multiplied by: `mscale(factor, mscale_all_dim)²` under YaRN
/// with a non-zero `mscale_all_dim` (HF `yarn_apply_mscale`), else 1.
pub fn softmax_mscale_squared(scaling: &RopeScaling) -> f64 {
    match scaling {
        RopeScaling::Yarn(YarnScaling { factor, mscale_all_dim: Some(m), .. }) if *m != 0.0 => {
            let s = yarn_get_mscale(*factor, *m);
            s * s
        }
        _ => 1.0,
    }
}

/// Multiplier applied to RoPE cos/sin (HF's `attention_scaling`).
pub fn attention_factor(scaling: &RopeScaling) -> f64 {
    match scaling {
        RopeScaling::None => 1.0,
        RopeScaling::Yarn(y) => match y.attention_factor {
            Some(a) => a,
            None => match (y.mscale, y.mscale_all_dim) {
                (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                    yarn_get_mscale(y.factor, m) / yarn_get_mscale(y.factor, ma)
                }
                _ => yarn_get_mscale(y.factor, 1.0),
            },
        },
    }
}

/// Inverse frequencies of the `dim / 2` rotated pairs, blended between interpolation and
/// extrapolation by YaRN's linear ramp over the correction range `beta_fast .. beta_slow`.
pub fn inv_freq(scaling: &RopeScaling, dim: usize, theta: f64) -> Vec<f32> {
    let pos_freq = |i: usize| theta.powf((2 * i) as f64 / dim as f64);
    let half = dim / 2;
    match scaling {
        RopeScaling::None => (0..half).map(|i| (1.0 / pos_freq(i)) as f32).collect(),
        RopeScaling::Yarn(y) => {
            let correction_dim = |rotations: f64| {
                dim as f64 * (y.original_max_position_embeddings as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
            if y.truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(dim as f64 - 1.0);
            if low == high {
                high += 0.001;
            }
            (0..half)
                .map(|i| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let inv_extra = 1.0 / pos_freq(i);
                    let inv_inter = 1.0 / (y.factor * pos_freq(i));
                    (inv_inter * (1.0 - extrapolation) + inv_extra * extrapolation) as f32
                })
                .collect()
        }
    }
}
