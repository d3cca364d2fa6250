//! One completion's grammar state as the engine sees it (`mla_engine::TokenConstraint`).

use super::usage::GrammarUsage;
use super::watchdog::Watchdog;
use llguidance::{CancellationHandle, Matcher};
use mla_engine::{TokenConstraint, MASK_BUDGET};
use std::sync::Arc;
use std::time::Instant;

pub struct GrammarConstraint {
    matcher: Matcher,
    /// Cancels `matcher`'s mask computation at its deadline (the matcher is cancellable).
    cancel: Option<CancellationHandle>,
    watchdog: Arc<Watchdog>,
    /// The grammar's memory, measured after each mask (shared by the request's completions).
    usage: Arc<GrammarUsage>,
    /// Ids that end a completion; any of them is llguidance's EOS.
    eos_ids: Arc<[u32]>,
    /// The one of `eos_ids` llguidance knows as EOS.
    matcher_eos: u32,
    /// The request's stop tokens, kept out of the mask for the first `min_tokens` draws.
    stop_ids: Arc<[u32]>,
    min_tokens: usize,
    /// Tokens generated so far, those before the grammar started included (`count_ungoverned`).
    drawn: usize,
    /// Why computing a mask failed: the matcher stays failed (it reports itself stopped, which
    /// must not read as complete), and so does this constraint.
    failed: Option<String>,
    /// The grammar is complete and an EOS was drawn (or it cannot go on): from now on only EOS
    /// is allowed. With `ignore_eos` the engine keeps drawing, and EOS is what it gets: the text
    /// stays what the grammar produced (vLLM instead lets the model run unconstrained after it).
    finished: bool,
    /// What each draft followed (`TokenConstraint::follow`) changed, last on top.
    followed: Vec<Followed>,
}

/// The state one followed draft changed, to undo it.
struct Followed {
    drawn: usize,
    finished: bool,
    /// Whether the matcher consumed the draft (it does not once the grammar is finished).
    consumed: bool,
}

impl GrammarConstraint {
    pub(super) fn new(
        matcher: Matcher,
        shared: &super::CompiledGrammar,
        stop_ids: Arc<[u32]>,
        min_tokens: usize,
    ) -> Self {
        let (eos_ids, matcher_eos) = (shared.eos.all.clone(), shared.eos.matcher);
        GrammarConstraint {
            cancel: matcher.cancellation_handle(),
            matcher,
            watchdog: shared.watchdog.clone(),
            usage: shared.usage.clone(),
            eos_ids,
            matcher_eos,
            stop_ids,
            min_tokens,
            drawn: 0,
            failed: None,
            finished: false,
            followed: Vec::new(),
        }
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

    /// Takes back a `count_ungoverned` of a draft rolled back.
    pub(super) fn uncount_ungoverned(&mut self) {
        self.drawn -= 1;
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
    fn fill_mask(&mut self, mask: &mut [u32], deadline: Instant) -> Result<(), String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        if self.is_finished() {
            self.allow_eos(mask);
            return Ok(());
        }
        let computed = {
            let _armed = self.cancel.clone().map(|handle| self.watchdog.arm(deadline, handle));
            self.matcher.compute_mask()
        };
        // Either way the matcher now stays failed, and the engine ends this request: allowing
        // EOS instead would end it as if the output were complete.
        let allowed = match computed {
            Ok(allowed) => allowed,
            Err(e) => {
                let why = match self.matcher.is_cancelled() {
                    true => format!(
                        "computing a token mask took longer than its budget of {} ms: the grammar is too expensive to follow",
                        MASK_BUDGET.as_millis()
                    ),
                    false => format!("computing the token mask failed: {e}"),
                };
                self.failed = Some(why.clone());
                return Err(why);
            }
        };
        let words = allowed.as_slice();
        let n = words.len().min(mask.len());
        mask[..n].copy_from_slice(&words[..n]);
        if allowed.is_allowed(self.matcher_eos) {
            self.allow_eos(mask);
        }
        self.hold_stops(mask);
        self.usage.measure().map_err(|refused| {
            let why = format!("the grammar's lexer grew: {refused}");
            self.failed = Some(why.clone());
            why
        })
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
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

    fn follow(&mut self, token: u32) -> Result<(), String> {
        let undo = Followed { drawn: self.drawn, finished: self.finished, consumed: !self.is_finished() };
        self.accept(token)?;
        self.followed.push(undo);
        Ok(())
    }

    fn rollback(&mut self, n: usize) {
        let kept = self.followed.len().saturating_sub(n);
        let undone: Vec<Followed> = self.followed.drain(kept..).collect();
        let Some(first) = undone.first() else { return };
        (self.drawn, self.finished) = (first.drawn, first.finished);
        let consumed = undone.iter().filter(|f| f.consumed).count();
        // llguidance takes the tokens back, an end of grammar reached by them included.
        if let Err(e) = self.matcher.rollback(consumed) {
            self.failed.get_or_insert_with(|| format!("taking back drafted tokens failed: {e}"));
        }
    }
}
