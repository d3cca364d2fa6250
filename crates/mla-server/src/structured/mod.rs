//! Structured output (issue 15): JSON schema, any JSON object, regex, a choice of strings or a
//! Lark grammar, enforced token by token.
//!
//! The grammar engine is llguidance (crates.io `llguidance`, with `toktrie`): it is Rust (no FFI
//! or Python), it is what vLLM (`--structured-outputs-config.backend guidance`, its default
//! pick for JSON schemas xgrammar cannot do) and SGLang use, it computes a mask over a 128k
//! vocabulary in tens of microseconds without precompiling the grammar against the vocabulary,
//! and one crate covers every request form vLLM accepts (JSON schema, regex, Lark, choice).
//!
//! How a request flows:
//! 1. `wire::structured_output` reads the request's fields into one `StructuredOutput` (400 if
//!    there is more than one or it is malformed).
//! 2. The handler compiles it (`compile_requested`) on a compile thread of known stack, within
//!    the bounds of `limits` (`checks` before compiling, llguidance's own limits while
//!    compiling): a schema, regex or grammar llguidance rejects, one past a limit, one that
//!    allows no first token or no complete output, is a 400 naming the problem, never an
//!    engine failure. Its memory is charged against the server's budget (`memory`).
//! 3. The compiled matcher is cloned once per completion (`CompiledGrammar::factory`), so `n`
//!    completions share one compilation and its lexer caches but walk the grammar apart.
//! 4. The engine asks each completion's `GrammarConstraint` for a mask while the device runs the
//!    forward pass, within `mla_engine::MASK_BUDGET` (the `watchdog` cancels it past that), and
//!    reports every token drawn. A mask that fails fails its request alone.
//!
//! `StructuredOutput::Lark` is also the entry point for grammars built by the server itself
//! (`tool_choice: "required"` or a named tool: a Lark grammar of DeepSeek's tool-call format),
//! wired as a handler wires the request's own fields:
//!
//! ```ignore
//! let r = wire::Requested { output: StructuredOutput::Lark(grammar), field: "tool_choice".into(), author: Author::Server };
//! let g = structured::compile_requested(state.grammars.as_ref(), &r).await?;
//! structured::constrain(&mut engine_request, &g);
//! ```
//!
//! In such a grammar, text of a non-special added token (V3's `<｜tool▁calls▁begin｜>` ...) is a
//! plain string literal, and special tokens are written bare, `<｜end▁of▁sentence｜>`, or by id,
//! `<[1]>` (see `tok_env`).

mod checks;
mod compile_thread;
mod constraint;
pub mod lark_scan;
pub mod limits;
pub mod memory;
pub mod productive;
pub mod reasoning_gate;
pub mod regex_size;
pub mod schema_depth;
#[cfg(test)]
mod tests;
pub mod tok_env;
mod usage;
pub mod watchdog;
pub mod wire;

use compile_thread::{CompileSlots, NotCompiled};
pub use constraint::GrammarConstraint;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use memory::{GrammarMemory, Refused};
use mla_engine::MASK_BUDGET;
use reasoning_gate::{AfterReasoning, ThinkingTable};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tok_env::TokenEnv;
use usage::GrammarUsage;
use watchdog::Watchdog;

/// What one request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum StructuredOutput {
    /// JSON valid against a JSON schema (`response_format: json_schema`, `guided_json`).
    Json { schema: Value, options: JsonOptions },
    /// Any JSON object (`response_format: json_object`).
    JsonObject { options: JsonOptions },
    /// Text matching a regular expression, whole (`guided_regex`; Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// Text of a Lark grammar, llguidance's dialect (`guided_grammar`, and the tool-call hook).
    Lark(String),
}

/// The whitespace allowed between two JSON tokens unless the request says otherwise: up to 32
/// spaces or tabs, or one line break and up to 32 spaces or tabs (any pretty-printed layout).
/// vLLM leaves it unbounded (`[ \n\r\t]+`, llguidance's default), which lets a model that
/// likes whitespace loop on it until `max_tokens` and return JSON that never closes; the demo
/// model does exactly that.
pub const DEFAULT_JSON_WHITESPACE: &str = r"(?:[\x20\x09]{1,32}|\x0D?\x0A[\x20\x09]{0,32})";

