use super::wire::{requested, StructuredWire};
use super::*;
use crate::protocol::parse_fields;
use crate::text::TextPipeline;
use crate::tokenizer::TextTokenizer;
use mla_engine::TokenConstraint;
use std::path::PathBuf;
use toktrie::TokTrie;

const EOS: u32 = 1;

fn demo_text() -> Arc<TextPipeline> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo");
    Arc::new(TextPipeline::new(TextTokenizer::from_dir(&dir).unwrap(), None).unwrap())
}

/// The demo tokenizer in a model whose vocabulary is larger than the tokenizer (600 > 512).
fn grammars() -> Grammars {
    Grammars::new(demo_text(), 600, &[EOS]).unwrap()
}

fn allowed(c: &mut dyn TokenConstraint, vocab: usize) -> Vec<u32> {
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    c.fill_mask(&mut mask, std::time::Instant::now() + mla_engine::MASK_BUDGET).unwrap();
    (0..vocab as u32).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect()
}

/// Feeds the tokenizer's tokens of `text`, checking each was allowed first.
fn feed(c: &mut dyn TokenConstraint, text: &str) {
    let ids = demo_text().tokenizer().encode(text, false).unwrap();
    for t in ids {
        assert!(allowed(c, 600).contains(&t), "token {t} of {text:?} not allowed");
        c.accept(t).unwrap();
    }
}

#[test]
fn token_bytes_round_trip_through_the_trie() {
    let text = demo_text();
    let (words, fallbacks) = tok_env::token_bytes(text.tokenizer(), 600);
    assert_eq!(fallbacks, 0, "the demo tokenizer is byte-level throughout");
    // Special tokens carry toktrie's marker; non-special added tokens are their text; ids past
    // the tokenizer have no bytes.
    assert_eq!(words[1], [&[TokTrie::SPECIAL_TOKEN_MARKER][..], "<｜end▁of▁sentence｜>".as_bytes()].concat());
    assert_eq!(words[503], [&[0xFF], "<｜tool▁calls▁begin｜>".as_bytes()].concat());
    assert!(words[512..].iter().all(|w| w.is_empty()));
    // The bytes of a text's tokens are the text, whatever its characters.
    for s in ["Hello there, world!\n\tindented", "naïve café — 東京 ✓ 🙂", "{\"a\": [1, 2.5e-3, null]}"] {
        let ids = text.tokenizer().encode(s, false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&t| words[t as usize].clone()).collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), s);
    }
    let g = grammars();
    let trie = g.tok_env().tok_trie();
    assert_eq!((trie.vocab_size(), trie.eos_token()), (600, EOS));
    assert!(trie.is_special_token(0) && trie.is_special_token(503), "added tokens are control tokens");
}

#[test]
fn invalid_grammars_are_compile_errors() {
    let g = grammars();
    let err = |so: StructuredOutput| g.compile(&so).err().unwrap_or_else(|| panic!("{so:?} compiled")).to_string();
    assert!(!err(StructuredOutput::Regex("(unclosed".into())).is_empty());
    let e = err(StructuredOutput::Json { schema: json!({"type": "nonsense"}), options: JsonOptions::default() });
    assert!(e.contains("nonsense"), "{e}");
    assert!(!err(StructuredOutput::Lark("start: missing_rule".into())).is_empty());
    assert!(!err(StructuredOutput::Choice(vec![])).is_empty());
    for ok in [
        StructuredOutput::Regex("[0-9]{3}".into()),
        StructuredOutput::JsonObject { options: JsonOptions::default() },
        StructuredOutput::Lark("start: \"yes\" | \"no\"".into()),
        StructuredOutput::Json { schema: json!(true), options: JsonOptions::default() },
    ] {
        g.compile(&ok).unwrap();
    }
}

