//! vLLM's `sharegpt` dataset: a ShareGPT JSON file (a list of `{"conversations": [{"from",
//! "value"}, ...]}`), each conversation's first turn the prompt and its second the reply whose
//! token count is the request's output length (unless `--sharegpt-output-len` fixes it). Pairs
//! vLLM would not send are skipped: under 4 tokens either side, prompts over 1024, or over
//! 2048 together. Shuffled with the seed; drawn again at random when the file has too few.

use super::dataset::Prompt;
use super::tokenizer::BenchTokenizer;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::SeedableRng;
use serde_json::Value;
use std::path::Path;

/// vLLM's `is_valid_sequence` with its defaults.
fn wanted(prompt_len: usize, output_len: usize, fixed_output: bool) -> bool {
    prompt_len >= 4 && (fixed_output || output_len >= 4) && prompt_len <= 1024 && prompt_len + output_len <= 2048
}

pub struct Options {
    pub output_len: Option<usize>,
    pub seed: u64,
    pub shuffle: bool,
    pub oversample: bool,
}

pub fn load(path: &Path, n: usize, tok: &BenchTokenizer, o: &Options) -> anyhow::Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let data: Value = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let entries =
        data.as_array().ok_or_else(|| anyhow::anyhow!("{}: expected a JSON list of conversations", path.display()))?;
    let mut pairs: Vec<(&str, &str)> = entries
        .iter()
        .filter_map(|e| {
            let turns = e["conversations"].as_array().filter(|c| c.len() >= 2)?;
            Some((turns[0]["value"].as_str()?, turns[1]["value"].as_str()?))
        })
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(o.seed);
    if o.shuffle {
        pairs.shuffle(&mut rng);
    }
    let mut out = vec![];
    for (prompt, reply) in pairs {
        if out.len() == n {
            break;
        }
        let prompt_len = tok.count(prompt, true)?;
        let output_len = match o.output_len {
            Some(len) => len,
            None => tok.count(reply, true)?,
        };
        if wanted(prompt_len, output_len, o.output_len.is_some()) {
            out.push(Prompt { prompt: Value::from(prompt), prompt_len, output_len });
        }
    }
    anyhow::ensure!(
        !out.is_empty(),
        "{}: no conversation fits (prompt 4..=1024 tokens, reply at least 4)",
        path.display()
    );
    if o.oversample && out.len() < n {
        let extra: Vec<Prompt> = (out.len()..n).map(|_| out.choose(&mut rng).expect("not empty").clone()).collect();
        out.extend(extra);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tok() -> BenchTokenizer {
        BenchTokenizer::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo/tokenizer.json")).unwrap()
    }

    fn conv(p: &str, r: &str) -> Value {
        json!({"id": "x", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]})
    }

    #[test]
    fn sharegpt_pairs_give_prompts_with_the_replys_length() {
        let long = "word ".repeat(3000);
        let file = json!([
            conv("Tell me about the sea and the sky", "The sea is wide and the sky is blue"),
            conv("hi", "a reply long enough to count"),
            conv(&long, "too long a prompt"),
            {"conversations": [{"from": "human", "value": "one turn only"}]},
        ]);
        let path = std::env::temp_dir().join(format!("mla-bench-sharegpt-{}.json", std::process::id()));
        std::fs::write(&path, file.to_string()).unwrap();
        let t = tok();
        let o = Options { output_len: None, seed: 0, shuffle: false, oversample: false };
        let p = load(&path, 10, &t, &o).unwrap();
        assert_eq!(p.len(), 1, "only the first pair fits");
        assert_eq!(p[0].prompt, json!("Tell me about the sea and the sky"));
        assert_eq!(p[0].prompt_len, t.count("Tell me about the sea and the sky", true).unwrap());
        assert_eq!(p[0].output_len, t.count("The sea is wide and the sky is blue", true).unwrap());
        // A fixed output length; too few pairs are drawn again up to --num-prompts.
        let o = Options { output_len: Some(7), seed: 0, shuffle: true, oversample: true };
        let p = load(&path, 5, &t, &o).unwrap();
        assert_eq!(p.len(), 5);
        assert!(p.iter().all(|q| q.output_len == 7));
        std::fs::remove_file(&path).unwrap();
    }
}
