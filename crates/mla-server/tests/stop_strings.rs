//! Stop strings across delta boundaries, checked by hand and against a brute-force reference
//! that sees the whole text at once.

use crate::common;

use common::demo_tokenizer;
use mla_server::detokenizer::IncrementalDetokenizer;
use mla_server::stop::{StopCheck, StopMatcher};

fn stops(list: &[&str]) -> StopMatcher {
    StopMatcher::new(list.iter().map(|s| s.to_string()).collect()).unwrap()
}

/// Feeds deltas until a stop; returns (released text, matched index).
fn run(matcher: &mut StopMatcher, deltas: &[&str]) -> (String, Option<usize>) {
    let mut out = String::new();
    for delta in deltas {
        match matcher.push(delta) {
            StopCheck::Continue { text } => out.push_str(&text),
            StopCheck::Stopped { text, index } => {
                out.push_str(&text);
                return (out, Some(index));
            }
        }
    }
    out.push_str(&matcher.finish());
    (out, None)
}

#[test]
fn stop_string_split_across_deltas_is_found_and_cut() {
    let mut m = stops(&["o w"]);
    assert_eq!(run(&mut m, &["Hel", "lo", " ", "wo", "rld"]), ("Hell".to_string(), Some(0)));
}

#[test]
fn possible_stop_prefix_is_withheld_then_released() {
    let mut m = stops(&["cde"]);
    assert_eq!(m.push("abc"), StopCheck::Continue { text: "ab".into() });
    assert_eq!(m.push("d"), StopCheck::Continue { text: "".into() });
    assert_eq!(m.push("x"), StopCheck::Continue { text: "cdx".into() });
    assert_eq!(m.push("cd"), StopCheck::Continue { text: "".into() });
    assert_eq!(m.finish(), "cd", "held text that never became a stop belongs to the output");
}

#[test]
fn earliest_completed_stop_wins() {
    // "bc" completes before "abcd" does.
    assert_eq!(run(&mut stops(&["abcd", "bc"]), &["xabcd"]), ("xa".to_string(), Some(1)));
    // Both complete at the same character: the longer one (starting earlier) wins.
    assert_eq!(run(&mut stops(&["bc", "abc"]), &["xa", "bc"]), ("x".to_string(), Some(1)));
}

#[test]
fn nothing_leaks_after_a_stop() {
    let mut m = stops(&["END"]);
    assert_eq!(m.push("ok END tail"), StopCheck::Stopped { text: "ok ".into(), index: 0 });
    assert_eq!(m.push("more"), StopCheck::Stopped { text: "".into(), index: 0 });
    assert_eq!(m.finish(), "");
}

#[test]
fn multibyte_stop_strings_hold_whole_characters() {
    let mut m = stops(&["😀!"]);
    assert_eq!(m.push("hi 😀"), StopCheck::Continue { text: "hi ".into() });
    assert_eq!(m.push("!"), StopCheck::Stopped { text: "".into(), index: 0 });
    let mut m = stops(&["你好"]);
    assert_eq!(run(&mut m, &["说你", "们好"]), ("说你们好".to_string(), None));
}

#[test]
fn empty_stop_string_is_rejected() {
    assert!(StopMatcher::new(vec!["".into()]).is_err());
}

/// Reference on the whole text: cut before the stop occurrence that ends first.
fn reference(text: &str, list: &[&str]) -> (String, Option<usize>) {
    for end in 1..=text.len() {
        let candidates = list.iter().enumerate().filter(|(_, s)| text[..end].ends_with(*s));
        if let Some((index, stop)) = candidates.max_by_key(|(i, s)| (s.len(), std::cmp::Reverse(*i))) {
            return (text[..end - stop.len()].to_string(), Some(index));
        }
    }
    (text.to_string(), None)
}

#[test]
fn random_deltas_agree_with_whole_text_reference() {
    let list = ["aba", "bb", "cab"];
    let mut state = 0x2545_F491_u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    for _ in 0..2000 {
        let text: String = (0..next(14)).map(|_| ['a', 'b', 'c', 'x'][next(4) as usize]).collect();
        // Random cut points make random deltas.
        let mut deltas = Vec::new();
        let mut rest = text.as_str();
        while !rest.is_empty() {
            let take = 1 + next(rest.len() as u64) as usize;
            deltas.push(&rest[..take]);
            rest = &rest[take..];
        }
        let mut m = stops(&list);
        let mut released = String::new();
        let mut fed = String::new();
        let mut result = None;
        for delta in &deltas {
            fed.push_str(delta);
            match m.push(delta) {
                StopCheck::Continue { text } => released.push_str(&text),
                StopCheck::Stopped { text, index } => {
                    released.push_str(&text);
                    result = Some(index);
                    break;
                }
            }
            // Withholding invariant: exactly the longest suffix that could still start a stop.
            let held = fed.len() - released.len();
            let expect_held = (0..fed.len())
                .find(|&i| list.iter().any(|s| s.len() > fed.len() - i && s.starts_with(&fed[i..])))
                .map_or(0, |i| fed.len() - i);
            assert_eq!(held, expect_held, "fed {fed:?}, released {released:?}");
        }
        if result.is_none() {
            released.push_str(&m.finish());
        }
        assert_eq!((released, result), reference(&text, &list), "deltas {deltas:?}");
    }
}

