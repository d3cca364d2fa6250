//! Incremental detokenization for streaming: text deltas whose concatenation is the full decode
//! of the generated ids, never splitting a UTF-8 character.
//!
//! Decoding token by token is wrong twice over: a byte-level token can hold part of a character
//! (an emoji spans up to four tokens), and some decoders change a token's text depending on its
//! neighbours (SentencePiece's leading space). So, as vLLM and TGI do, each step decodes a short
//! window `ids[prefix_offset..]` and compares it with the already-emitted window
//! `ids[prefix_offset..read_offset]`; the difference is new text, released only when it does not
//! end in U+FFFD (the decoder's mark for an unfinished character).
//!
//! Only generated ids are decoded (no prompt context), so the deltas add up to
//! `decode(generated, skip_special_tokens)`, which is the response text transformers produces.

use crate::tokenizer::{TextTokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    /// Start of the window decoded for context; text before it has been emitted.
    prefix_offset: usize,
    /// End of the emitted part of the window.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self { ids: Vec::new(), prefix_offset: 0, read_offset: 0, skip_special_tokens }
    }

    /// Adds one generated id; returns the text it completes (often empty while a multi-byte
    /// character or a skipped special token is pending).
    pub fn push(&mut self, tokenizer: &TextTokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let (emitted, window) = self.decode_windows(tokenizer)?;
        // A window that does not extend the emitted text cannot be split consistently (a decoder
        // rewrote earlier text); wait for more tokens, `finish` settles it.
        if window.len() <= emitted.len() || window.ends_with(REPLACEMENT) || !window.starts_with(&emitted) {
            return Ok(String::new());
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(window[emitted.len()..].to_string())
    }

    /// Text still held back when generation ends (an unfinished character decodes as U+FFFD,
    /// as in the full decode).
    pub fn finish(&mut self, tokenizer: &TextTokenizer) -> Result<String, TokenizerError> {
        let (emitted, window) = self.decode_windows(tokenizer)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(match window.strip_prefix(emitted.as_str()) {
            Some(rest) => rest.to_string(),
            None => String::new(),
        })
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn decode_windows(&self, tokenizer: &TextTokenizer) -> Result<(String, String), TokenizerError> {
        let emitted = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let window = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        Ok((emitted, window))
    }
}
