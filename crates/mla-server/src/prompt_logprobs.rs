//! The engine's prompt logprobs (`EngineEvent::PromptLogprobs`) in the two shapes clients read:
//! vLLM's `prompt_logprobs` list, and the prompt half of the legacy completions `logprobs`
//! object that `echo` with `logprobs` returns (what lm-evaluation-harness scores with).

use crate::protocol::common::{LogprobEntryWire, PromptLogprobsWire, PromptPositionWire};
use crate::text::TextPipeline;
use mla_engine::PromptTokenLogprob;

/// One position of the legacy object: the token's name, its logprob and the alternatives
/// (`None` for the first prompt token, which nothing predicts).
#[derive(Debug, Clone, PartialEq)]
pub struct LegacyEntry {
    pub token: String,
    pub logprob: Option<f32>,
    pub top: Option<Vec<(String, f32)>>,
}

/// vLLM's list: `null`, then for each later prompt token an object keyed by token id with the
/// token itself first and then the `k` most likely tokens (each once).
pub fn vllm_list(text: &TextPipeline, entries: &[PromptTokenLogprob], k: usize) -> PromptLogprobsWire {
    let decoded = |id: u32| text.token_piece(id).0;
    let mut out = Vec::with_capacity(entries.len() + 1);
    out.push(None);
    for e in entries {
        let mut position =
            vec![(e.token, LogprobEntryWire { logprob: e.logprob, rank: e.rank, decoded_token: decoded(e.token) })];
        for (i, &(id, logprob)) in e.top.iter().take(k).enumerate() {
            if id != e.token {
                position.push((id, LogprobEntryWire { logprob, rank: i as u32 + 1, decoded_token: decoded(id) }));
            }
        }
        out.push(Some(PromptPositionWire(position)));
    }
    out
}

/// The prompt's entries of the legacy object, `k` alternatives each plus the prompt token
/// itself (as OpenAI and vLLM add the chosen token). `tokens_as_ids` names tokens `token_id:<id>`.
pub fn legacy_entries(
    text: &TextPipeline,
    prompt: &[u32],
    entries: &[PromptTokenLogprob],
    k: usize,
    tokens_as_ids: bool,
) -> Vec<LegacyEntry> {
    let name = |id: u32| if tokens_as_ids { format!("token_id:{id}") } else { text.token_piece(id).0 };
    let Some(&first) = prompt.first() else { return vec![] };
    let mut out = vec![LegacyEntry { token: name(first), logprob: None, top: None }];
    out.extend(entries.iter().map(|e| {
        // The prompt token first, then the alternatives by rank, as vLLM orders them (the
        // name-keyed object keeps each name once, at its first place).
        let mut top = vec![(name(e.token), e.logprob)];
        top.extend(e.top.iter().take(k).map(|&(id, lp)| (name(id), lp)));
        LegacyEntry { token: name(e.token), logprob: Some(e.logprob), top: Some(top) }
    }));
    out
}