#[test]
fn detokenizer_and_stop_strings_together() {
    let tokenizer = demo_tokenizer();
    let ids = tokenizer.encode("The answer is 😀 STOP and more", false).unwrap();
    let mut detok = IncrementalDetokenizer::new(true);
    let mut m = stops(&["STOP"]);
    let mut out = String::new();
    let mut stopped = false;
    for id in ids {
        match m.push(&detok.push(&tokenizer, id).unwrap()) {
            StopCheck::Continue { text } => out.push_str(&text),
            StopCheck::Stopped { text, .. } => {
                out.push_str(&text);
                stopped = true;
                break;
            }
        }
    }
    assert!(stopped);
    assert_eq!(out, "The answer is 😀 ");
}

/// The naive matcher: keeps everything fed, searches every stop string in all of it at every
/// delta, and holds back the longest suffix that is a proper prefix of some stop string.
struct NaiveStops {
    stops: Vec<String>,
    fed: String,
    released: usize,
    stopped: Option<usize>,
}

impl NaiveStops {
    fn push(&mut self, delta: &str) -> StopCheck {
        if let Some(index) = self.stopped {
            return StopCheck::Stopped { text: String::new(), index };
        }
        self.fed.push_str(delta);
        // A stop string's first occurrence is also where it completes first; among stop strings,
        // the earliest end, then the longest, then the lowest index.
        let first = self.stops.iter().enumerate().filter_map(|(i, s)| {
            self.fed.find(s.as_str()).map(|start| (start + s.len(), std::cmp::Reverse(s.len()), i, start))
        });
        if let Some((_, _, index, start)) = first.min() {
            let text = self.fed.get(self.released..start).expect("the stop string began in released text");
            self.stopped = Some(index);
            return StopCheck::Stopped { text: text.to_string(), index };
        }
        let could_begin_a_stop = |rest: &str| self.stops.iter().any(|s| s.len() > rest.len() && s.starts_with(rest));
        let held_from = (self.released..=self.fed.len())
            .find(|&i| self.fed.is_char_boundary(i) && could_begin_a_stop(&self.fed[i..]))
            .unwrap();
        let text = self.fed[self.released..held_from].to_string();
        self.released = held_from;
        StopCheck::Continue { text }
    }

    fn finish(&mut self) -> String {
        if self.stopped.is_some() {
            return String::new();
        }
        let text = self.fed[self.released..].to_string();
        self.released = self.fed.len();
        text
    }
}

/// Random text cut into random deltas (whole characters, some empty).
fn random_deltas(rng: &mut impl rand::Rng, alphabet: &[&str]) -> Vec<String> {
    let chars: Vec<&str> =
        (0..rng.random_range(0..40)).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect();
    let mut deltas = Vec::new();
    let mut at = 0;
    while at < chars.len() {
        let take = rng.random_range(0..=4.min(chars.len() - at));
        deltas.push(chars[at..at + take].concat());
        at += take;
    }
    deltas
}

#[test]
fn random_stop_sets_agree_with_the_naive_matcher_after_every_delta() {
    use mla_server::stop::StopAutomaton;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    // Two letters and a two-byte one: overlapping, repeated and nested stop strings are common.
    let alphabet = ["a", "b", "é"];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5709);
    for case in 0..3000 {
        let list: Vec<String> = (0..rng.random_range(1..=5))
            .map(|_| (0..rng.random_range(1..=4)).map(|_| alphabet[rng.random_range(0..3)]).collect())
            .collect();
        let automaton = Arc::new(StopAutomaton::new(list.clone()).unwrap());
        // Two completions on one automaton, fed in turns: their states must not mix.
        let mut runs: Vec<_> = (0..2)
            .map(|_| {
                let naive = NaiveStops { stops: list.clone(), fed: String::new(), released: 0, stopped: None };
                (StopMatcher::shared(automaton.clone()), naive, random_deltas(&mut rng, &alphabet))
            })
            .collect();
        for k in 0..runs.iter().map(|r| r.2.len()).max().unwrap() {
            for (matcher, naive, deltas) in &mut runs {
                if let Some(delta) = deltas.get(k) {
                    assert_eq!(
                        matcher.push(delta),
                        naive.push(delta),
                        "case {case}: stops {list:?}, deltas {deltas:?}"
                    );
                }
            }
        }
        for (matcher, naive, deltas) in &mut runs {
            assert_eq!(matcher.finish(), naive.finish(), "case {case}: stops {list:?}, deltas {deltas:?}");
        }
    }
}