#[test]
fn a_choice_driven_token_by_token_then_only_eos() {
    let g = grammars();
    let choices = vec!["yes".to_string(), "no (really)".to_string()];
    let compiled = g.compile(&StructuredOutput::Choice(choices)).unwrap();
    let mut c = compiled.constraint(Arc::from(vec![EOS]), 0);
    let first = allowed(&mut c, 600);
    assert!(!first.contains(&EOS) && first.iter().all(|&t| t < 512), "{first:?}");
    feed(&mut c, "no (really)");
    assert_eq!(allowed(&mut c, 600), vec![EOS], "a complete choice allows only EOS");
    c.accept(EOS).unwrap();
    // With ignore_eos the engine keeps drawing: EOS, and nothing else, forever.
    assert_eq!(allowed(&mut c, 600), vec![EOS]);
    c.accept(EOS).unwrap();
    assert!(c.accept(40).is_err());
    // A token the grammar refuses is an error, not silently accepted.
    let mut d = compiled.constraint(Arc::from(vec![EOS]), 0);
    let x = demo_text().tokenizer().encode("x", false).unwrap()[0];
    assert!(d.accept(x).is_err());
}

#[test]
fn a_json_schema_document_is_accepted_and_completes() {
    let g = grammars();
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false
    });
    for (compact, doc) in [(true, r#"{"name":"Ada","age":36}"#), (false, "{\"name\": \"Ada\",\n  \"age\": 36}")] {
        let so = StructuredOutput::Json {
            schema: schema.clone(),
            options: JsonOptions { compact, ..JsonOptions::default() },
        };
        let mut c = g.compile(&so).unwrap().constraint(Arc::from(vec![EOS]), 0);
        feed(&mut c, doc);
        assert_eq!(allowed(&mut c, 600), vec![EOS], "{doc}");
        c.accept(EOS).unwrap();
        assert!(c.is_finished());
    }
    // A missing required key cannot close the object.
    let so = StructuredOutput::Json { schema, options: JsonOptions { compact: true, ..JsonOptions::default() } };
    let mut c = g.compile(&so).unwrap().constraint(Arc::from(vec![EOS]), 0);
    feed(&mut c, r#"{"name":"Ada""#);
    let close = demo_text().tokenizer().encode("}", false).unwrap()[0];
    assert!(!allowed(&mut c, 600).contains(&close));
}

#[test]
fn whitespace_between_json_tokens_is_bounded_by_default() {
    let g = grammars();
    let space = g.tok_env().tok_trie().token_id_at_bytes(b" ").expect("a lone space token");
    let mut c = g
        .compile(&StructuredOutput::JsonObject { options: JsonOptions::default() })
        .unwrap()
        .constraint(Arc::from(vec![EOS]), 0);
    feed(&mut c, "{");
    for _ in 0..32 {
        assert!(allowed(&mut c, 600).contains(&space));
        c.accept(space).unwrap();
    }
    assert!(!allowed(&mut c, 600).contains(&space), "a 33rd space");
    feed(&mut c, "\"k\": 1}");
    assert_eq!(allowed(&mut c, 600), vec![EOS]);
}

#[test]
fn min_tokens_keeps_stop_tokens_out_until_only_they_remain() {
    let g = grammars();
    let compiled = g.compile(&StructuredOutput::Regex("a+".into())).unwrap();
    let mut c = compiled.constraint(Arc::from(vec![EOS]), 3);
    feed(&mut c, "a");
    assert!(!allowed(&mut c, 600).contains(&EOS), "stop tokens wait for min_tokens");
    let mut c = compiled.constraint(Arc::from(vec![EOS]), 0);
    feed(&mut c, "a");
    assert!(allowed(&mut c, 600).contains(&EOS));
    // A grammar that can only stop wins over min_tokens: the mask is never empty.
    let compiled = g.compile(&StructuredOutput::Choice(vec!["a".into()])).unwrap();
    let mut c = compiled.constraint(Arc::from(vec![EOS]), 5);
    feed(&mut c, "a");
    assert_eq!(allowed(&mut c, 600), vec![EOS]);
}

#[test]
fn n_completions_walk_the_grammar_apart() {
    let g = grammars();
    let compiled = g.compile(&StructuredOutput::Choice(vec!["ab".into(), "cd".into()])).unwrap();
    let factory = compiled.factory(vec![EOS], 0);
    let (mut a, mut b) = ((factory.0)(), (factory.0)());
    let tok = |s: &str| demo_text().tokenizer().encode(s, false).unwrap();
    for t in tok("ab") {
        a.accept(t).unwrap();
    }
    for t in tok("cd") {
        b.accept(t).unwrap();
    }
    assert!(a.accept(EOS).is_ok() && b.accept(EOS).is_ok());
}

fn wire(body: serde_json::Value) -> Result<Option<wire::Requested>, crate::error::ApiError> {
    requested(parse_fields::<StructuredWire>(&body).unwrap())
}

fn param(e: crate::error::ApiError) -> String {
    match e {
        crate::error::ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn request_fields() {
    assert_eq!(wire(json!({})).unwrap(), None);
    assert_eq!(wire(json!({"response_format": {"type": "text"}})).unwrap(), None);
    let r = wire(json!({"response_format": {"type": "json_object"}})).unwrap().unwrap();
    assert_eq!(r.output, StructuredOutput::JsonObject { options: JsonOptions::default() });
    let schema = json!({"type": "object"});
    let r = wire(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}))
        .unwrap()
        .unwrap();
    assert_eq!((r.field.as_str(), r.output.kind()), ("response_format", "JSON schema"));
    // guided_json as a string holding the schema, as vLLM's clients send it.
    let r = wire(json!({"guided_json": "{\"type\": \"object\"}"})).unwrap().unwrap();
    assert_eq!(r.output, StructuredOutput::Json { schema: schema.clone(), options: JsonOptions::default() });
    let r =
        wire(json!({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": true}})).unwrap().unwrap();
    assert_eq!(r.output, StructuredOutput::Choice(vec!["a".into(), "b".into()]));
    let r = wire(json!({"structured_outputs": {"json": schema, "disable_any_whitespace": true}})).unwrap().unwrap();
    assert!(matches!(r.output, StructuredOutput::Json { options: JsonOptions { compact: true, .. }, .. }));
    assert_eq!(wire(json!({"guided_grammar": "start: \"x\""})).unwrap().unwrap().output.kind(), "grammar");

    // Two constraints, or a malformed one, are 400s naming a field.
    assert_eq!(param(wire(json!({"guided_regex": "a", "guided_choice": ["b"]})).unwrap_err()), "guided_choice");
    assert_eq!(
        param(wire(json!({"response_format": {"type": "json_object"}, "guided_json": {}})).unwrap_err()),
        "guided_json"
    );
    assert_eq!(param(wire(json!({"guided_choice": []})).unwrap_err()), "guided_choice");
    assert_eq!(param(wire(json!({"guided_json": "{not json"})).unwrap_err()), "guided_json");
    assert_eq!(param(wire(json!({"guided_json": 3})).unwrap_err()), "guided_json");
    assert_eq!(
        param(wire(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})).unwrap_err()),
        "response_format.json_schema.schema"
    );
    assert_eq!(param(wire(json!({"response_format": {"type": "yaml"}})).unwrap_err()), "response_format.type");
    assert_eq!(
        param(wire(json!({"response_format": {"type": "structural_tag"}})).unwrap_err()),
        "response_format.structural_tag"
    );
}

#[test]
fn compile_errors_name_the_field() {
    let g = Arc::new(grammars());
    let r = wire(json!({"guided_regex": "(unclosed"})).unwrap().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let e = rt.block_on(compile_requested(Some(&g), &r)).err().unwrap();
    assert_eq!(e.status().as_u16(), 400);
    assert_eq!(param(e), "guided_regex");
    assert!(rt.block_on(compile_requested(None, &r)).is_err());
}

#[test]
fn closed_objects_refuse_extra_keys() {
    let g = grammars();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let key = |closed_objects: bool| {
        let options = JsonOptions { compact: true, closed_objects, ..JsonOptions::default() };
        let mut c = g
            .compile(&StructuredOutput::Json { schema: schema.clone(), options })
            .unwrap()
            .constraint(Arc::from(vec![EOS]), 0);
        feed(&mut c, "{\"a\":1");
        let comma = demo_text().tokenizer().encode(",", false).unwrap()[0];
        allowed(&mut c, 600).contains(&comma)
    };
    assert!(key(false), "JSON schema allows extra keys by default");
    assert!(!key(true), "disable_additional_properties closes the object");
    let r =
        wire(json!({"structured_outputs": {"json": schema, "disable_additional_properties": true}})).unwrap().unwrap();
    assert!(matches!(r.output, StructuredOutput::Json { options: JsonOptions { closed_objects: true, .. }, .. }));
}

#[test]
fn lark_grammars_name_added_and_special_tokens() {
    // The tool-call hook: added tokens (special or not, like V3's tool markers) are control
    // tokens, named bare or by id. (llguidance also draws the control token for a string literal
    // of exactly its text.)
    let g = grammars();
    let compile =
        |lark: &str| g.compile(&StructuredOutput::Lark(lark.into())).unwrap().constraint(Arc::from(vec![EOS]), 0);
    let mut c = compile("start: <｜tool▁calls▁begin｜> \"x\"");
    assert_eq!(allowed(&mut c, 600), vec![503]);
    c.accept(503).unwrap();
    let mut c = compile("start: \"<｜tool▁calls▁begin｜>\" \"x\"");
    assert_eq!(allowed(&mut c, 600), vec![503]);
    assert_eq!(allowed(&mut compile("start: <｜User｜> \"x\""), 600), vec![501]);
    assert_eq!(allowed(&mut compile("start: <[502]>"), 600), vec![502]);
}

#[test]
fn after_reasoning_the_grammar_starts_at_the_end_of_the_thinking_block() {
    let g = grammars();
    let compiled = g.compile(&StructuredOutput::Regex("[0-9]{3}".into())).unwrap();
    let mut gated = (compiled.factory_after_reasoning(vec![EOS], 0).0)();
    // Thinking: every id with text is allowed (the 512 tokenizer ids, not the padding 512..600).
    assert_eq!(allowed(gated.as_mut(), 600), (0..512).collect::<Vec<u32>>());
    // The closing tag spelled in pieces across tokens still ends the block.
    feed(gated.as_mut(), "Let me think: 12 or 345? </thi");
    assert_eq!(allowed(gated.as_mut(), 600).len(), 512, "a partial tag keeps it thinking");
    feed(gated.as_mut(), "nk>");
    let digits = allowed(gated.as_mut(), 600);
    assert!(!digits.is_empty() && digits.len() < 20, "{digits:?}");
    feed(gated.as_mut(), "123");
    assert_eq!(allowed(gated.as_mut(), 600), vec![EOS], "the answer follows the grammar to its end");
    // Without the gate the same grammar applies from the first token.
    let mut plain = (compiled.factory(vec![EOS], 0).0)();
    assert_eq!(allowed(plain.as_mut(), 600), digits);
}

#[test]
fn after_reasoning_min_tokens_counts_from_the_first_thinking_token() {
    // vLLM's min_tokens counts every generated token, the thinking included, and holds the stop
    // tokens back until then, whether the `min_tokens`th token falls in the thinking or after it.
    let g = grammars();
    let compiled = g.compile(&StructuredOutput::Regex("[0-9]*".into())).unwrap();
    let encode = |s: &str| demo_text().tokenizer().encode(s, false).unwrap();
    let (thinking, answer) = (encode("Let me think: 12 or 345? </think>"), encode("12345678"));
    assert!(answer.len() >= 2, "{answer:?}");
    let ids = [thinking.clone(), answer].concat();
    for min_tokens in [0, 2, thinking.len() + 1] {
        let mut gated = (compiled.factory_after_reasoning(vec![EOS], min_tokens).0)();
        for (generated, &t) in ids.iter().enumerate() {
            // `[0-9]*` allows EOS everywhere after the tag, as thinking does: only min_tokens decides.
            let eos = allowed(gated.as_mut(), 600).contains(&EOS);
            assert_eq!(eos, generated >= min_tokens, "min_tokens {min_tokens}, {generated} generated");
            gated.accept(t).unwrap();
        }
    }
}

/// A `$ref` chain of `links` definitions, each an object whose one property refers to the next.
fn ref_chain(links: usize) -> serde_json::Value {
    let defs: serde_json::Map<String, serde_json::Value> = (0..links)
        .map(|i| {
            let next =
                if i + 1 < links { json!({"$ref": format!("#/$defs/d{}", i + 1)}) } else { json!({"type": "integer"}) };
            (format!("d{i}"), json!({"type": "object", "properties": {"x": next}, "required": ["x"]}))
        })
        .collect();
    json!({"$ref": "#/$defs/d0", "$defs": defs})
}

/// A Lark chain of `rules` rules, each one `"a"` and the next.
fn lark_chain(rules: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..rules {
        let next = if i + 1 < rules { format!(" r{}", i + 1) } else { String::new() };
        g.push_str(&format!("r{i}: \"a\"{next}\n"));
    }
    g
}

/// Runs `f` on a thread with a 256 KiB stack, far less than compiling deep grammars needs.
fn on_small_stack<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        std::thread::Builder::new().stack_size(256 << 10).spawn_scoped(s, f).unwrap().join().unwrap()
    })
}

