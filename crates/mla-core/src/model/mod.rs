//! The model description: what a DeepSeek checkpoint is and how it is read. The typed config
//! (`config`, with RoPE/YaRN in `rope`), the exact set of tensors it needs (`weights`), how a
//! parallel layout cuts them (`parallel`), where they come from (`weight_source`: a checkpoint,
//! dummy weights, block-FP8 tensors and their exact dequantization), and the FP8 latent cache's
//! row format (`latent_fp8`). It knows nothing of steps or threads; everything else in the crate
//! may use it.

pub mod checkpoint;
pub mod config;
pub mod dummy;
pub mod fp8;
pub mod fp8_source;
pub mod json_patch;
pub mod latent_fp8;
pub mod parallel;
pub mod rope;
pub mod weight_source;
pub mod weights;
