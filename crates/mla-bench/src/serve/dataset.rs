//! Benchmark prompts as `vllm bench serve` draws them (vllm/benchmarks/datasets): `random` and
//! `prefix_repetition` from random token ids, plus our `multi-turn` conversations and JSONL
//! `file`. ShareGPT lives in `sharegpt.rs`. Prompts of random ids are sent as ids, which keeps
//! their token counts exact without a tokenizer (vLLM decodes them to text and re-encodes).

use super::vocab::TokenPool;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

#[derive(Debug, Clone)]
pub struct Prompt {
    /// A JSON string or a list of token ids, sent as the completions `prompt`.
    pub prompt: Value,
    /// The prompt's token count as planned; the server's usage count replaces it.
    pub prompt_len: usize,
    pub output_len: usize,
}

impl Prompt {
    fn ids(ids: Vec<u32>, output_len: usize) -> Prompt {
        Prompt { prompt_len: ids.len(), prompt: Value::from(ids), output_len }
    }
}

/// vLLM's integer-uniform length range around `len`: [floor(len·(1−r)), ceil(len·(1+r))].
fn length_range(len: usize, ratio: f64) -> (usize, usize) {
    ((len as f64 * (1.0 - ratio)).floor() as usize, (len as f64 * (1.0 + ratio)).ceil() as usize)
}

/// `random`: `n` prompts of one shared `prefix_len`-id prefix and an input length drawn from
/// `input_len` ± `range_ratio`, each asking for an output length drawn the same way (at least 1).
pub fn random(
    n: usize,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    prefix_len: usize,
    pool: &TokenPool,
    seed: u64,
) -> anyhow::Result<Vec<Prompt>> {
    anyhow::ensure!((0.0..1.0).contains(&range_ratio), "--random-range-ratio {range_ratio}: must be in [0, 1)");
    let (in_lo, in_hi) = length_range(input_len, range_ratio);
    let (out_lo, out_hi) = length_range(output_len, range_ratio);
    anyhow::ensure!(
        prefix_len + in_lo >= 1,
        "--random-input-len {input_len} with --random-range-ratio {range_ratio} and --random-prefix-len \
         {prefix_len} allows empty prompts"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let prefix: Vec<u32> = (0..prefix_len).map(|_| pool.draw(&mut rng)).collect();
    Ok((0..n)
        .map(|_| {
            let len = rng.random_range(in_lo..=in_hi);
            let out = rng.random_range(out_lo.max(1)..=out_hi.max(1));
            let mut ids = prefix.clone();
            ids.extend((0..len).map(|_| pool.draw(&mut rng)));
            Prompt::ids(ids, out)
        })
        .collect())
}

/// `prefix_repetition`: `num_prefixes` prefixes of `prefix_len` ids, each followed by
/// `n / num_prefixes` suffixes of `suffix_len` ids of their own; shuffled unless `shuffle` is off.
#[allow(clippy::too_many_arguments)]
pub fn prefix_repetition(
    n: usize,
    prefix_len: usize,
    suffix_len: usize,
    num_prefixes: usize,
    output_len: usize,
    pool: &TokenPool,
    seed: u64,
    shuffle: bool,
) -> anyhow::Result<Vec<Prompt>> {
    let per_prefix = n / num_prefixes.max(1);
    anyhow::ensure!(
        per_prefix > 0,
        "--num-prompts {n} must be at least --prefix-repetition-num-prefixes {num_prefixes}"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(per_prefix * num_prefixes);
    for _ in 0..num_prefixes {
        let prefix: Vec<u32> = (0..prefix_len).map(|_| pool.draw(&mut rng)).collect();
        for _ in 0..per_prefix {
            let mut ids = prefix.clone();
            ids.extend((0..suffix_len).map(|_| pool.draw(&mut rng)));
            out.push(Prompt::ids(ids, output_len));
        }
    }
    if shuffle {
        out.shuffle(&mut rng);
    }
    Ok(out)
}

/// The new tokens of every turn of `conversations` conversations of `turns` turns each,
/// `turn_len` random ids per turn.
pub fn conversations(
    conversations: usize,
    turns: usize,
    turn_len: usize,
    pool: &TokenPool,
    seed: u64,
) -> Vec<Vec<Vec<u32>>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..conversations)
        .map(|_| (0..turns).map(|_| (0..turn_len).map(|_| pool.draw(&mut rng)).collect()).collect())
        .collect()
}

#[derive(Deserialize)]
struct Line {
    prompt: Value,
    max_tokens: Option<usize>,
}