#[test]
fn deep_grammars_compile_or_are_refused_whatever_the_callers_stack() {
    let g = grammars();
    let json = |schema| StructuredOutput::Json { schema, options: JsonOptions::default() };
    on_small_stack(|| {
        // Just under the recursion limit: the 250-link chain that overflowed a 2 MiB stack, and
        // 2000 links (8000 levels by the bound); then past it.
        for links in [250, 2000] {
            g.compile(&json(ref_chain(links))).unwrap_or_else(|e| panic!("{links} links: {e}"));
        }
        let e = g.compile(&json(ref_chain(2100))).err().unwrap().to_string();
        assert!(e.contains(&format!("the limit is {}", limits::MAX_RECURSION)), "{e}");
        // The same schema as a tool's parameters: the server's tool-call grammar embeds it.
        let tool = json!([{"type": "function", "function": {"name": "f", "parameters": ref_chain(2100)}}]);
        let lark = crate::parsers::grammar::deepseek_v3_tool_grammar(
            tool.as_array().unwrap(),
            crate::parsers::grammar::CallCount::One,
        );
        let e = g.compile_by(&StructuredOutput::Lark(lark), Author::Server).err().unwrap().to_string();
        assert!(e.contains("nests too deeply"), "{e}");
        // Lark rule chains: 700 overflowed a 2 MiB stack; 8000 compile (written by the server:
        // a request's grammar may not be that long), 9000 are past the limit.
        g.compile_by(&StructuredOutput::Lark(lark_chain(8000)), Author::Server).unwrap();
        let e = g.compile_by(&StructuredOutput::Lark(lark_chain(9000)), Author::Server).err().unwrap().to_string();
        assert!(e.contains("nests too deeply"), "{e}");
        let e = g.compile(&StructuredOutput::Lark(lark_chain(2000))).err().unwrap().to_string();
        assert!(e.contains(&format!("at most {} bytes", limits::MAX_LARK_BYTES)), "{e}");
    });
}

