//! Grammar memory, counted against the server's budget.
//!
//! Each compiled grammar holds a `Charge` for the memory it uses: its compiled rules and its
//! lexer, whose table of states grows as generation explores the grammar (all completions of a
//! request share it). The charge is measured after compiling and again after every mask; it is
//! given back when the grammar's last user (its request's completions) is dropped. A grammar
//! that alone needs more than the per-request limit is refused, or fails its request when its
//! lexer grows past it; one that would take the total past the budget is refused with "retry
//! later", or fails its request when it grows past it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The budget and what is charged against it.
pub struct GrammarMemory {
    used: AtomicUsize,
    budget: usize,
    per_grammar: usize,
}

/// Why memory was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// One grammar needs more than `limit` alone: it can never be served.
    TooLarge { bytes: usize, limit: usize },
    /// The live grammars hold `used` of `budget`: retry when some have finished.
    BudgetFull { bytes: usize, used: usize, budget: usize },
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Refused::TooLarge { bytes, limit } => {
                write!(f, "the grammar needs {} of memory, more than the limit of {} per request", mib(bytes), mib(limit))
            }
            Refused::BudgetFull { bytes, used, budget } => write!(
                f,
                "the grammar needs {}, and grammars in use hold {} of the server's {} grammar memory budget; retry later",
                mib(bytes),
                mib(used),
                mib(budget)
            ),
        }
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// Memory held for one grammar; given back on drop.
pub struct Charge {
    pool: Arc<GrammarMemory>,
    bytes: AtomicUsize,
}

impl GrammarMemory {
    pub fn new(budget: usize, per_grammar: usize) -> Arc<Self> {
        Arc::new(GrammarMemory { used: AtomicUsize::new(0), budget, per_grammar })
    }

    /// Bytes charged now, over every live grammar.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Charges a new grammar's `bytes`.
    pub fn charge(self: &Arc<Self>, bytes: usize) -> Result<Charge, Refused> {
        let charge = Charge { pool: self.clone(), bytes: AtomicUsize::new(0) };
        charge.set(bytes)?;
        Ok(charge)
    }

    /// Takes `delta` more if the budget allows it.
    fn take(&self, delta: usize, bytes: usize) -> Result<(), Refused> {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                u.checked_add(delta).filter(|&total| total <= self.budget)
            })
            .map(|_| ())
            .map_err(|used| Refused::BudgetFull { bytes, used, budget: self.budget })
    }
}

impl Charge {
    /// The grammar now uses `bytes`: more is taken from the budget (refused past either limit,
    /// the charge unchanged), less given back.
    pub fn set(&self, bytes: usize) -> Result<(), Refused> {
        let pool = &self.pool;
        if bytes > pool.per_grammar {
            return Err(Refused::TooLarge { bytes, limit: pool.per_grammar });
        }
        let old = self.bytes.load(Ordering::SeqCst);
        if bytes > old {
            pool.take(bytes - old, bytes)?;
        } else {
            pool.used.fetch_sub(old - bytes, Ordering::SeqCst);
        }
        self.bytes.store(bytes, Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.pool.used.fetch_sub(*self.bytes.get_mut(), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_add_up_and_are_given_back() {
        let pool = GrammarMemory::new(100, 60);
        let a = pool.charge(40).unwrap();
        let b = pool.charge(50).unwrap();
        assert_eq!(pool.used(), 90);
        assert_eq!(pool.charge(20).err(), Some(Refused::BudgetFull { bytes: 20, used: 90, budget: 100 }));
        assert_eq!(pool.charge(61).err(), Some(Refused::TooLarge { bytes: 61, limit: 60 }));
        assert_eq!(pool.used(), 90, "refusals charge nothing");
        // Growing past the budget is refused and leaves the charge as it was; shrinking gives back.
        assert!(a.set(55).is_err());
        assert_eq!(pool.used(), 90);
        a.set(10).unwrap();
        assert_eq!(pool.used(), 60);
        drop(b);
        assert_eq!(pool.used(), 10);
        drop(a);
        assert_eq!(pool.used(), 0);
    }
}
