//! CPU reference backend of mla-serve.
//!
//! Plain f32 math on the loaded weights, written for clarity: this is the implementation every
//! other backend is checked against, and it is itself checked against HF transformers. One paged
//! latent KV cache (`[c_kv ; k_pe]` per token per layer) serves both MLA formulations: the normal
//! decompressed path for prefill steps and the absorbed latent-space path for decode steps.
//!
//! The small reference functions GPU kernels are tested against are public: [`rms_norm`],
//! [`apply_rope`], [`normal_attention`] / [`causal_attention`] / [`decompress_latent`],
//! [`absorbed_attention`] and [`route`].

pub mod attention_absorbed;
pub mod attention_normal;
pub mod backend;
pub mod group;
pub mod kv_cache;
pub mod linear;
pub mod mla;
pub mod mla_dims;
pub mod mlp;
pub mod model;
pub mod model_weights;
pub mod moe;
pub mod norm;
pub mod rank;
pub mod rope;
pub mod softmax;
pub mod speculative;
pub mod verdict;

pub use attention_absorbed::absorbed_attention;
pub use attention_normal::{causal_attention, decompress_latent, normal_attention, HeadDims};
pub use backend::CpuBackend;
pub use group::CpuGroupBackend;
pub use linear::Matrix;
pub use mla_dims::MlaDims;
pub use moe::route;
pub use norm::rms_norm;
pub use rank::CpuRank;
pub use rope::{apply_rope, Rope};
