//! What one compiled grammar holds in memory, kept up to date in its `Charge`.
//!
//! Two parts: the compiled rules, fixed once compiled, and the lexer, which llguidance builds
//! lazily (states, derivatives, cached expressions) and which every completion of the request
//! shares. The lexer reports its own size; it is read through a parser that shares it (a
//! shallow clone of the prototype, never run).

use super::memory::{Charge, GrammarMemory, Refused};
use llguidance::TokenParser;
use std::sync::{Arc, Mutex, PoisonError};

/// Bytes charged per grammar symbol and per symbol occurrence in a rule: llguidance keeps a
/// record of about 200 bytes per symbol (its name, flags, rule list) and a few vectors indexed
/// by rule position.
const SYMBOL_BYTES: usize = 256;
const RULE_ELEMENT_BYTES: usize = 16;

pub struct GrammarUsage {
    probe: Mutex<TokenParser>,
    rules_bytes: usize,
    charge: Charge,
}

impl GrammarUsage {
    /// Charges `memory` for the grammar `probe` shares its lexer with; `symbols` and
    /// `rule_elements` size its compiled rules.
    pub fn charge(
        memory: &Arc<GrammarMemory>,
        probe: TokenParser,
        symbols: usize,
        rule_elements: usize,
    ) -> Result<GrammarUsage, Refused> {
        let rules_bytes = symbols * SYMBOL_BYTES + rule_elements * RULE_ELEMENT_BYTES;
        let bytes = rules_bytes + lexer_bytes(&probe);
        let charge = memory.charge(bytes)?;
        Ok(GrammarUsage { probe: Mutex::new(probe), rules_bytes, charge })
    }

    /// Measures the lexer again and updates the charge; refused past either limit.
    pub fn measure(&self) -> Result<(), Refused> {
        let lexer = lexer_bytes(&self.probe.lock().unwrap_or_else(PoisonError::into_inner));
        self.charge.set(self.rules_bytes + lexer)
    }
}

fn lexer_bytes(probe: &TokenParser) -> usize {
    probe.parser.lexer_stats().num_bytes
}