/// One JSON object per line: `{"prompt": "text" | [ids], "max_tokens": n}`; `max_tokens` falls
/// back to `default_output`. The first `n` lines are used (all when `n` is 0). A text prompt's
/// length is unknown until the server's usage reports it.
pub fn from_file(path: &Path, n: usize, default_output: usize) -> anyhow::Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let mut out = vec![];
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line: Line =
            serde_json::from_str(l).map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), i + 1))?;
        let prompt_len = match &line.prompt {
            Value::String(_) => 0,
            Value::Array(a) if a.iter().all(|v| v.is_u64()) => a.len(),
            _ => anyhow::bail!("{} line {}: prompt must be a string or a list of token ids", path.display(), i + 1),
        };
        out.push(Prompt { prompt: line.prompt, prompt_len, output_len: line.max_tokens.unwrap_or(default_output) });
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

    fn ids(q: &Prompt) -> Vec<u64> {
        q.prompt.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
    }

    #[test]
    fn random_prompts_have_the_asked_lengths_and_range() {
        let pool = TokenPool::range(100, 200);
        let p = random(3, 17, 5, 0.0, 0, &pool, 1).unwrap();
        assert_eq!(p.len(), 3);
        for q in &p {
            assert_eq!((ids(q).len(), q.prompt_len, q.output_len), (17, 17, 5));
            assert!(ids(q).iter().all(|v| (100..200).contains(v)));
        }
        assert_ne!(p[0].prompt, p[1].prompt);
    }

    #[test]
    fn range_ratio_and_prefix_follow_vllm() {
        // input 10 ± 50%: [5, 15]; output 3 ± 50%: [floor 1.5, ceil 4.5] = [1, 5]; a shared
        // prefix of 4 in front of every prompt.
        let p = random(200, 10, 3, 0.5, 4, &TokenPool::range(0, 1000), 7).unwrap();
        let lens: Vec<usize> = p.iter().map(|q| q.prompt_len).collect();
        assert_eq!((lens.iter().min(), lens.iter().max()), (Some(&9), Some(&19)));
        let outs: Vec<usize> = p.iter().map(|q| q.output_len).collect();
        assert_eq!((outs.iter().min(), outs.iter().max()), (Some(&1), Some(&5)));
        assert!(p.iter().all(|q| ids(q)[..4] == ids(&p[0])[..4]));
        assert!(random(1, 10, 3, 1.0, 0, &TokenPool::range(0, 9), 1).is_err());
        assert!(random(1, 1, 3, 0.5, 0, &TokenPool::range(0, 9), 1).is_err());
    }

    #[test]
    fn repeated_prefixes_and_conversations_have_their_shapes() {
        let pool = TokenPool::range(10, 20);
        // 5 prompts over 2 prefixes: 2 each (vLLM drops the remainder), in prefix order unshuffled.
        let p = prefix_repetition(5, 8, 3, 2, 4, &pool, 1, false).unwrap();
        assert_eq!(p.len(), 4);
        assert_eq!(ids(&p[0]).len(), 11);
        assert_eq!(ids(&p[0])[..8], ids(&p[1])[..8]);
        assert_ne!(ids(&p[0])[..8], ids(&p[2])[..8]);
        assert_ne!(ids(&p[0])[8..], ids(&p[1])[8..]);
        let shuffled = prefix_repetition(40, 8, 3, 2, 4, &pool, 1, true).unwrap();
        assert!(shuffled[..20].iter().any(|q| ids(q)[..8] != ids(&shuffled[0])[..8]));
        assert!(prefix_repetition(1, 8, 3, 2, 4, &pool, 1, true).is_err());
        let c = conversations(3, 4, 5, &pool, 1);
        assert_eq!((c.len(), c[0].len(), c[0][0].len()), (3, 4, 5));
    }

    #[test]
    fn file_prompts_accept_text_and_ids() {
        let path = std::env::temp_dir().join(format!("mla-bench-ds-{}.jsonl", std::process::id()));
        std::fs::write(&path, "{\"prompt\": \"hi\"}\n\n{\"prompt\": [1, 2, 3], \"max_tokens\": 9}\n").unwrap();
        let p = from_file(&path, 0, 4).unwrap();
        assert_eq!((p[0].prompt_len, p[0].output_len, p[1].prompt_len, p[1].output_len), (0, 4, 3, 9));
        std::fs::write(&path, "{\"prompt\": {\"a\": 1}}\n").unwrap();
        assert!(from_file(&path, 0, 4).unwrap_err().to_string().contains("line 1"));
        std::fs::remove_file(&path).unwrap();
    }
}
