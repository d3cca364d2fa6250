//! `Ranks`: several `HistoryBackend`s behind one `Backend`, one per attention rank, each with
//! its own cache, as a DP-attention backend looks to the engine. It can be told to fail for good
//! at a given step, as a backend does when a rank dies.

use super::HistoryBackend;
use mla_core::step::plan::StepOutput;
use mla_core::{Backend, CacheLayout, FatalBackendError, ModelConfig, StepKind, StepPlan};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct Ranks {
    pub ranks: Vec<HistoryBackend>,
    /// Step number (1-based) that fails with `FatalBackendError`; every later step fails too.
    pub fatal_at: Option<usize>,
    pub steps: Arc<AtomicUsize>,
    /// Every step's plan sizes per rank, to check idle ranks still take part.
    pub shapes: Arc<Mutex<Vec<Vec<usize>>>>,
    /// Every step's kind per rank (`None`: idle).
    pub kinds: Arc<Mutex<Vec<Vec<Option<StepKind>>>>>,
    pending: Option<Arc<Vec<StepPlan>>>,
}

impl Ranks {
    pub fn new(ranks: Vec<HistoryBackend>) -> Self {
        Ranks {
            ranks,
            fatal_at: None,
            steps: Arc::default(),
            shapes: Arc::default(),
            kinds: Arc::default(),
            pending: None,
        }
    }
}

impl Backend for Ranks {
    fn device_name(&self) -> String {
        format!("{} history test ranks", self.ranks.len())
    }

    fn model_config(&self) -> &ModelConfig {
        self.ranks[0].model_config()
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.ranks.iter().flat_map(|r| r.cache_layouts()).collect()
    }

    fn step_limits(&self) -> mla_core::StepLimits {
        mla_core::StepLimits::unlimited()
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        assert!(self.pending.replace(plans.clone()).is_none(), "two steps in flight");
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        let plans = self.pending.take().expect("a started step");
        let step = self.steps.fetch_add(1, Ordering::SeqCst) + 1;
        assert_eq!(plans.len(), self.ranks.len(), "one plan per rank, every step");
        self.shapes.lock().unwrap().push(plans.iter().map(|p| p.seqs.len()).collect());
        self.kinds.lock().unwrap().push(plans.iter().map(|p| (!p.seqs.is_empty()).then_some(p.kind)).collect());
        if self.fatal_at.is_some_and(|f| step >= f) {
            return Err(FatalBackendError(format!("rank 1 died at step {step}")).into());
        }
        let mut outs = Vec::with_capacity(plans.len());
        for (rank, plan) in self.ranks.iter_mut().zip(plans.iter()) {
            outs.push(if plan.seqs.is_empty() { StepOutput { seqs: vec![] } } else { rank.step(plan)? });
        }
        Ok(outs)
    }
}
