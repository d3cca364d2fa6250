//! The turn policy of an engine thread with several attention ranks (DP attention): which kind
//! of step each rank plans next. All ranks run one step together, so a rank that decodes waits
//! for any rank that prefills; taking turns (every rank with prompt work prefills in the same
//! step, then every rank with sequences decodes) makes a decoding rank wait once per turn rather
//! than once per rank that prefills. With mixed steps every rank decodes in every step and the
//! turns do not matter. A single rank simply plans what its scheduler picks.

use crate::scheduler::Scheduler;
use mla_core::step::plan::{StepKind, StepPlan};

/// The plan of a rank that has nothing to do in a step.
pub(super) fn idle() -> StepPlan {
    StepPlan { kind: StepKind::Decode, seqs: vec![] }
}

/// Whose turn it is: the kind of the last step of several ranks.
pub(super) struct Turns {
    /// Whether the last step prefilled on any rank.
    last_kind: StepKind,
}

impl Turns {
    pub fn new() -> Self {
        Turns { last_kind: StepKind::Decode }
    }

    /// Every rank's plan for the next step (an idle rank's is empty).
    pub fn schedule(&mut self, ranks: &mut [Scheduler]) -> Vec<StepPlan> {
        if ranks.len() == 1 {
            return vec![ranks[0].schedule().unwrap_or_else(idle)];
        }
        let prefer = match self.last_kind {
            StepKind::Decode => StepKind::Prefill,
            _ => StepKind::Decode,
        };
        let plans: Vec<StepPlan> = ranks.iter_mut().map(|s| s.schedule_prefer(prefer).unwrap_or_else(idle)).collect();
        let prefilled = plans.iter().any(|p| p.kind.has_prefill() && !p.seqs.is_empty());
        self.last_kind = if prefilled { StepKind::Prefill } else { StepKind::Decode };
        plans
    }
}
