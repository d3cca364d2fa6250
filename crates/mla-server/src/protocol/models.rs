//! `/v1/models`.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// What the model was loaded from (the `--model` value), as vLLM reports it: `vllm bench
    /// serve` takes its default tokenizer from here.
    pub root: String,
    /// Always null: no adapters are served (vLLM names a LoRA adapter's base model here).
    pub parent: Option<String>,
    /// vLLM reports the context limit here; clients use it to size prompts.
    pub max_model_len: usize,
}
