//! Which token ids random prompts draw from: the served model's vocabulary, so a benchmark runs
//! against any model (the 512-token demo included) without flags. In order of preference:
//! `--token-id-range`; the tokenizer's vocabulary less its special tokens (as vLLM's random
//! dataset); the size an mla-serve server names when refusing an out-of-vocabulary id; a
//! fixed range that fits DeepSeek's vocabularies.
//!
//! mla-serve has no endpoint that reports the vocabulary size (`/v1/models` lists the context
//! length only, and there is no `/tokenize`), but its prompt validation answers an
//! out-of-range id with `... outside the vocabulary (0..N)`; one such request, asked only of a
//! server whose model card says `owned_by: mla-serve`, learns N without touching the server.

use rand::Rng;

/// Token ids `lo..hi` less `excluded` (sorted), drawn uniformly.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenPool {
    lo: u32,
    hi: u32,
    excluded: Vec<u32>,
}

impl TokenPool {
    pub fn range(lo: u32, hi: u32) -> TokenPool {
        assert!(lo < hi, "an empty token range");
        TokenPool { lo, hi, excluded: vec![] }
    }

    /// `0..vocab` less `special` ids; None when nothing would be left.
    pub fn vocabulary(vocab: u32, mut special: Vec<u32>) -> Option<TokenPool> {
        special.retain(|&t| t < vocab);
        special.sort_unstable();
        special.dedup();
        (vocab as usize > special.len()).then_some(TokenPool { lo: 0, hi: vocab, excluded: special })
    }

    pub fn draw(&self, rng: &mut impl Rng) -> u32 {
        loop {
            let t = rng.random_range(self.lo..self.hi);
            if self.excluded.binary_search(&t).is_err() {
                return t;
            }
        }
    }

    pub fn describe(&self) -> String {
        let less =
            if self.excluded.is_empty() { String::new() } else { format!(" less {} special", self.excluded.len()) };
        format!("{}..{}{less}", self.lo, self.hi)
    }
}

/// `--token-id-range LO..HI`.
pub fn parse_range(s: &str) -> anyhow::Result<TokenPool> {
    let (a, b) = s.split_once("..").ok_or_else(|| anyhow::anyhow!("--token-id-range {s}: expected LO..HI"))?;
    let (a, b): (u32, u32) = (a.trim().parse()?, b.trim().parse()?);
    anyhow::ensure!(a < b, "--token-id-range {s}: empty");
    Ok(TokenPool::range(a, b))
}

/// What random ids draw from when nothing tells the vocabulary: inside every DeepSeek
/// vocabulary (102,400 and 129,280 ids), clear of the low ids where BOS and EOS sit.
pub const FALLBACK: (u32, u32) = (100, 30_000);

/// The vocabulary size in mla-serve's out-of-vocabulary message: `... outside the vocabulary (0..N)`.
pub fn size_from_refusal(message: &str) -> Option<u32> {
    let rest = &message[message.find("outside the vocabulary (0..")? + "outside the vocabulary (0..".len()..];
    rest[..rest.find(')')?].parse().ok()
}

/// Ids of a vocabulary of `n` learnt from the server, which names no special tokens: the
/// lowest ids (BOS, EOS and other control tokens in DeepSeek's and most BPE vocabularies) left
/// out, 100 of them, or an eighth of a small vocabulary.
pub fn pool_of_size(n: u32) -> TokenPool {
    TokenPool::range((n / 8).min(100), n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn pools_draw_inside_their_range_and_skip_specials() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let p = TokenPool::vocabulary(6, vec![0, 1, 5, 9]).unwrap();
        let drawn: std::collections::BTreeSet<u32> = (0..200).map(|_| p.draw(&mut rng)).collect();
        assert_eq!(drawn.into_iter().collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(p.describe(), "0..6 less 3 special");
        assert!(TokenPool::vocabulary(2, vec![0, 1]).is_none());
        assert_eq!(parse_range("100..30000").unwrap(), TokenPool::range(100, 30_000));
        assert!(parse_range("5..5").is_err() && parse_range("5").is_err());
    }

    #[test]
    fn vocabulary_size_is_read_from_mla_serves_refusal() {
        let msg = "token id 2147483647 in prompt is outside the vocabulary (0..512)";
        assert_eq!(size_from_refusal(msg), Some(512));
        assert_eq!(size_from_refusal("Token id 99 is out of vocabulary"), None);
        assert_eq!(pool_of_size(512), TokenPool::range(64, 512));
        assert_eq!(pool_of_size(129_280), TokenPool::range(100, 129_280));
    }
}
