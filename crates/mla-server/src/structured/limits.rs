//! The bounds on a request's grammar: what it may ask the compiler to do, how long and how much
//! memory that may take. Each refusal names its limit; README's limits section lists them.
//!
//! The figures behind them (demo tokenizer, one core of the 2-core CI machine, llguidance
//! 1.9.1 built with opt-level 3 as in both of our profiles):
//! - Stack: compiling a `$ref` chain takes about 9.5 KB of stack per link, that is 2.4 KB per
//!   unit of `schema_depth::recursion_bound`; a Lark rule chain about 3 KB per unit of
//!   `lark_depth::recursion_bound`, less with brackets (2.2 KB per unit). At `MAX_RECURSION`
//!   that is at most 24 MiB, against `COMPILE_STACK` of 128 MiB: more than 5x to spare.
//! - Time and memory: derivative-based regex matching (llguidance's) pays quadratically for a
//!   long run of optional items in one regex: `a?` x n then `a` x n took 0.11 s to compile and
//!   28 MB at n = 2000, 2.9 s and 400 MB at n = 10000, 17 s and 2.4 GB at n = 25000, and its
//!   first mask as long again; llguidance's fuel does not stop it. `MAX_OPTIONAL_ITEMS` and
//!   `MAX_REGEX_BYTES` keep each regex well below that (`regex_size`), and `MAX_LARK_BYTES`
//!   bounds the same run written as a Lark token (`T: "a"? "a"? ...`), which is one regex too. Counted repetitions (`(a?){2000}`)
//!   stay compact and compile in 2 ms.

use llguidance::api::ParserLimits;
use std::time::Duration;

/// Stack of the thread each compilation runs on (`compile_thread`): reserved address space,
/// touched only as deep as a compilation recurses.
pub const COMPILE_STACK: usize = 128 << 20;

/// Most compiler recursion a grammar may need, in the units of `schema_depth` and `lark_depth`
/// (a `$ref` chain of about 2000 links, a Lark rule chain of 8000).
pub const MAX_RECURSION: usize = 8192;

/// Longest Lark grammar a request may send (`guided_grammar`, `structured_outputs.grammar`).
/// Grammars the server builds for tool calls are not counted: their schemas are checked as
/// schemas.
pub const MAX_LARK_BYTES: usize = 16 << 10;

/// Longest regex (`guided_regex`, a Lark `/regex/`, a JSON schema's `pattern` and
/// `patternProperties`, `whitespace_pattern`).
pub const MAX_REGEX_BYTES: usize = 16 << 10;

/// Most optional items (`x?`, `x*`, `x{0,n}`, an empty alternative) in one such regex.
pub const MAX_OPTIONAL_ITEMS: usize = 1024;

/// How long a request waits for a compile slot (503 past it: the compilers are busy), and then
/// for its compilation (400 past it: the grammar is too expensive).
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(10);

/// llguidance's lexer states for one grammar (its default is 250,000 at 1-2 KB each).
pub const MAX_LEXER_STATES: usize = 50_000;

/// The memory one request's grammar may hold (its lexer and compiled grammar); beyond it the
/// request is refused (400) or, when its lexer grows past it while generating, fails alone.
pub const GRAMMAR_MEMORY_PER_REQUEST: usize = 64 << 20;

/// The memory all live grammars may hold together; a grammar that would go beyond it is refused
/// with 503 (retry later) or, growing while generating, fails alone.
pub const GRAMMAR_MEMORY_BUDGET: usize = 1 << 30;

/// llguidance's limits for every grammar: its defaults but for the lexer's state count.
pub fn parser_limits() -> ParserLimits {
    ParserLimits { max_lexer_states: MAX_LEXER_STATES, ..ParserLimits::default() }
}

/// Concurrent compilations: half the host's cores, so compiling never takes every core from
/// the engine and the HTTP side (one on the 2-core CI machine).
pub fn compile_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}
