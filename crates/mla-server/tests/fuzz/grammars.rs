//! Random grammars of every form a request can send, from small to past the limits, through the
//! grammar front end (`Grammars::compile_by`: the checks, llguidance, the first mask), called
//! from a thread with a 256 KiB stack: each compiles or is refused with a reason (a 400), never
//! a crash. The compiler's stack is its own (`limits::COMPILE_STACK`), so the caller's does not
//! matter; a stack overflow would abort the whole test binary.
//!
//! The shapes are the ones that took the server down before the limits (issue 25): `$ref`
//! chains, Lark rule chains, brackets, regexes with long runs of optional items, schemas inside
//! Lark. Where a case is clearly within every limit it must compile, and where it is clearly past
//! one it must be refused naming it; in between either is fine.

use crate::fuzz::config;
use mla_server::structured::limits::{MAX_LARK_BYTES, MAX_OPTIONAL_ITEMS, MAX_RECURSION};
use mla_server::structured::{Author, CompileError, Grammars, JsonOptions, StructuredOutput};
use mla_server::text::TextPipeline;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::sync::{Arc, OnceLock};

fn grammars() -> &'static Grammars {
    static GRAMMARS: OnceLock<Grammars> = OnceLock::new();
    GRAMMARS.get_or_init(|| {
        let text = Arc::new(TextPipeline::new(crate::common::demo_tokenizer(), None).unwrap());
        Grammars::new(text, 512, &[1]).unwrap()
    })
}

/// What a case must come to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Compiles,
    /// Refused, the message containing this.
    Refused(&'static str),
    /// Refused for one reason or another.
    RefusedAny,
    Either,
}

/// What a case must come to: `past` and `within` say whether its recursion is certainly past or
/// certainly within `MAX_RECURSION`, `other` names another limit it is past. The checks run
/// recursion first, then the others.
fn expect(past: bool, within: bool, other: Option<&'static str>) -> Expect {
    match (past, other) {
        (true, _) => Expect::Refused("nests too deeply"),
        (false, Some(limit)) if within => Expect::Refused(limit),
        (false, Some(_)) => Expect::RefusedAny,
        (false, None) if within => Expect::Compiles,
        (false, None) => Expect::Either,
    }
}

/// Sizes: small ones, ones near a limit, ones past it, equally often.
fn size(small: u32, near: u32, past: u32) -> impl Strategy<Value = u32> {
    prop_oneof![1..=small, (near * 9 / 10)..=near, past..=past * 3 / 2]
}

/// A schema nesting `wrap` levels inside each of `links` chained definitions; its `pattern`
/// has `optional` optional items.
fn schema(links: u32, wrap: u32, optional: u32) -> Value {
    let leaf = |i: u32| {
        let mut v = if i + 1 < links {
            json!({"$ref": format!("#/$defs/d{}", i + 1)})
        } else {
            json!({"type": "string", "pattern": format!("{}b", "a?".repeat(optional as usize))})
        };
        for w in 0..wrap {
            v = match w % 3 {
                0 => json!({"type": "object", "properties": {"p": v}, "required": ["p"]}),
                1 => json!({"type": "array", "items": v, "minItems": 1, "maxItems": 2}),
                _ => json!({"anyOf": [v, {"type": "null"}]}),
            };
        }
        v
    };
    let defs: Map<String, Value> = (0..links).map(|i| (format!("d{i}"), leaf(i))).collect();
    json!({"$ref": "#/$defs/d0", "$defs": defs})
}

/// A Lark grammar: `rules` chained rules, each wrapped in `brackets` groups, ending in a regex
/// with `optional` optional items; with a schema of `links` chained definitions inside.
fn lark(rules: u32, brackets: u32, optional: u32, links: u32) -> String {
    let mut g = String::from("start: r0 tail\n");
    for i in 0..rules {
        let next = if i + 1 < rules { format!(" r{}", i + 1) } else { String::new() };
        let open = "(".repeat(brackets as usize);
        let close = ")".repeat(brackets as usize);
        g.push_str(&format!("r{i}: {open}\"a\"{next}{close}\n"));
    }
    g.push_str(&format!("tail: /{}b/", "c?".repeat(optional as usize)));
    if links > 0 {
        g.push_str(&format!(" %json {}", schema(links, 1, 0)));
    }
    g.push('\n');
    g
}

