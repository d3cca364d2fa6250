//! The model's tokenizer: `tokenizer.json` through the `tokenizers` crate plus what
//! `tokenizer_config.json` adds (named special tokens, chat templates), with transformers 5's
//! semantics:
//! - `encode(text, add_special_tokens = true)` applies `tokenizer.json`'s post-processor (for
//!   DeepSeek: BOS first). transformers 5 ignores `add_bos_token`/`add_eos_token` whenever a
//!   `tokenizer.json` exists, so they are only cross-checked here.
//! - A rendered chat prompt is encoded without special tokens, exactly as `apply_chat_template`
//!   does, because the template already wrote BOS; adding another would double it.
//! - `decode` is the `tokenizers` decode; `clean_up_tokenization_spaces` is ignored for BPE
//!   models, as transformers 5 does (it would delete real spaces before punctuation).

use crate::tokenizer_config::{TokenizerConfig, TokenizerConfigError};
use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;
use tokenizers::models::ModelWrapper;
use tokenizers::{AddedToken, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{source_name}: {message}")]
    Load { source_name: String, message: String },
    #[error(transparent)]
    Config(#[from] TokenizerConfigError),
    #[error("tokenizing failed: {0}")]
    Encode(String),
    #[error("detokenizing failed: {0}")]
    Decode(String),
}

/// A special token's text and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub text: String,
    pub id: u32,
}

pub struct TextTokenizer {
    inner: Tokenizer,
    config: TokenizerConfig,
    bos: Option<SpecialToken>,
    eos: Option<SpecialToken>,
    special_ids: HashSet<u32>,
    /// `inner` with the text of every added token encoded as plain text (`encode_as_plain_text`),
    /// built on first use: most servers never need it.
    plain: OnceLock<Tokenizer>,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` and chat template files.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| TokenizerError::Load {
            source_name: path.display().to_string(),
            message: format!("cannot read: {e}"),
        })?;
        let config = TokenizerConfig::from_dir(dir)?;
        Self::from_parts(&bytes, config, &path.display().to_string())
    }

    /// Builds from `tokenizer.json` bytes and a parsed config; `source_name` names errors.
    pub fn from_parts(
        tokenizer_json: &[u8],
        config: TokenizerConfig,
        source_name: &str,
    ) -> Result<Self, TokenizerError> {
        let load_err = |message: String| TokenizerError::Load { source_name: source_name.into(), message };
        let inner =
            Tokenizer::from_bytes(tokenizer_json).map_err(|e| load_err(format!("not a tokenizer.json: {e}")))?;
        if config.clean_up_tokenization_spaces {
            if !matches!(inner.get_model(), ModelWrapper::BPE(_)) {
                return Err(load_err(
                    "clean_up_tokenization_spaces = true is not supported for non-BPE tokenizers".into(),
                ));
            }
            tracing::warn!("{source_name}: ignoring clean_up_tokenization_spaces = true for a BPE tokenizer, as transformers 5 does");
        }
        let resolve = |field: &str| -> Result<Option<SpecialToken>, TokenizerError> {
            let Some(text) = config.special_token(field) else { return Ok(None) };
            let id = inner.token_to_id(text).ok_or_else(|| {
                load_err(format!("tokenizer_config.json `{field}` {text:?} is not in the vocabulary"))
            })?;
            Ok(Some(SpecialToken { text: text.to_string(), id }))
        };
        let bos = resolve("bos_token")?;
        let eos = resolve("eos_token")?;
        let special_ids =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, token)| token.special).map(|(id, _)| id).collect();
        let tokenizer = Self { inner, config, bos, eos, special_ids, plain: OnceLock::new() };
        tokenizer.cross_check_bos_flag()?;
        Ok(tokenizer)
    }

    /// Token ids of `text`. `add_special_tokens` applies `tokenizer.json`'s post-processor
    /// (BOS for DeepSeek), as `tokenizer(text)` does in transformers.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.inner.encode_fast(text, add_special_tokens).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of a prompt rendered by the chat template: the template wrote any BOS itself.
    pub fn encode_chat_prompt(&self, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode(rendered, false)
    }

    /// Token ids of `text` with the text of any added token in it (special or not: DeepSeek's
    /// tool markers are not special) encoded as the plain text it is; no special tokens added.
    pub fn encode_as_plain_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            // `encode_special_tokens` makes the tokenizer skip the special ones when it looks for
            // added tokens in text; re-declared special (same ids), the others are skipped too.
            let added: Vec<AddedToken> =
                self.protocol_token_texts().into_iter().map(|text| AddedToken::from(text, true)).collect();
            t.add_special_tokens(&added);
            t.set_encode_special_tokens(true);
            t
        });
        let encoding = plain.encode_fast(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The texts of the special added tokens (those `skip_special_tokens` removes).
    pub fn special_token_texts(&self) -> Vec<String> {
        let decoder = self.inner.get_added_tokens_decoder();
        self.special_ids.iter().filter_map(|id| decoder.get(id).map(|t| t.content.clone())).collect()
    }

    /// The texts of every added token, special or not. The tokenizer matches an added token's
    /// text before anything else, so in a prompt that text is that single control token: for
    /// DeepSeek's they are all protocol (turns, end of sentence, tool-call and tool-output
    /// markers, which are not special, `<think>` tags, fill-in-the-middle and placeholders).
    pub fn protocol_token_texts(&self) -> Vec<String> {
        let mut texts: Vec<String> =
            self.inner.get_added_tokens_decoder().into_values().map(|t| t.content).filter(|t| !t.is_empty()).collect();
        texts.sort();
        texts.dedup();
        texts
    }

    /// Text of `ids`; ids outside the vocabulary are dropped, as transformers does.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    pub fn bos(&self) -> Option<&SpecialToken> {
        self.bos.as_ref()
    }

    pub fn eos(&self) -> Option<&SpecialToken> {
        self.eos.as_ref()
    }

    /// Whether `skip_special_tokens` removes this id when decoding.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// All ids, added tokens included (512 for the demo tokenizer).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The added tokens (`tokenizer.json`'s `added_tokens`): id, content and whether it is special.
    /// Their content is plain text, not in the byte-level alphabet of the model's vocabulary.
    pub fn added_tokens(&self) -> Vec<(u32, String, bool)> {
        let mut added: Vec<_> =
            self.inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content, t.special)).collect();
        added.sort_unstable_by_key(|&(id, _, _)| id);
        added
    }

    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// The special-token variables a chat template sees (`bos_token`, `eos_token`, ...).
    pub fn template_special_tokens(&self) -> &[(String, String)] {
        &self.config.special_tokens
    }

    /// Warns when `add_bos_token` claims something the post-processor does not do: a checkpoint
    /// built for transformers 4 could then get different prompts here (and in transformers 5).
    fn cross_check_bos_flag(&self) -> Result<(), TokenizerError> {
        let (Some(flag), Some(bos)) = (self.config.add_bos_token, &self.bos) else { return Ok(()) };
        let adds_bos = self.encode("a", true)?.first() == Some(&bos.id);
        if adds_bos != flag {
            tracing::warn!(
                add_bos_token = flag,
                post_processor_adds_bos = adds_bos,
                "tokenizer_config.json's add_bos_token disagrees with tokenizer.json; following tokenizer.json as transformers 5 does"
            );
        }
        Ok(())
    }
}
