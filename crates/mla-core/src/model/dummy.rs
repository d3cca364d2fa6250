//! Deterministic random weights for any config (`--load-format dummy`, the bundled demo model and
//! tests), served through `WeightSource` like a checkpoint.
//!
//! Each tensor is drawn from its own generator seeded by the source seed and the tensor name, so
//! the values do not depend on load order, on which backend reads them, or on other tensors.
//! Scales keep activations O(1) through any depth: linear weights ~ N(0, 1/fan_in), embeddings
//! ~ N(0, 1), norm gains 1 + N(0, 0.1²), noaux_tc biases ~ N(0, 0.1²) (large enough to change
//! which experts win, so routing tests see them).

use crate::model::weight_source::{CheckpointError, Fp8Tensor, WeightSource};
use crate::model::weights::{TensorRole, TensorSpec};
use crate::rng::SplitMix64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DummyWeights {
    pub seed: u64,
}

impl DummyWeights {
    pub fn new(seed: u64) -> Self {
        DummyWeights { seed }
    }

    /// Seed of one tensor's own stream: the source seed mixed with the tensor name. Backends that
    /// draw dummy weights on a device use it too, so every draw is keyed the same way.
    pub fn tensor_seed(&self, name: &str) -> u64 {
        self.seed ^ fnv1a(name.as_bytes())
    }

    /// Standard-normal stream for one tensor.
    fn normals(&self, name: &str, n: usize) -> Vec<f32> {
        let mut rng = SplitMix64::new(self.tensor_seed(name));
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            // Box-Muller: two independent normals from two uniforms; 1 - u avoids ln(0).
            let u1 = 1.0 - rng.next_f64();
            let u2 = rng.next_f64();
            let r = (-2.0 * u1.ln()).sqrt();
            let t = 2.0 * std::f64::consts::PI * u2;
            out.push((r * t.cos()) as f32);
            out.push((r * t.sin()) as f32);
        }
        out.truncate(n);
        out
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// `(mean, std)` of the normal distribution a tensor is drawn from, by role (see the module doc).
pub fn dummy_distribution(spec: &TensorSpec) -> (f32, f32) {
    let fan_in = *spec.shape.last().unwrap_or(&1) as f32;
    match spec.role {
        TensorRole::Embedding => (0.0, 1.0),
        TensorRole::Linear | TensorRole::LmHead | TensorRole::Router | TensorRole::MtpProjection => {
            (0.0, fan_in.powf(-0.5))
        }
        TensorRole::Norm => (1.0, 0.1),
        TensorRole::Bias => (0.0, 0.1),
    }
}

impl WeightSource for DummyWeights {
    fn describe(&self) -> String {
        format!("dummy weights (seed {})", self.seed)
    }

    fn read_f32(&self, spec: &TensorSpec) -> Result<Vec<f32>, CheckpointError> {
        let (mean, std) = dummy_distribution(spec);
        Ok(self.normals(&spec.name, spec.numel()).into_iter().map(|x| mean + std * x).collect())
    }

    fn read_fp8(&self, _spec: &TensorSpec) -> Result<Option<Fp8Tensor>, CheckpointError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: Vec<usize>, role: TensorRole) -> TensorSpec {
        TensorSpec::new(name.into(), shape, role)
    }

    #[test]
    fn deterministic_per_name_and_seed() {
        let s = spec("a.weight", vec![64, 256], TensorRole::Linear);
        let a = DummyWeights::new(1).read_f32(&s).unwrap();
        assert_eq!(a, DummyWeights::new(1).read_f32(&s).unwrap());
        assert_ne!(a, DummyWeights::new(2).read_f32(&s).unwrap());
        let other = spec("b.weight", vec![64, 256], TensorRole::Linear);
        assert_ne!(a, DummyWeights::new(1).read_f32(&other).unwrap());
    }

    #[test]
    fn scales_follow_roles() {
        let d = DummyWeights::new(7);
        let lin = d.read_f32(&spec("l", vec![128, 1024], TensorRole::Linear)).unwrap();
        let var = lin.iter().map(|x| (x * x) as f64).sum::<f64>() / lin.len() as f64;
        assert!((var * 1024.0 - 1.0).abs() < 0.05, "linear variance {var}");
        let norm = d.read_f32(&spec("n", vec![4096], TensorRole::Norm)).unwrap();
        let mean = norm.iter().map(|&x| x as f64).sum::<f64>() / norm.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "norm mean {mean}");
    }
}
