//! Property tests in the place of a fuzzer: cargo-fuzz needs a nightly compiler and CI runs
//! stable, so proptest generates the inputs (and shrinks a failure to a small one).
//!
//! - `fuzz/requests.rs`: random request bodies, structured and raw bytes, through the real router
//!   over a scripted engine: never a 5xx, every error in OpenAI's shape, every stream well formed.
//! - `fuzz/generation.rs`: random scripts, stop tokens and stop strings through the same router:
//!   every choice's text, streamed or not, is the tokenizer's one-shot decode of the script.
//! - `fuzz/grammars.rs`: random schemas, Lark grammars and regexes from small to past the limits
//!   through the grammar front end, from a small stack: each compiles or is refused naming its
//!   limit, never a crash.
//! - `fuzz/chat_template.rs`: random conversations through the DeepSeek-V2 and V3 templates:
//!   rendering fails only with a client error (400), and message text comes out verbatim.
//! - `fuzz/detokenizer.rs`: random ids through the incremental detokenizer: the deltas add up to
//!   the one-shot decode and nothing decodable is held back.
//!
//! Each property runs `PROPTEST_CASES` cases, by default the count its `config` call names
//! (chosen so that the whole target takes a few seconds in a debug build on a 2-core machine).
//! Fuzz longer with e.g. `PROPTEST_CASES=100000 cargo test -p mla-server --test server -- fuzz::`
//! (add `--release` for speed, a name such as `fuzz::requests::` for one module);
//! `PROPTEST_RNG_SEED=<u64>` replays one run exactly.
//!
//! A failure prints the shrunk input and the seed line `cc <hex>`, which proptest also appends to
//! `fuzz/<module>.proptest-regressions` (on CI, copy it from the log) and replays first on every
//! later run. Commit that file with the fix, as proptest recommends, and add the shrunk input as a
//! plain test next to the code it broke: a saved seed reproduces the input only while the
//! generators stay the same.

#[path = "fuzz/chat_template.rs"]
mod chat_template;
use crate::common;
#[path = "fuzz/detokenizer.rs"]
mod detokenizer;
#[path = "fuzz/generation.rs"]
mod generation;
#[path = "fuzz/grammars.rs"]
mod grammars;
#[path = "fuzz/http.rs"]
mod http;
#[path = "fuzz/requests.rs"]
mod requests;
#[path = "fuzz/values.rs"]
mod values;

use mla_server::tokenizer::TextTokenizer;
use proptest::test_runner::{Config, FileFailurePersistence};
use std::sync::OnceLock;

/// `cases` per property unless `PROPTEST_CASES` is set; failures saved next to the module.
fn config(cases: u32) -> Config {
    Config {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    }
}

/// The demo tokenizer, loaded once for all cases.
fn tokenizer() -> &'static TextTokenizer {
    static TOKENIZER: OnceLock<TextTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(common::demo_tokenizer)
}
