//! vLLM's `allowed_token_ids` as an engine token constraint: the same mask on every draw, so the
//! device sampler draws only among them (through the mask that structured output uses), while
//! the reported logprobs stay those of the model, as vLLM reports them.

use mla_engine::{ConstraintFactory, TokenConstraint};
use std::sync::Arc;
use std::time::Instant;

/// Only the listed ids may be drawn.
struct AllowedTokens {
    words: Arc<[u32]>,
}

impl TokenConstraint for AllowedTokens {
    fn fill_mask(&mut self, mask: &mut [u32], _deadline: Instant) -> Result<(), String> {
        // Both cover the model's vocabulary; zip rather than panic should they ever differ. A
        // copy of a few kilobytes: no deadline can pass.
        mask.iter_mut().zip(self.words.iter()).for_each(|(m, w)| *m = *w);
        Ok(())
    }

    fn accept(&mut self, _token: u32) -> Result<(), String> {
        // The mask already kept every other token out; nothing depends on what was drawn.
        Ok(())
    }

    fn follow(&mut self, _token: u32) -> Result<(), String> {
        // Every row's mask is the same list.
        Ok(())
    }

    fn rollback(&mut self, _n: usize) {}
}

/// A constraint factory for `ids` (non-empty, inside the vocabulary of `vocab_size`).
pub fn factory(ids: &[u32], vocab_size: usize) -> ConstraintFactory {
    let mut words = vec![0u32; vocab_size.div_ceil(32)];
    for &t in ids {
        words[t as usize / 32] |= 1 << (t % 32);
    }
    let words: Arc<[u32]> = words.into();
    ConstraintFactory(Arc::new(move || Box::new(AllowedTokens { words: words.clone() })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_holds_exactly_the_listed_ids() {
        let f = factory(&[0, 31, 32, 70], 100);
        let mut c = (f.0)();
        let mut mask = vec![0u32; 4];
        c.fill_mask(&mut mask, Instant::now()).unwrap();
        let allowed: Vec<u32> = (0..100).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect();
        assert_eq!(allowed, vec![0, 31, 32, 70]);
        assert!(c.accept(31).is_ok());
        // Every completion gets the same mask, whatever the others drew.
        let mut again = vec![0u32; 4];
        (f.0)().fill_mask(&mut again, Instant::now()).unwrap();
        assert_eq!(mask, again);
    }
}
