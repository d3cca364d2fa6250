//! Benchmark prompts: random token ids of a fixed length, or a JSONL file.

use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

#[derive(Debug, Clone)]
pub struct Prompt {
    /// A JSON string or a list of token ids, sent as the completions `prompt`.
    pub prompt: Value,
    /// Token count when known up front (random dataset); the server's usage wins when it reports one.
    pub prompt_tokens: Option<usize>,
    pub max_tokens: usize,
}

/// `n` prompts of `input_len` token ids drawn uniformly from `lo..hi`, each asking for `output_len`
/// tokens. Token-id prompts keep the input length exact, whatever the server's tokenizer.
pub fn random(n: usize, input_len: usize, output_len: usize, ids: (u32, u32), seed: u64) -> Vec<Prompt> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let toks: Vec<u32> = (0..input_len).map(|_| rng.random_range(ids.0..ids.1)).collect();
            Prompt { prompt: Value::from(toks), prompt_tokens: Some(input_len), max_tokens: output_len }
        })
        .collect()
}

/// vLLM's `prefix_repetition`: `n` prompts, each one of `num_prefixes` shared prefixes of
/// `prefix_len` random ids followed by `suffix_len` ids of its own.
pub fn prefix_repetition(
    n: usize,
    prefix_len: usize,
    suffix_len: usize,
    num_prefixes: usize,
    output_len: usize,
    ids: (u32, u32),
    seed: u64,
) -> Vec<Prompt> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut draw = |len: usize| -> Vec<u32> { (0..len).map(|_| rng.random_range(ids.0..ids.1)).collect() };
    let prefixes: Vec<Vec<u32>> = (0..num_prefixes.max(1)).map(|_| draw(prefix_len)).collect();
    (0..n)
        .map(|i| {
            let mut toks = prefixes[i % prefixes.len()].clone();
            toks.extend(draw(suffix_len));
            Prompt { prompt: Value::from(toks), prompt_tokens: Some(prefix_len + suffix_len), max_tokens: output_len }
        })
        .collect()
}

/// The new tokens of every turn of `conversations` conversations of `turns` turns each,
/// `turn_len` random ids per turn.
pub fn conversations(
    conversations: usize,
    turns: usize,
    turn_len: usize,
    ids: (u32, u32),
    seed: u64,
) -> Vec<Vec<Vec<u32>>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..conversations)
        .map(|_| (0..turns).map(|_| (0..turn_len).map(|_| rng.random_range(ids.0..ids.1)).collect()).collect())
        .collect()
}

#[derive(Deserialize)]
struct Line {
    prompt: Value,
    max_tokens: Option<usize>,
}

/// One JSON object per line: `{"prompt": "text" | [ids], "max_tokens": n}`; `max_tokens` falls
/// back to `default_output`. The first `n` lines are used (all when `n` is 0).
pub fn from_file(path: &Path, n: usize, default_output: usize) -> anyhow::Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let mut out = vec![];
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line: Line =
            serde_json::from_str(l).map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), i + 1))?;
        let prompt_tokens = match &line.prompt {
            Value::String(_) => None,
            Value::Array(a) if a.iter().all(|v| v.is_u64()) => Some(a.len()),
            _ => anyhow::bail!("{} line {}: prompt must be a string or a list of token ids", path.display(), i + 1),
        };
        out.push(Prompt { prompt: line.prompt, prompt_tokens, max_tokens: line.max_tokens.unwrap_or(default_output) });
        if out.len() == n {
            break;
        }
    }
    anyhow::ensure!(!out.is_empty(), "{} holds no prompts", path.display());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_have_the_asked_lengths_and_range() {
        let p = random(3, 17, 5, (100, 200), 1);
        assert_eq!(p.len(), 3);
        for q in &p {
            let ids = q.prompt.as_array().unwrap();
            assert_eq!((ids.len(), q.prompt_tokens, q.max_tokens), (17, Some(17), 5));
            assert!(ids.iter().all(|v| (100..200).contains(&v.as_u64().unwrap())));
        }
        assert_ne!(p[0].prompt, p[1].prompt);
    }

    #[test]
    fn repeated_prefixes_and_conversations_have_their_shapes() {
        let p = prefix_repetition(5, 8, 3, 2, 4, (10, 20), 1);
        let ids = |q: &Prompt| q.prompt.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect::<Vec<_>>();
        assert_eq!(ids(&p[0]).len(), 11);
        assert_eq!(ids(&p[0])[..8], ids(&p[2])[..8]);
        assert_ne!(ids(&p[0])[..8], ids(&p[1])[..8]);
        assert_ne!(ids(&p[0])[8..], ids(&p[2])[8..]);
        let c = conversations(3, 4, 5, (10, 20), 1);
        assert_eq!((c.len(), c[0].len(), c[0][0].len()), (3, 4, 5));
    }

    #[test]
    fn file_prompts_accept_text_and_ids() {
        let path = std::env::temp_dir().join(format!("mla-bench-ds-{}.jsonl", std::process::id()));
        std::fs::write(&path, "{\"prompt\": \"hi\"}\n\n{\"prompt\": [1, 2, 3], \"max_tokens\": 9}\n").unwrap();
        let p = from_file(&path, 0, 4).unwrap();
        assert_eq!((p[0].prompt_tokens, p[0].max_tokens, p[1].prompt_tokens, p[1].max_tokens), (None, 4, Some(3), 9));
        std::fs::write(&path, "{\"prompt\": {\"a\": 1}}\n").unwrap();
        assert!(from_file(&path, 0, 4).unwrap_err().to_string().contains("line 1"));
        std::fs::remove_file(&path).unwrap();
    }
}