/// Layout options of the JSON forms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JsonOptions {
    /// vLLM's `disable_any_whitespace`: compact JSON (`,` and `:` with no whitespace). By default
    /// whitespace is allowed between tokens (`DEFAULT_JSON_WHITESPACE`): a model trained to
    /// pretty-print may.
    pub compact: bool,
    /// llguidance's `whitespace_pattern`: a regex for the whitespace between JSON tokens
    /// (`[\x20\x0A\x0D\x09]+` is vLLM's unbounded default).
    pub whitespace_pattern: Option<String>,
    /// vLLM's `disable_additional_properties`: object schemas that do not say otherwise get
    /// `additionalProperties: false` (JSON schema's default allows any extra key).
    pub closed_objects: bool,
}

/// Who wrote a constraint: the request, or the server (the tool-call grammars of `tool_choice`,
/// in which only the tools' schemas come from the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Author {
    Request,
    Server,
}

impl StructuredOutput {
    /// The schema llguidance compiles for the JSON forms: the request's, with the layout options.
    fn compiled_schema(&self) -> Option<Value> {
        match self {
            StructuredOutput::Json { schema, options } => Some(with_options(schema, options)),
            StructuredOutput::JsonObject { options } => Some(with_options(&json!({"type": "object"}), options)),
            _ => None,
        }
    }

    /// The grammar llguidance compiles; `schema` is `compiled_schema()`.
    fn grammar(&self, schema: Option<Value>) -> TopLevelGrammar {
        match (self, schema) {
            (StructuredOutput::Json { .. } | StructuredOutput::JsonObject { .. }, Some(schema)) => {
                TopLevelGrammar::from_json_schema(schema)
            }
            (StructuredOutput::Json { .. } | StructuredOutput::JsonObject { .. }, None) => {
                unreachable!("the JSON forms have a schema")
            }
            (StructuredOutput::Regex(rx), _) => TopLevelGrammar::from_regex(rx),
            (StructuredOutput::Choice(choices), _) => {
                let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            (StructuredOutput::Lark(lark), _) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }

    /// The request field it came from, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            StructuredOutput::Json { .. } => "JSON schema",
            StructuredOutput::JsonObject { .. } => "JSON object",
            StructuredOutput::Regex(_) => "regex",
            StructuredOutput::Choice(_) => "choice",
            StructuredOutput::Lark(_) => "grammar",
        }
    }
}

/// The schema with llguidance's layout options in its `x-guidance` key (a key the client set
/// there wins). Boolean schemas (`true`) have nowhere to put them and keep the defaults.
fn with_options(schema: &Value, options: &JsonOptions) -> Value {
    let mut schema = schema.clone();
    if options.closed_objects {
        close_objects(&mut schema);
    }
    if let Value::Object(map) = &mut schema {
        let guidance = map.entry("x-guidance").or_insert_with(|| json!({}));
        if let Value::Object(g) = guidance {
            if options.compact {
                g.entry("whitespace_flexible").or_insert(json!(false));
                g.entry("item_separator").or_insert(json!(","));
                g.entry("key_separator").or_insert(json!(":"));
            }
            if !options.compact {
                let pattern = options.whitespace_pattern.as_deref().unwrap_or(DEFAULT_JSON_WHITESPACE);
                g.entry("whitespace_pattern").or_insert(json!(pattern));
            }
        }
    }
    schema
}

