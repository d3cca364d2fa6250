//! A `WeightSource` whose linear weights are block-FP8, whatever the checkpoint stores: tensors
//! stored FP8 pass through as they are; bf16 (or f16, f32) linear weights are rounded to bf16 and
//! quantized with DeepSeek-V3's recipe (`fp8::quantize_block_fp8`). This is `--quantization fp8`
//! on a bf16 checkpoint, and what the CPU backend reads for every FP8 model: its f32 reads are the
//! exact dequantization of the FP8 weights the CUDA backend computes with (the CUDA loader
//! quantizes bf16 tensors on the device, bit-exact with the same function).

use crate::model::fp8::quantize_block_fp8;
use crate::model::parallel::Shard;
use crate::model::weight_source::{CheckpointError, Fp8Tensor, WeightSource};
use crate::model::weights::TensorSpec;

/// `S` is anything that derefs to a source: `&dyn WeightSource`, an `Arc` of one, `&Checkpoint`.
pub struct Fp8Quantized<S> {
    pub inner: S,
    /// Scale block of the quantized tensors (`[128, 128]`, DeepSeek-V3's).
    pub block: [usize; 2],
}

impl<S> Fp8Quantized<S> {
    pub fn new(inner: S, block: [usize; 2]) -> Self {
        Fp8Quantized { inner, block }
    }
}

impl<S> WeightSource for Fp8Quantized<S>
where
    S: std::ops::Deref + Sync,
    S::Target: WeightSource,
{
    fn describe(&self) -> String {
        format!("{} (linear weights in block FP8)", self.inner.describe())
    }

    fn read_f32(&self, spec: &TensorSpec) -> Result<Vec<f32>, CheckpointError> {
        match self.read_fp8(spec)? {
            Some(q) => Ok(q.dequantize()),
            None => self.inner.read_f32(spec),
        }
    }

    fn read_f32_shard(&self, spec: &TensorSpec, shard: &Shard) -> Result<Vec<f32>, CheckpointError> {
        match shard {
            Shard::Whole => self.read_f32(spec),
            _ => Ok(shard.take(&self.read_f32(spec)?, &spec.shape)),
        }
    }

    fn read_fp8(&self, spec: &TensorSpec) -> Result<Option<Fp8Tensor>, CheckpointError> {
        if let Some(stored) = self.inner.read_fp8(spec)? {
            return Ok(Some(stored));
        }
        if !spec.fp8_quantizable() {
            return Ok(None);
        }
        let bf16: Vec<f32> =
            self.inner.read_bf16_bits(spec)?.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect();
        Ok(Some(quantize_block_fp8(&bf16, spec.shape[0], spec.shape[1], self.block)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;
    use crate::model::dummy::DummyWeights;
    use crate::model::weights::ModelSpec;

    #[test]
    fn linear_weights_read_as_their_fp8_dequantization_and_the_rest_unchanged() {
        let cfg = ModelConfig::from_json_str(include_str!("../../../../configs/test-v3.json"), "test-v3").unwrap();
        let spec = ModelSpec::new(&cfg);
        let plain = DummyWeights::new(5);
        let inner = DummyWeights::new(5);
        let q = Fp8Quantized::new(&inner, [128, 128]);
        let (mut linear, mut other) = (0, 0);
        for t in spec.tensors() {
            let (a, b) = (plain.read_f32(t).unwrap(), q.read_f32(t).unwrap());
            if t.fp8_quantizable() {
                linear += 1;
                let fp8 = q.read_fp8(t).unwrap().expect("a linear weight reads as FP8");
                assert_eq!(b, fp8.dequantize(), "{}", t.name);
                assert_ne!(a, b, "{}: quantization changes the values", t.name);
                // Within e4m3's half-ulp (1/16 relative) of the bf16 weight, plus the block's
                // subnormal step.
                let amax = a.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() <= x.abs() / 15.0 + amax / 448.0 / 256.0, "{}: {x} -> {y}", t.name);
                }
            } else {
                other += 1;
                assert!(q.read_fp8(t).unwrap().is_none());
                assert_eq!(a, b, "{}", t.name);
            }
        }
        assert!(linear > 10 && other > 5);
    }
}