fn check(so: StructuredOutput, author: Author, expect: Expect) -> Result<(), TestCaseError> {
    // A 256 KiB caller: the compilation must not use its stack.
    let got = std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn_scoped(s, || grammars().compile_by(&so, author).map(|_| ()))
            .unwrap()
            .join()
            .expect("the front end panicked")
    });
    match (&got, expect) {
        (Err(CompileError::Busy(why)), _) => prop_assert!(false, "a lone grammar hit the memory budget: {why}"),
        (Ok(()), Expect::Refused(limit)) => prop_assert!(false, "compiled, but it is past a limit ({limit})"),
        (Err(CompileError::Invalid(why)), Expect::Compiles) => prop_assert!(false, "refused within the limits: {why}"),
        (Err(CompileError::Invalid(why)), Expect::Refused(limit)) => {
            prop_assert!(why.contains(limit), "refused for another reason than {limit}: {why}")
        }
        (Ok(()), Expect::RefusedAny) => prop_assert!(false, "compiled, but it is past a limit"),
        (Err(CompileError::Invalid(why)), Expect::Either | Expect::RefusedAny) => prop_assert!(!why.is_empty()),
        (Ok(()), _) => {}
    }
    Ok(())
}

/// What the limits say about a schema of `schema(links, wrap, optional)`: each link costs one
/// level for the reference and its definition's depth, which is 1 + wrap to 1 + 2 wrap.
fn expect_schema(links: u32, wrap: u32, optional: u32) -> Expect {
    let (least, most) = (links as usize * (2 + wrap as usize), links as usize * (3 + 2 * wrap as usize) + 16);
    let other = (optional as usize > MAX_OPTIONAL_ITEMS).then_some("optional items");
    expect(least > MAX_RECURSION, most <= MAX_RECURSION, other)
}

proptest! {
    #![proptest_config(config(24))]

    #[test]
    fn schemas_compile_or_are_refused_naming_the_limit(
        links in size(40, 2000, 3000),
        wrap in 0u32..4,
        optional in size(64, MAX_OPTIONAL_ITEMS as u32, MAX_OPTIONAL_ITEMS as u32 + 1),
    ) {
        let so = StructuredOutput::Json { schema: schema(links, wrap, optional), options: JsonOptions::default() };
        check(so, Author::Request, expect_schema(links, wrap, optional))?;
    }

    #[test]
    fn lark_grammars_compile_or_are_refused_naming_the_limit(
        rules in size(60, 8000, 9000),
        brackets in 0u32..12,
        optional in size(64, MAX_OPTIONAL_ITEMS as u32, MAX_OPTIONAL_ITEMS as u32 + 1),
        links in prop_oneof![Just(0u32), 1..50u32, 2500..3000u32],
        by_server in any::<bool>(),
    ) {
        let text = lark(rules, brackets, optional, links);
        let author = if by_server { Author::Server } else { Author::Request };
        // Each rule costs one level and its brackets; the embedded schema 4 per link and its root.
        let levels = rules as usize * (1 + brackets as usize) + 4 * links as usize;
        let other = (optional as usize > MAX_OPTIONAL_ITEMS).then_some("optional items");
        let expect = match author == Author::Request && text.len() > MAX_LARK_BYTES {
            true => Expect::Refused("bytes long"),
            false => expect(levels > MAX_RECURSION + 16, levels + 16 <= MAX_RECURSION, other),
        };
        check(StructuredOutput::Lark(text), author, expect)?;
    }

    #[test]
    fn regexes_compile_or_are_refused_naming_the_limit(
        optional in size(200, MAX_OPTIONAL_ITEMS as u32, MAX_OPTIONAL_ITEMS as u32 + 1),
        literal in 0usize..3000,
        nesting in 0usize..40,
    ) {
        let rx = format!("{}{}{}{}", "(".repeat(nesting), "a?".repeat(optional as usize), ")".repeat(nesting), "a".repeat(literal));
        let expect = match () {
            _ if optional as usize > MAX_OPTIONAL_ITEMS => Expect::Refused("optional items"),
            _ => Expect::Either,
        };
        check(StructuredOutput::Regex(rx), Author::Request, expect)?;
    }
}
