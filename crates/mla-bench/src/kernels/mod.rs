//! `mla-bench kernels`: micro-benchmarks of the CUDA backend's kernels on the DeepSeek-V2-Lite
//! shape (16 heads, latent 512 + rope 64, pages of 64), timed with CUDA events, one module each:
//! decode attention, prefill attention, the MoE expert GEMMs, and one whole decode step.
//!
//! The JSON is laid out as the standalone `mla_cuda_bench` binary wrote it before it moved here:
//! `results` keyed by benchmark, and `sm_count` and `yardsticks_design_md` beside the common
//! envelope, so that files of earlier runs compare key for key.

mod decode_attention;
mod decode_step;
mod fp8_gemm;
mod moe_experts;
mod norms;
mod prefill_attention;
mod timing;
mod weight_gemv;

use crate::report;
use mla_core::ModelConfig;
use mla_cuda::Device;
use serde_json::{json, Value};
use std::path::Path;

/// Attention heads of the V2-Lite shape the attention benchmarks use.
const HEADS: usize = 16;
/// Context length of the decode benchmarks.
const CONTEXT: usize = 4096;

/// One benchmark of `--only`; its name is its key under `results`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum Bench {
    /// Both decode attention kernels, B = 1..256, context 4096.
    DecodeAttention,
    /// Causal prefill attention, 4 x 4096 and 1 x 4096 tokens.
    PrefillAttention,
    /// Routed-expert GEMMs at 4096 and 256 tokens.
    MoeExperts,
    /// One decode step (dummy weights, context 4096) at B = 1 and 64, eager and graph-replayed.
    DecodeStep,
    /// The bf16 and block-FP8 weight-streaming GEMVs on V3's dense shapes, 1 and 4 rows.
    WeightGemv,
    /// FP8 projections past the GEMV (W8A8 through cuBLASLt, dequantize + bf16) against bf16
    /// cuBLAS on V3's dense shapes, 64 to 4096 rows.
    Fp8Gemm,
    /// The residual add + RMSNorm, one CTA per row against a row over a cluster, 1-256 rows.
    Norms,
}

impl Bench {
    /// Run order, whatever order `--only` names them in.
    const ALL: [Bench; 7] = [
        Bench::DecodeAttention,
        Bench::PrefillAttention,
        Bench::MoeExperts,
        Bench::DecodeStep,
        Bench::WeightGemv,
        Bench::Fp8Gemm,
        Bench::Norms,
    ];

    fn key(self) -> &'static str {
        match self {
            Bench::DecodeAttention => "decode_attention",
            Bench::PrefillAttention => "prefill_attention",
            Bench::MoeExperts => "moe_experts",
            Bench::DecodeStep => "decode_step",
            Bench::WeightGemv => "weight_gemv",
            Bench::Fp8Gemm => "fp8_gemm",
            Bench::Norms => "norms",
        }
    }
}

/// Runs the benchmarks of `only` on GPU 0 and writes the report to `out` if given. `config` is
/// the model of the decode-step benchmark.
pub fn run(only: &[Bench], config: &Path, out: Option<&Path>) -> anyhow::Result<()> {
    let dev = Device::new(0)?;
    let info = dev.gpu.info.clone();
    println!("{} ({} SMs, sm_{}{})", info.name, info.sm_count, info.compute_capability.0, info.compute_capability.1);
    let mut results = serde_json::Map::new();
    for bench in Bench::ALL.into_iter().filter(|b| only.contains(b)) {
        let r = match bench {
            Bench::DecodeAttention => decode_attention::run(&dev)?,
            Bench::PrefillAttention => prefill_attention::run(&dev)?,
            Bench::MoeExperts => moe_experts::run(&dev)?,
            Bench::DecodeStep => decode_step::run(&dev, &ModelConfig::from_file(config)?)?,
            Bench::WeightGemv => weight_gemv::run(&dev)?,
            Bench::Fp8Gemm => fp8_gemm::run(&dev)?,
            Bench::Norms => norms::run(&dev)?,
        };
        results.insert(bench.key().into(), r);
    }
    let mut report = report::envelope(&info.name, Value::Object(results));
    if let Some(o) = report.as_object_mut() {
        o.insert("sm_count".into(), json!(info.sm_count));
        o.insert("yardsticks_design_md".into(), yardsticks());
    }
    report::write(out, &report)
}

/// The reference figures the first measurements were set against (from the project's early design
/// notes): a device-to-device copy, FlashInfer's MLA decode, prefill attention in PyTorch SDPA and
/// FlashInfer FA3, Hugging Face transformers decoding V2-Lite, and the decode rate V2-Lite's bytes
/// per token allow at context 4096. Constant; recorded so that every file carries its yardsticks.
fn yardsticks() -> Value {
    json!({
        "device_to_device_copy_TBps": 4.26,
        "flashinfer_mla_decode_b1_ctx4096_us": 29.0,
        "flashinfer_mla_decode_TBps": {"b32": 2.70, "b128": 3.81, "b256": 4.06},
        "prefill_attention_4x4096_TFLOPs": {"torch_sdpa": 563.0, "flashinfer_fa3": 650.0},
        "hf_transformers_v2_lite_decode_tok_s": {"b1": 14.0, "b32": 299.0, "b128": 471.0},
        "physical_decode_limit_v2_lite_ctx4k_tok_s": {"b1": 950.0, "b256": 19300.0}
    })
}
