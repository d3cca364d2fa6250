//! The DeepSeek forward pass on the device: weights, activation workspace, paged latent cache,
//! per-step metadata and the step itself.

mod attention_layer;
mod draft_store;
mod ffn_layer;
mod forks;
mod forward;
pub mod graph;
pub mod memory_plan;
pub mod meta;
mod meta_buffers;
pub mod meta_words;
pub mod moe_small;
mod mtp_graph;
pub mod options;
mod padding;
pub mod parallel;
pub mod small_linear;
mod speculative;
pub mod weights;
pub mod workspace;

pub use forward::CudaModel;
pub use graph::{graph_expressible, DecodeGraph, DecodeGraphs, ReplayTimes};
pub use meta::{DecodeLayout, MetaLimits, PassMeta, PrefillLayout, StepLayout, StepMeta};
pub use meta_words::Section;
pub use mtp_graph::MtpGraphs;
pub use options::ModelOptions;
pub use parallel::{FfnRows, RankLink, RankMode};
pub use speculative::DpaStep;
pub use weights::DeviceWeights;
pub use workspace::{Limits, Workspace};

use mla_core::ModelConfig;

/// The kernels are built for the MLA dimensions every published DeepSeek model uses; anything
/// else is refused up front with the field that differs.
pub fn check_supported(cfg: &ModelConfig) -> anyhow::Result<()> {
    use crate::ops::{LATENT, NOPE, ROPE, V_HEAD};
    for (name, have, want) in [
        ("kv_lora_rank", cfg.kv_lora_rank, LATENT),
        ("qk_rope_head_dim", cfg.qk_rope_head_dim, ROPE),
        ("qk_nope_head_dim", cfg.qk_nope_head_dim, NOPE),
        ("v_head_dim", cfg.v_head_dim, V_HEAD),
    ] {
        anyhow::ensure!(have == want, "the CUDA backend's attention kernels are built for {name} = {want} (every published DeepSeek-V2/V3 model); this config has {have}");
    }
    for (name, v) in [
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
    ] {
        anyhow::ensure!(v % 8 == 0, "the CUDA backend needs {name} to be a multiple of 8, found {v}");
    }
    anyhow::ensure!(
        cfg.n_routed_experts <= 256,
        "the CUDA router handles at most 256 routed experts, found {}",
        cfg.n_routed_experts
    );
    anyhow::ensure!(
        cfg.num_experts_per_tok <= 32 && cfg.n_group <= 32,
        "the CUDA router handles top-k and n_group up to 32"
    );
    anyhow::ensure!(cfg.vocab_size < i32::MAX as usize, "vocabulary too large");
    Ok(())
}
