//! One completion's grammar state as the engine sees it (`mla_engine::TokenConstraint`).

use llguidance::Matcher;
use mla_engine::TokenConstraint;
use std::sync::Arc;

pub struct GrammarConstraint {
    matcher: Matcher,
    /// Ids that end a completion; any of them is llguidance's EOS.
    eos_ids: Arc<[u32]>,
    /// The one of `eos_ids` llguidance knows as EOS.
    matcher_eos: u32,
    /// The request's stop tokens, kept out of the mask for the first `min_tokens` draws.
    stop_ids: Arc<[u32]>,
    min_tokens: usize,
    /// Tokens generated so far, those before the grammar started included (`count_ungoverned`).
    drawn: usize,
    /// The grammar is complete and an EOS was drawn (or it cannot go on): from now on only EOS
    /// is allowed. With `ignore_eos` the engine keeps drawing, and EOS is what it gets: the text
    /// stays what the grammar produced (vLLM instead lets the model run unconstrained after it).
    finished: bool,
}

impl GrammarConstraint {
    pub(super) fn new(matcher: Matcher, eos: &super::Eos, stop_ids: Arc<[u32]>, min_tokens: usize) -> Self {
        let (eos_ids, matcher_eos) = (eos.all.clone(), eos.matcher);
        GrammarConstraint { matcher, eos_ids, matcher_eos, stop_ids, min_tokens, drawn: 0, finished: false }
    }

    /// The grammar is complete (only EOS may follow) or was ended by an EOS.
    pub fn is_finished(&self) -> bool {
        self.finished || self.matcher.is_stopped()
    }

    /// Takes the stop tokens out of `mask` while fewer than `min_tokens` tokens have been
    /// generated, unless they are all it allows: a grammar that can only stop wins over
    /// `min_tokens`, and a mask is never empty.
    pub(super) fn hold_stops(&self, mask: &mut [u32]) {
        if self.drawn >= self.min_tokens {
            return;
        }
        let stops: Vec<u32> = self.stop_ids.iter().copied().filter(|&t| is_set(mask, t)).collect();
        stops.iter().for_each(|&t| clear(mask, t));
        if mask.iter().all(|&w| w == 0) {
            stops.iter().for_each(|&t| set(mask, t));
        }
    }

    /// Counts a token generated before the grammar starts (a reasoning model's thinking,
    /// `reasoning_gate`): vLLM's `min_tokens` counts every generated token, from the first.
    pub(super) fn count_ungoverned(&mut self) {
        self.drawn += 1;
    }

    fn allow_eos(&self, mask: &mut [u32]) {
        for &t in self.eos_ids.iter() {
            set(mask, t);
        }
    }
}

fn set(mask: &mut [u32], t: u32) {
    if let Some(w) = mask.get_mut(t as usize / 32) {
        *w |= 1 << (t % 32);
    }
}

fn is_set(mask: &[u32], t: u32) -> bool {
    mask.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

fn clear(mask: &mut [u32], t: u32) {
    if let Some(w) = mask.get_mut(t as usize / 32) {
        *w &= !(1 << (t % 32));
    }
}

impl TokenConstraint for GrammarConstraint {
    fn fill_mask(&mut self, mask: &mut [u32]) {
        if self.is_finished() {
            self.allow_eos(mask);
            return;
        }
        let allowed = match self.matcher.compute_mask() {
            Ok(v) => v,
            // llguidance failed (a lexer or parser limit hit mid-way). Allowing EOS would end the
            // completion as if the output were complete; panicking makes the engine fail this
            // request alone, visibly.
            Err(e) => panic!("structured output: computing the token mask failed: {e}"),
        };
        let words = allowed.as_slice();
        let n = words.len().min(mask.len());
        mask[..n].copy_from_slice(&words[..n]);
        if allowed.is_allowed(self.matcher_eos) {
            self.allow_eos(mask);
        }
        self.hold_stops(mask);
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.drawn += 1;
        let is_eos = self.eos_ids.contains(&token);
        if self.is_finished() {
            self.finished = true;
            return if is_eos { Ok(()) } else { Err(format!("token {token} after the grammar was complete")) };
        }
        let token = if is_eos { self.matcher_eos } else { token };
        self.matcher.consume_token(token).map_err(|e| e.to_string())?;
        if is_eos {
            self.finished = true;
        }
        Ok(())
    }
}