/// Adds `additionalProperties: false` to every object schema (one with `"type": "object"` or
/// `properties`) that does not set it, at any depth (`$defs`, `items`, `anyOf` ...).
fn close_objects(v: &mut Value) {
    match v {
        Value::Object(map) => {
            let is_object_schema =
                map.get("type").is_some_and(|t| t == "object") || map.get("properties").is_some_and(Value::is_object);
            if is_object_schema && !map.contains_key("additionalProperties") {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            map.values_mut().for_each(close_objects);
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// The served model's grammar compiler: the token trie and llguidance's per-vocabulary tables,
/// built once at startup (`Grammars::new`, a second or so for a 128k vocabulary) and shared,
/// with what bounds every grammar: compile slots, the mask watchdog, the memory budget.
pub struct Grammars {
    factory: ParserFactory,
    eos: Eos,
    vocab_size: usize,
    /// For grammars that start after a reasoning model's thinking (`reasoning_gate`).
    thinking: Arc<ThinkingTable>,
    watchdog: Arc<Watchdog>,
    memory: Arc<GrammarMemory>,
    slots: CompileSlots,
}

/// Every id that ends a completion (`ModelLimits::eos_token_ids`): a finished grammar allows all
/// of them, and llguidance's one EOS (`matcher`) stands for any of them.
#[derive(Clone)]
struct Eos {
    all: Arc<[u32]>,
    matcher: u32,
}

/// Why a constraint was not compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompileError {
    /// The request's fault (400): invalid, past a limit, allows no output.
    Invalid(String),
    /// The server's state (503): the grammar memory budget is in use.
    Busy(String),
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompileError::Invalid(why) | CompileError::Busy(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for CompileError {}

impl Grammars {
    /// `eos_ids` must not be empty; the tokenizer's own EOS is preferred as llguidance's EOS.
    pub fn new(text: Arc<crate::text::TextPipeline>, vocab_size: usize, eos_ids: &[u32]) -> anyhow::Result<Self> {
        let eos = text
            .tokenizer()
            .eos()
            .map(|t| t.id)
            .filter(|id| eos_ids.contains(id))
            .or_else(|| eos_ids.first().copied())
            .ok_or_else(|| anyhow::anyhow!("the model declares no end-of-sequence token"))?;
        let env = TokenEnv::new(text, vocab_size, eos)?;
        if env.fallbacks > 0 {
            tracing::warn!(
                "structured output: {} tokens are not in the byte-level alphabet; their bytes come from decoding",
                env.fallbacks
            );
        }
        let env: toktrie::TokEnv = Arc::new(env);
        let trie = env.tok_trie();
        let thinking =
            Arc::new(ThinkingTable::new((0..vocab_size as u32).map(|id| trie.token(id).to_vec()), vocab_size));
        let mut factory = ParserFactory::new_simple(&env)?;
        // Errors reach the client as 400s; llguidance's own stderr logging would duplicate them.
        factory.quiet();
        *factory.limits_mut() = limits::parser_limits();
        Ok(Grammars {
            factory,
            eos: Eos { all: eos_ids.into(), matcher: eos },
            vocab_size,
            thinking,
            watchdog: Arc::new(Watchdog::new()?),
            memory: GrammarMemory::new(limits::GRAMMAR_MEMORY_BUDGET, limits::GRAMMAR_MEMORY_PER_REQUEST),
            slots: CompileSlots::new(limits::compile_threads()),
        })
    }

    /// Compiles a request's `so` on a thread of its own with the compile stack, waiting for it
    /// (tests, benchmarks; the server uses `compile_requested`, which also bounds the wait).
    pub fn compile(&self, so: &StructuredOutput) -> Result<CompiledGrammar, CompileError> {
        self.compile_by(so, Author::Request)
    }

    /// `compile` for a constraint of `author`.
    pub fn compile_by(&self, so: &StructuredOutput, author: Author) -> Result<CompiledGrammar, CompileError> {
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("mla-grammar".into())
                .stack_size(limits::COMPILE_STACK)
                .spawn_scoped(scope, || self.compile_here(so, author))
                .map_err(|e| CompileError::Busy(format!("cannot start a grammar compile thread: {e}")))?
                .join()
                .unwrap_or_else(|_| Err(CompileError::Busy("the grammar compiler panicked".into())))
        })
    }

    /// Answers every request waiting for a compilation, and every later one, with "shutting
    /// down" (the engine takes no new requests once the server drains).
    pub fn close(&self) {
        self.slots.close();
    }

    /// Grammar memory charged now (`memory`).
    pub fn memory_used(&self) -> usize {
        self.memory.used()
    }

    /// The compilation itself; it must run on a thread with `limits::COMPILE_STACK`.
    fn compile_here(&self, so: &StructuredOutput, author: Author) -> Result<CompiledGrammar, CompileError> {
        if let StructuredOutput::Choice(c) = so {
            if c.is_empty() {
                return Err(CompileError::Invalid("the list of choices is empty".into()));
            }
        }
        let schema = so.compiled_schema();
        checks::check(so, author, schema.as_ref()).map_err(CompileError::Invalid)?;
        let parser =
            self.factory.create_parser(so.grammar(schema)).map_err(|e| CompileError::Invalid(e.to_string()))?;
        let shape = productive::analyse(parser.parser.grammar());
        if !shape.can_complete {
            return Err(CompileError::Invalid(
                "no finite output can complete it (every way through it goes on forever, as `start: \"a\" start` does)"
                    .into(),
            ));
        }
        // A shallow clone shares the lexer that every completion's matcher will grow.
        let probe = parser.clone();
        let mut matcher = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(e) = matcher.get_error() {
            return Err(CompileError::Invalid(e));
        }
        self.check_first_mask(&mut matcher)?;
        let usage =
            GrammarUsage::charge(&self.memory, probe, shape.symbols, shape.rule_elements).map_err(|r| match r {
                Refused::TooLarge { .. } => CompileError::Invalid(r.to_string()),
                Refused::BudgetFull { .. } => CompileError::Busy(r.to_string()),
            })?;
        Ok(CompiledGrammar {
            matcher: Arc::new(Mutex::new(matcher)),
            eos: self.eos.clone(),
            thinking: self.thinking.clone(),
            watchdog: self.watchdog.clone(),
            usage: Arc::new(usage),
        })
    }

    /// The first mask, under the engine's budget for a mask: it must allow a token or the end
    /// (a grammar that matches the empty text allows the end). Computed here, the lexer states
    /// it needs are ready for every completion.
    fn check_first_mask(&self, matcher: &mut Matcher) -> Result<(), CompileError> {
        let computed = {
            let handle = matcher.cancellation_handle().expect("the matcher is cancellable");
            let _armed = self.watchdog.arm(Instant::now() + MASK_BUDGET, handle);
            matcher.compute_mask()
        };
        let allows_something = match computed {
            Ok(mask) => mask.num_set() > 0,
            Err(_) if matcher.is_cancelled() => {
                return Err(CompileError::Invalid(format!(
                    "computing its first token mask took longer than the budget of {} ms for a mask: it is too expensive to follow",
                    MASK_BUDGET.as_millis()
                )))
            }
            Err(_) => false,
        };
        if !allows_something {
            return Err(CompileError::Invalid("it allows no output: no token can start it".into()));
        }
        Ok(())
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn tok_env(&self) -> &toktrie::TokEnv {
        self.factory.tok_env()
    }
}

/// One request's compiled grammar: the matcher every completion starts from.
#[derive(Clone)]
pub struct CompiledGrammar {
    /// Cloned per completion; the mutex only makes the prototype shareable across threads.
    matcher: Arc<Mutex<Matcher>>,
    eos: Eos,
    thinking: Arc<ThinkingTable>,
    watchdog: Arc<Watchdog>,
    /// The grammar's memory charge, given back when the last completion is dropped.
    usage: Arc<GrammarUsage>,
}

impl CompiledGrammar {
    /// A fresh constraint at the grammar's start.
    ///
    /// `stop_ids` are the request's stop tokens and `min_tokens` its vLLM `min_tokens`: while
    /// fewer tokens have been drawn, the constraint leaves the stop tokens out of its masks
    /// unless the grammar allows nothing else. (The engine's own `min_tokens` must then be 0:
    /// it bans stop tokens with `-inf` regardless, and a complete grammar that only allows EOS
    /// would leave no token at all.)
    pub fn constraint(&self, stop_ids: Arc<[u32]>, min_tokens: usize) -> GrammarConstraint {
        // A poisoned lock means a clone panicked half-way: the prototype itself is untouched.
        let matcher = self.matcher.lock().unwrap_or_else(|p| p.into_inner()).clone();
        GrammarConstraint::new(matcher, self, stop_ids, min_tokens)
    }

    /// The engine's factory: one constraint per completion.
    pub fn factory(&self, stop_ids: Vec<u32>, min_tokens: usize) -> mla_engine::ConstraintFactory {
        let grammar = self.clone();
        let stop_ids: Arc<[u32]> = stop_ids.into();
        mla_engine::ConstraintFactory(Arc::new(move || Box::new(grammar.constraint(stop_ids.clone(), min_tokens))))
    }

    /// `factory` for a reasoning model: each completion thinks freely, then follows the grammar
    /// (`reasoning_gate`). `min_tokens` counts the thinking tokens too.
    pub fn factory_after_reasoning(&self, stop_ids: Vec<u32>, min_tokens: usize) -> mla_engine::ConstraintFactory {
        let grammar = self.clone();
        let stop_ids: Arc<[u32]> = stop_ids.into();
        mla_engine::ConstraintFactory(Arc::new(move || {
            let inner = grammar.constraint(stop_ids.clone(), min_tokens);
            Box::new(AfterReasoning::new(inner, grammar.thinking.clone()))
        }))
    }
}

/// Compiles a request's constraint on a compile thread (`compile_thread`), waiting at most
/// `limits::COMPILE_TIMEOUT` for a slot and as long for the compilation. An invalid schema,
/// regex or grammar, or one past a limit, is a 400 naming the field; a busy server a 503.
/// `grammars` is `None` when the model cannot do structured output (no EOS token).
pub async fn compile_requested(
    grammars: Option<&Arc<Grammars>>,
    r: &wire::Requested,
) -> Result<CompiledGrammar, crate::error::ApiError> {
    use crate::error::ApiError;
    let grammars = grammars.ok_or_else(|| {
        ApiError::invalid(
            &r.field,
            "structured output is not available for this model (it has no end-of-sequence token)",
        )
    })?;
    let (g, so, author) = (grammars.clone(), r.output.clone(), r.author);
    let invalid =
        |why: String| ApiError::invalid(&r.field, format!("invalid {} in {}: {why}", r.output.kind(), r.field));
    match grammars.slots.run(move || g.compile_here(&so, author)).await {
        Ok(Ok(compiled)) => Ok(compiled),
        Ok(Err(CompileError::Invalid(why))) => Err(invalid(why)),
        Ok(Err(CompileError::Busy(why))) => Err(ApiError::Busy(why)),
        Err(NotCompiled::ShuttingDown) => Err(ApiError::ShuttingDown),
        Err(NotCompiled::TimedOut) => Err(invalid(format!(
            "compiling it took longer than {} s: it is too expensive",
            limits::COMPILE_TIMEOUT.as_secs()
        ))),
        Err(NotCompiled::Busy) => Err(ApiError::Busy(format!(
            "every grammar compiler has been busy for {} s; retry later",
            limits::COMPILE_TIMEOUT.as_secs()
        ))),
        Err(NotCompiled::Failed(why)) => Err(ApiError::Internal(why)),
    }
}

/// Puts `grammar` on an engine request built by `ModelLimits::engine_request`. Its `min_tokens`
/// moves into the constraint (see `CompiledGrammar::constraint`).
pub fn constrain(req: &mut mla_engine::GenerateRequest, grammar: &CompiledGrammar) {
    req.constraint = Some(grammar.factory(req.stop_token_ids.clone(), req.min_tokens));
    req.min_tokens = 0;
}

/// `constrain` for a chat completion of a reasoning model (`--reasoning-parser`): the grammar
/// governs what follows the thinking block, as the parser splits it off.
pub fn constrain_after_reasoning(req: &mut mla_engine::GenerateRequest, grammar: &CompiledGrammar) {
    req.constraint = Some(grammar.factory_after_reasoning(req.stop_token_ids.clone(), req.min_tokens));
    req.min_tokens = 0;
}
