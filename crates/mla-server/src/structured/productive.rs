//! Whether a compiled grammar can ever be completed.
//!
//! A grammar such as `start: "a" start` allows a first token (and every one after), but no
//! finite text matches it: generation could only end at `max_tokens`, with output that never
//! parses. Such a grammar is refused before generation. The test is the classic one for
//! context-free grammars: a symbol is productive when it derives some finite string, that is
//! when it is a terminal (a lexeme), nullable, or has a rule whose symbols are all productive;
//! the grammar can complete when its start symbol is productive.
//!
//! Terminals count as productive although a lexeme may match nothing (llguidance does not
//! expose that): such a grammar allows no token where it is needed, which the first mask
//! (`Grammars::compile`) or the step's mask (failing that request alone) reports instead. A
//! nested grammar (`gen_grammar`) counts as productive too. Conditions of parametric rules are
//! ignored, which can only call more symbols productive. So this refuses only grammars that
//! certainly cannot complete.

use llguidance::earley::{CGrammar, CSymIdx};
use std::collections::{HashMap, HashSet};

/// What `analyse` finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Analysis {
    /// Some finite text is a complete match (see the module doc).
    pub can_complete: bool,
    /// Symbols reachable from the start, and their occurrences in rules (for `usage`).
    pub symbols: usize,
    pub rule_elements: usize,
}

pub fn analyse(grammar: &CGrammar) -> Analysis {
    // The rules of the symbols reachable from the start, as (lhs, rhs), and the symbols that
    // are productive by themselves.
    let mut rules: Vec<(CSymIdx, &[CSymIdx])> = Vec::new();
    let mut ready: Vec<CSymIdx> = Vec::new();
    let mut pending = vec![grammar.start()];
    let mut seen = HashSet::from([grammar.start()]);
    while let Some(sym) = pending.pop() {
        let data = grammar.sym_data(sym);
        if data.is_terminal || data.is_nullable || data.gen_grammar.is_some() {
            ready.push(sym);
        }
        for &rule in &data.rules {
            let (rhs, _, _) = grammar.rule_rhs(rule);
            pending.extend(rhs.iter().filter(|&&s| seen.insert(s)));
            rules.push((sym, rhs));
        }
    }
    // Each rule waits for every occurrence of a symbol in it; when none is left, its lhs is
    // productive. Every symbol is propagated once.
    let mut waiting: Vec<usize> = rules.iter().map(|(_, rhs)| rhs.len()).collect();
    let mut uses: HashMap<CSymIdx, Vec<usize>> = HashMap::new();
    for (i, (lhs, rhs)) in rules.iter().enumerate() {
        rhs.iter().for_each(|s| uses.entry(*s).or_default().push(i));
        if rhs.is_empty() {
            ready.push(*lhs);
        }
    }
    let mut productive = HashSet::new();
    while let Some(sym) = ready.pop() {
        if !productive.insert(sym) {
            continue;
        }
        for &rule in uses.get(&sym).map(Vec::as_slice).unwrap_or_default() {
            waiting[rule] -= 1;
            if waiting[rule] == 0 {
                ready.push(rules[rule].0);
            }
        }
    }
    Analysis {
        can_complete: productive.contains(&grammar.start()),
        symbols: seen.len(),
        rule_elements: rules.iter().map(|(_, rhs)| rhs.len()).sum(),
    }
}
