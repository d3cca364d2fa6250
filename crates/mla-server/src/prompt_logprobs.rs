//! The engine's prompt logprobs (`EngineEvent::PromptLogprobs`) in the two shapes clients read:
//! vLLM's `prompt_logprobs` list, and the prompt half of the legacy completions `logprobs`
//! object that `echo` with `logprobs` returns (what lm-evaluation-harness scores with).

use crate::error::ApiError;
use crate::protocol::common::{LogprobEntryWire, PromptLogprobsWire, PromptPositionWire};
use crate::text::TextPipeline;
use mla_engine::PromptTokenLogprob;

/// Most prompt-logprob entries (a prompt token's own, or one of its alternatives) one response
/// may carry: about 70 MB of JSON. vLLM's `prompt_logprobs` go out once per prompt; the prompt
/// half of `echo` with `logprobs` once per choice, as OpenAI's format has it.
pub const MAX_RESPONSE_ENTRIES: usize = 1 << 20;

/// Refuses a request whose prompt logprobs would pass `MAX_RESPONSE_ENTRIES`, before it runs:
/// `prompt_lens` are its prompts' token counts, `n` the choices per prompt, `vllm_k` its
/// `prompt_logprobs` and `echo_k` the `logprobs` of `echo` with `logprobs`.
pub fn check_response_size(
    prompt_lens: &[usize],
    n: usize,
    vllm_k: Option<usize>,
    echo_k: Option<usize>,
) -> Result<(), ApiError> {
    let per_prompt = |len: usize| {
        let vllm = vllm_k.map_or(0, |k| len.saturating_sub(1).saturating_mul(k + 1));
        let echo = echo_k.map_or(0, |k| len.saturating_mul(k + 1).saturating_mul(n));
        vllm.saturating_add(echo)
    };
    let entries = prompt_lens.iter().fold(0usize, |sum, &len| sum.saturating_add(per_prompt(len)));
    if entries > MAX_RESPONSE_ENTRIES {
        let field = if vllm_k.is_some() { "prompt_logprobs" } else { "logprobs" };
        return Err(ApiError::invalid(
            field,
            format!(
                "the prompt logprobs asked for come to {entries} entries, more than the {MAX_RESPONSE_ENTRIES} one response may carry; ask for fewer alternatives, a shorter prompt{}",
                if echo_k.is_some() && n > 1 { ", or a smaller n (with echo, every choice repeats the prompt's)" } else { "" }
            ),
        ));
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_size_counts_prompt_logprobs_once_and_echo_per_choice() {
        // The 20 KB request of issue 25: 4000 ids, 20 alternatives, n = 128. Once per prompt:
        // 3999 * 21 entries.
        assert!(check_response_size(&[4000], 128, Some(20), None).is_ok());
        assert!(check_response_size(&[MAX_RESPONSE_ENTRIES / 21 + 1], 1, Some(20), None).is_ok());
        let e = check_response_size(&[MAX_RESPONSE_ENTRIES / 21 + 2], 1, Some(20), None).unwrap_err();
        assert!(e.to_string().contains(&MAX_RESPONSE_ENTRIES.to_string()), "{e}");
        // echo with logprobs repeats the prompt in each of the n choices: 4000 * 21 * 128.
        let e = check_response_size(&[4000], 128, None, Some(20)).unwrap_err();
        assert!(e.to_string().contains("smaller n"), "{e}");
        assert!(check_response_size(&[4000], 12, None, Some(20)).is_ok());
        // Several prompts add up.
        assert!(check_response_size(&[100_000; 10], 1, Some(0), None).is_ok());
        assert!(check_response_size(&[100_000; 11], 1, Some(0), None).is_err());
    }
}