#[test]
fn grammars_that_allow_no_output_are_refused() {
    let g = grammars();
    for (so, want) in [
        (StructuredOutput::Regex("[^\\s\\S]".into()), "no token can start it"),
        (StructuredOutput::Lark("start: start".into()), "no finite output"),
        (StructuredOutput::Lark("start: \"a\" start".into()), "no finite output"),
        (StructuredOutput::Lark("start: x\nx: \"a\" x | \"b\" x".into()), "no finite output"),
    ] {
        let e = g.compile(&so).err().unwrap_or_else(|| panic!("{so:?} compiled"));
        assert!(matches!(&e, CompileError::Invalid(m) if m.contains(want)), "{so:?}: {e}");
    }
    // Recursion with a way out, and the empty text, are fine.
    g.compile(&StructuredOutput::Lark("start: \"a\" start | \"b\"".into())).unwrap();
    g.compile(&StructuredOutput::Regex("a*".into())).unwrap();
}

#[test]
fn a_mask_past_its_deadline_fails_with_the_budget_in_the_message() {
    let g = grammars();
    let compiled = g.compile(&StructuredOutput::Regex("[a-z]+".into())).unwrap();
    let mut c = compiled.constraint(Arc::from(vec![EOS]), 0);
    let mut mask = vec![0u32; 600usize.div_ceil(32)];
    // A deadline already past: the watchdog cancels the computation before it starts.
    let e = c.fill_mask(&mut mask, std::time::Instant::now()).unwrap_err();
    assert!(e.contains(&format!("budget of {} ms", mla_engine::MASK_BUDGET.as_millis())), "{e}");
    // The constraint stays failed (the cancelled matcher reports itself stopped, which must not
    // read as a complete grammar allowing EOS); the engine ends the request.
    let later = std::time::Instant::now() + std::time::Duration::from_secs(60);
    assert_eq!(c.fill_mask(&mut mask, later), Err(e.clone()));
    assert_eq!(c.accept(EOS), Err(e));
    // Its siblings are untouched.
    let mut sibling = compiled.constraint(Arc::from(vec![EOS]), 0);
    assert!(!allowed(&mut sibling, 600).is_empty());
}

