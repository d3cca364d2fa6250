//! The reasoning and tool-call parsers over realistic DeepSeek replies
//! (tests/fixtures/parsers/replies.json): the whole reply at once, the reply cut in two at every
//! character, fed one character at a time, and fed token by token through the demo tokenizer's
//! incremental detokenizer (which keeps the tool-call markers: they are not special tokens).
//! Every way must give the fixture's expected reasoning, content and calls.

use crate::common;

use common::{demo_tokenizer, read_json, workspace_root};
use mla_server::detokenizer::IncrementalDetokenizer;
use mla_server::parsers::{OutputParsing, ParsedMessage, ReasoningParserKind, ToolParserKind};
use serde_json::Value;

fn parsing(case: &Value) -> OutputParsing {
    OutputParsing {
        reasoning: case["reasoning_parser"].as_str().map(|n| ReasoningParserKind::from_name(n).unwrap()),
        tools: case["tool_call_parser"].as_str().map(|n| (ToolParserKind::from_name(n).unwrap(), None)),
    }
}

fn expected(case: &Value) -> ParsedMessage {
    let e = &case["expected"];
    ParsedMessage {
        reasoning: e["reasoning"].as_str().unwrap_or_default().to_string(),
        content: e["content"].as_str().unwrap().to_string(),
        tool_calls: e["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c[0].as_str().unwrap().to_string(), c[1].as_str().unwrap().to_string()))
            .collect(),
    }
}

fn feed<'a>(parsing: &OutputParsing, pieces: impl IntoIterator<Item = &'a str>) -> ParsedMessage {
    let mut parser = parsing.choice_parser();
    let mut message = ParsedMessage::default();
    for piece in pieces {
        let delta = parser.push(piece);
        message.absorb(delta);
    }
    message.absorb(parser.finish());
    message
}

fn cases() -> Vec<Value> {
    let fixture = read_json(workspace_root().join("tests/fixtures/parsers/replies.json"));
    let cases = fixture["cases"].as_array().unwrap().clone();
    assert!(cases.len() >= 8, "too few fixture replies");
    cases
}

#[test]
fn whole_replies_parse_as_expected() {
    for case in cases() {
        let got = ParsedMessage::parse(&parsing(&case), case["text"].as_str().unwrap());
        assert_eq!(got, expected(&case), "{}", case["name"]);
    }
}

#[test]
fn every_split_point_gives_the_same_result() {
    for case in cases() {
        let (p, text, want) = (parsing(&case), case["text"].as_str().unwrap(), expected(&case));
        for (at, _) in text.char_indices().skip(1) {
            let got = feed(&p, [&text[..at], &text[at..]]);
            assert_eq!(got, want, "{} split at byte {at}", case["name"]);
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(feed(&p, chars.iter().map(String::as_str)), want, "{} char by char", case["name"]);
    }
}

/// Several cuts at once (a marker can span three deltas): pseudo-random cut sets, reproducible.
#[test]
fn random_multi_way_splits_give_the_same_result() {
    let mut seed: u64 = 0x5eed;
    let mut next = move |bound: usize| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as usize % bound
    };
    for case in cases() {
        let (p, text, want) = (parsing(&case), case["text"].as_str().unwrap(), expected(&case));
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        for _ in 0..200 {
            let mut cuts: Vec<usize> = (0..1 + next(8)).map(|_| bounds[next(bounds.len())]).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let mut pieces = vec![];
            let mut from = 0;
            for &cut in &cuts {
                pieces.push(&text[from..cut]);
                from = cut;
            }
            pieces.push(&text[from..]);
            assert_eq!(feed(&p, pieces.iter().copied()), want, "{} cut at {cuts:?}", case["name"]);
        }
    }
}

#[test]
fn token_by_token_through_the_detokenizer() {
    let tokenizer = demo_tokenizer();
    for case in cases() {
        let text = case["text"].as_str().unwrap();
        let ids = tokenizer.encode(text, false).unwrap();
        let mut detok = IncrementalDetokenizer::new(true);
        let mut deltas: Vec<String> = ids.iter().map(|&id| detok.push(&tokenizer, id).unwrap()).collect();
        deltas.push(detok.finish(&tokenizer).unwrap());
        assert_eq!(deltas.concat(), text, "{}: the markers survive skip_special_tokens", case["name"]);
        let got = feed(&parsing(&case), deltas.iter().map(String::as_str));
        assert_eq!(got, expected(&case), "{} token by token", case["name"]);
    }
}

/// Streamed pieces never show marker text: what the pushes released, accumulated, has no end tag
/// in the reasoning and no marker characters in content or arguments (no fixture's own text
/// has them).
#[test]
fn no_marker_text_leaks_into_streamed_pieces() {
    for case in cases() {
        let p = parsing(&case);
        let mut parser = p.choice_parser();
        let (mut reasoning, mut visible) = (String::new(), String::new());
        for c in case["text"].as_str().unwrap().chars() {
            let d = parser.push(&c.to_string());
            reasoning.push_str(&d.reasoning);
            visible.push_str(&d.content);
            d.tool_calls.iter().for_each(|t| visible.push_str(&t.arguments));
        }
        assert!(!reasoning.contains(reasoning_end()), "{}: end tag leaked: {reasoning:?}", case["name"]);
        if p.tools.is_some() {
            assert!(!visible.contains('｜'), "{}: marker leaked: {visible:?}", case["name"]);
        }
        assert!(!visible.contains(reasoning_end()), "{}: end tag leaked: {visible:?}", case["name"]);
    }
}

fn reasoning_end() -> &'static str {
    mla_server::parsers::reasoning::THINK_END
}

/// The demo tokenizer, like DeepSeek's, keeps every marker through `skip_special_tokens`; its
/// begin-of-sentence token (special) would be dropped, which is what the startup check reports.
#[test]
fn startup_check_finds_no_hidden_markers_in_the_demo_tokenizer() {
    use mla_server::parsers::ParserConfig;
    let all = ParserConfig {
        reasoning: Some(ReasoningParserKind::DeepSeekR1),
        tool_call: Some(ToolParserKind::DeepSeekV3),
        enable_auto_tool_choice: true,
    };
    let tokenizer = demo_tokenizer();
    assert_eq!(all.hidden_markers(&tokenizer), Vec::<&str>::new());
    assert_eq!(tokenizer.decode(&tokenizer.encode("<｜begin▁of▁sentence｜>", false).unwrap(), true).unwrap(), "");
}
