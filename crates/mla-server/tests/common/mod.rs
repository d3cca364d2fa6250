//! Shared helpers of the text-layer tests.
//!
//! NOTE (http helper): this file was accidentally overwritten by the HTTP-layer helper and then
//! reconstructed from how the tests use it (`demo_dir`, `demo_tokenizer`, `read_json`,
//! `template_fixtures_dir`); its owner may want to check it against the original.

#![allow(dead_code)]

use mla_server::tokenizer::TextTokenizer;
use std::path::{Path, PathBuf};

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The bundled demo model: config, generation config, tokenizer.
pub fn demo_dir() -> PathBuf {
    workspace_root().join("assets/demo")
}

/// transformers' recorded chat-template renderings and tokenizer outputs.
pub fn template_fixtures_dir() -> PathBuf {
    workspace_root().join("tests/fixtures/templates")
}

pub fn demo_tokenizer() -> TextTokenizer {
    TextTokenizer::from_dir(&demo_dir()).unwrap()
}

pub fn read_json(path: impl AsRef<Path>) -> serde_json::Value {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