#[test]
fn grammar_memory_is_charged_while_the_grammar_lives() {
    let g = grammars();
    assert_eq!(g.memory_used(), 0);
    let compiled = g.compile(&StructuredOutput::Regex("[a-z]{1,40}@[a-z]{1,40}\\.com".into())).unwrap();
    let charged = g.memory_used();
    assert!(charged > 0);
    let mut c = compiled.constraint(Arc::from(vec![EOS]), 0);
    drop(compiled);
    feed(&mut c, "someone@exam");
    assert!(g.memory_used() >= charged, "the lexer only grows");
    drop(c);
    assert_eq!(g.memory_used(), 0, "the last completion gives the memory back");
}

/// Speculative decoding: the masks along drafts the constraint follows are the masks of a
/// constraint that accepted them, and rolling back restores it whole: from every point of a
/// JSON document (its end, where only EOS follows, included), with `min_tokens` holding the stop
/// token for the first few, and through a reasoning gate's closing tag.
#[test]
fn following_drafts_gives_the_masks_of_accepting_them_and_rollback_restores_the_state() {
    let g = grammars();
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
    let so = StructuredOutput::Json { schema, options: JsonOptions { compact: true, ..JsonOptions::default() } };
    let compiled = g.compile(&so).unwrap();
    let encode = |s: &str| demo_text().tokenizer().encode(s, false).unwrap();
    let ids = [encode(r#"{"n":42}"#), vec![EOS, EOS]].concat();
    let check = |make: &dyn Fn() -> Box<dyn TokenConstraint>, ids: &[u32]| {
        for at in 0..ids.len() {
            for k in 1..=3.min(ids.len() - at) {
                let mut c = make();
                ids[..at].iter().for_each(|&t| c.accept(t).unwrap());
                let before = allowed(c.as_mut(), 600);
                for j in 0..k {
                    c.follow(ids[at + j]).unwrap();
                    let mut accepted = make();
                    ids[..at + j + 1].iter().for_each(|&t| accepted.accept(t).unwrap());
                    assert_eq!(allowed(c.as_mut(), 600), allowed(accepted.as_mut(), 600), "at {at}, draft {j}");
                }
                c.rollback(k);
                assert_eq!(allowed(c.as_mut(), 600), before, "at {at}: rolled back {k}");
                // And it goes on as if nothing had been followed.
                ids[at..].iter().for_each(|&t| c.accept(t).unwrap());
            }
        }
    };
    for min_tokens in [0, 3] {
        check(&|| Box::new(compiled.constraint(Arc::from(vec![EOS]), min_tokens)), &ids);
    }
    let thinking = encode("Hm: 7? </think>");
    let gated_ids = [thinking, encode(r#"{"n":7}"#), vec![EOS]].concat();
    check(&|| (compiled.factory_after_reasoning(vec![EOS], 2).0)(), &gated_ids);
}
