//! The token environment llguidance computes masks over: a `TokTrie` of every token id's bytes,
//! built from our own tokenizer rather than through `toktrie_hf_tokenizers`, which pins
//! `tokenizers` 0.21 (the workspace uses 0.22; two copies would double that crate's build).
//!
//! Bytes of a token id:
//! - ids past the tokenizer (a model `vocab_size` larger than its tokenizer, padding rows): no
//!   bytes, which llguidance never allows;
//! - added tokens, special or not (`<｜end▁of▁sentence｜>`, V3's tool-call markers, R1's
//!   `<think>`): `0xFF` + their text, toktrie's convention, as llguidance's own HF loader marks
//!   them (`0xFF` never occurs in UTF-8). A Lark grammar names them as `<｜tool▁sep｜>` or
//!   `<[id]>`, which the tool-call grammar does so that a forced call uses the real marker
//!   tokens (with the markers as plain added tokens, such a reference does not compile);
//! - vocabulary tokens: GPT-2's byte-level alphabet mapped back to bytes (`Ġ` is a space). A
//!   token outside that alphabet (a tokenizer that is not byte-level) falls back to its decoded
//!   text, counted in `TokenEnv::fallbacks`.

use crate::text::{byte_level_bytes, TextPipeline};
use crate::tokenizer::TextTokenizer;
use std::collections::HashMap;
use std::sync::Arc;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

pub struct TokenEnv {
    trie: TokTrie,
    text: Arc<TextPipeline>,
    /// Vocabulary tokens whose bytes came from decoding rather than the byte-level alphabet.
    pub fallbacks: usize,
}

impl TokenEnv {
    /// `vocab_size` is the model's (the engine's masks have one bit per id); `eos` is the id
    /// llguidance allows once the grammar is complete.
    pub fn new(text: Arc<TextPipeline>, vocab_size: usize, eos: u32) -> anyhow::Result<TokenEnv> {
        let tokenizer = text.tokenizer();
        if tokenizer.vocab_size() > vocab_size {
            anyhow::bail!("the tokenizer has {} tokens, more than the model's {vocab_size}", tokenizer.vocab_size());
        }
        if eos as usize >= vocab_size {
            anyhow::bail!("end-of-sequence id {eos} is outside the vocabulary (0..{vocab_size})");
        }
        let (words, fallbacks) = token_bytes(tokenizer, vocab_size);
        if words[eos as usize].is_empty() {
            anyhow::bail!("end-of-sequence id {eos} is not a token of the tokenizer");
        }
        let info = TokRxInfo {
            vocab_size: vocab_size as u32,
            tok_eos: eos,
            tok_bos: tokenizer.bos().map(|t| t.id),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words);
        Ok(TokenEnv { trie, text, fallbacks })
    }
}

/// The bytes of ids `0 .. vocab_size` (see the module docs), and how many fell back to decoding.
pub fn token_bytes(tokenizer: &TextTokenizer, vocab_size: usize) -> (Vec<Vec<u8>>, usize) {
    let added: HashMap<u32, String> = tokenizer.added_tokens().into_iter().map(|(id, text, _)| (id, text)).collect();
    let mut fallbacks = 0;
    let words = (0..vocab_size as u32)
        .map(|id| {
            if let Some(text) = added.get(&id) {
                let mut bytes = Vec::with_capacity(text.len() + 1);
                bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
                bytes.extend_from_slice(text.as_bytes());
                return bytes;
            }
            let Some(token) = tokenizer.id_to_token(id) else { return Vec::new() };
            byte_level_bytes(&token).unwrap_or_else(|| {
                fallbacks += 1;
                tokenizer.decode(&[id], false).unwrap_or_default().into_bytes()
            })
        })
        .collect();
    (words, fallbacks)
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own (canonical) tokenization for text; bytes that are not UTF-8 (a cut
    /// character) go through the trie greedily, as llguidance's approximate environment does.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.text.tokenizer().encode(text, false).unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}
