//! The model's tokenizer on the client, where a dataset needs one (ShareGPT's lengths, text
//! prompts for the chat endpoint) and to learn the vocabulary. `--tokenizer` (default: the
//! model id, as in vLLM) names a `tokenizer.json`, a directory holding one, or a HF repo id
//! already in the local hub cache; nothing is downloaded.

use super::vocab::TokenPool;
use rand::Rng;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

pub struct BenchTokenizer {
    inner: Tokenizer,
    pub path: PathBuf,
}

/// Where `spec` finds a `tokenizer.json`, if anywhere.
pub fn locate(spec: &str) -> Option<PathBuf> {
    let p = Path::new(spec);
    if p.is_file() {
        return Some(p.to_path_buf());
    }
    if p.is_dir() {
        return Some(p.join("tokenizer.json")).filter(|f| f.is_file());
    }
    let (org, name) = spec.split_once('/')?;
    if org.is_empty() || name.is_empty() || name.contains('/') {
        return None;
    }
    let folder = format!("models--{org}--{name}");
    hub_roots().into_iter().find_map(|root| snapshot_tokenizer(&root.join(&folder)))
}

/// Hub cache directories in huggingface_hub's order of precedence.
fn hub_roots() -> Vec<PathBuf> {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    [var("HF_HUB_CACHE"), var("HF_HOME").map(|h| h.join("hub")), var("HOME").map(|h| h.join(".cache/huggingface/hub"))]
        .into_iter()
        .flatten()
        .collect()
}

/// `refs/main`'s snapshot, else any snapshot, that holds a tokenizer.json.
fn snapshot_tokenizer(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    let main = std::fs::read_to_string(repo.join("refs/main")).ok().map(|r| snapshots.join(r.trim()));
    let others = std::fs::read_dir(&snapshots).ok()?.filter_map(|e| e.ok()).map(|e| e.path());
    main.into_iter().chain(others).map(|d| d.join("tokenizer.json")).find(|f| f.is_file())
}

impl BenchTokenizer {
    pub fn load(path: &Path) -> anyhow::Result<BenchTokenizer> {
        let inner =
            Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("{}: not a tokenizer.json: {e}", path.display()))?;
        Ok(BenchTokenizer { inner, path: path.to_path_buf() })
    }

    /// vLLM's random-prompt ids: the base vocabulary (added tokens not counted, as
    /// transformers' `vocab_size`) less the special tokens.
    pub fn pool(&self) -> Option<TokenPool> {
        let special =
            self.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        TokenPool::vocabulary(self.inner.get_vocab_size(false) as u32, special)
    }

    /// Token count of `text`; `add_special_tokens` adds what the post-processor adds (BOS for
    /// DeepSeek), as `tokenizer(text)` does in transformers.
    pub fn count(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<usize> {
        Ok(self.encode(text, add_special_tokens)?.len())
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<Vec<u32>> {
        let e = self.inner.encode_fast(text, add_special_tokens).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok(e.get_ids().to_vec())
    }

    /// A text that encodes to as many tokens as `ids`, and its actual token count. Decoding
    /// and re-encoding can merge or split tokens, so as vLLM's `gen_prompt_decode_to_target_len`
    /// does, it re-encodes, cuts or tops up with random ids, and tries again, ten times at most.
    pub fn text_of(&self, ids: &[u32], pool: &TokenPool, rng: &mut impl Rng) -> anyhow::Result<(String, usize)> {
        let target = ids.len();
        let mut seq = ids.to_vec();
        for attempt in 0.. {
            let text = self.inner.decode(&seq, false).map_err(|e| anyhow::anyhow!("detokenizing: {e}"))?;
            seq = self.encode(&text, false)?;
            if seq.len() == target || attempt == 10 {
                return Ok((text, seq.len()));
            }
            if seq.len() > target {
                seq.truncate(target);
            } else {
                seq.extend((seq.len()..target).map(|_| pool.draw(rng)));
            }
        }
        unreachable!("the loop returns by its tenth attempt")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn demo_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo")
    }

    #[test]
    fn the_demo_tokenizer_is_found_by_file_or_directory_and_gives_its_vocabulary() {
        let dir = demo_dir();
        assert_eq!(locate(dir.to_str().unwrap()), Some(dir.join("tokenizer.json")));
        assert_eq!(locate(dir.join("tokenizer.json").to_str().unwrap()), Some(dir.join("tokenizer.json")));
        assert_eq!(locate("demo"), None);
        let t = BenchTokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let pool = t.pool().unwrap();
        // The demo's 501 base tokens; the added special ones (BOS, EOS, ...) are past them or excluded.
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        assert!((0..1000).all(|_| pool.draw(&mut rng) < 501));
        assert!(t.count("Hello there", true).unwrap() > t.count("Hello there", false).unwrap());
    }

    #[test]
    fn text_prompts_re_encode_to_about_the_asked_length() {
        let t = BenchTokenizer::load(&demo_dir().join("tokenizer.json")).unwrap();
        let pool = t.pool().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for len in [1, 16, 200] {
            let ids: Vec<u32> = (0..len).map(|_| pool.draw(&mut rng)).collect();
            let (text, n) = t.text_of(&ids, &pool, &mut rng).unwrap();
            assert_eq!(t.count(&text, false).unwrap(), n);
            assert!(n.abs_diff(len) <= 2, "asked {len}, got {n}");
        }
    }

    #[test]
    fn hub_cache_snapshots_are_searched_for_repo_ids() {
        let root = std::env::temp_dir().join(format!("mla-bench-hub-{}", std::process::id()));
        let snap = root.join("models--org--m/snapshots/abc");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::copy(demo_dir().join("tokenizer.json"), snap.join("tokenizer.json")).unwrap();
        assert_eq!(snapshot_tokenizer(&root.join("models--org--m")), Some(snap.join("tokenizer.json")));
        assert_eq!(snapshot_tokenizer(&root.join("models--org--other")), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
