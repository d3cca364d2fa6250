//! `GroupBackend`: the engine's `Backend` over a group's ranks, local and remote.

use super::collect::{collect, LocalRank, Participant};
use super::node::{spawn_abort, NodeStep, RemoteNode};
use super::Aborter;
use crate::model::config::ModelConfig;
use crate::runtime::agreement::agree;
use crate::runtime::step_thread::{StepRunner, StepThread};
use crate::step::backend::{Backend, CacheLayout, FatalBackendError};
use crate::step::limits::StepLimits;
use crate::step::plan::{StepOutput, StepPlan};
use std::sync::Arc;
use std::time::Duration;

/// What a group is made of; see `GroupBackend::new`.
pub struct GroupParts<W: StepRunner<Step = NodeStep, Output = StepOutput>> {
    /// The whole model's config.
    pub cfg: ModelConfig,
    pub dp_attention: bool,
    /// This process's ranks: global ranks `0 .. local.len()` (node 0).
    pub local: Vec<StepThread<W>>,
    pub aborters: Vec<Aborter>,
    /// The other nodes, in node order, ready (`RemoteNode::wait_ready`); their ranks follow.
    pub remotes: Vec<(RemoteNode, usize)>,
    /// Every rank's KV cache (they are equal).
    pub cache: CacheLayout,
    pub max_model_len: usize,
    /// The largest step every rank was sized for (equal on every rank).
    pub step_limits: StepLimits,
    /// Decode batch sizes every rank captured as graphs, and which plans a graph can run.
    pub graph_batches: Vec<usize>,
    pub graphable: fn(&StepPlan) -> bool,
    pub watchdog: Duration,
    /// For logs and `Backend::device_name`.
    pub name: String,
    /// `Backend::verifies_sampled_drafts` of the ranks.
    pub sampled_drafts: bool,
    /// `Backend::forks_blocks` of the ranks.
    pub forks_blocks: bool,
    /// `Backend::verifies_shaped_drafts` of the ranks.
    pub shaped_drafts: bool,
}

pub struct GroupBackend<W: StepRunner<Step = NodeStep, Output = StepOutput>> {
    p: GroupParts<W>,
    world: usize,
    /// Why the step in flight could not start (a plan that does not fit), or None.
    refused: Option<anyhow::Error>,
    /// A rank failed: the group's collectives are broken for good.
    broken: Option<String>,
    /// A step waiting to be sent to the other nodes (see `start_step`).
    unsent: Option<Arc<NodeStep>>,
}

impl<W: StepRunner<Step = NodeStep, Output = StepOutput>> GroupBackend<W> {
    pub fn new(parts: GroupParts<W>) -> Self {
        let world = parts.local.len() + parts.remotes.iter().map(|(_, n)| n).sum::<usize>();
        GroupBackend { p: parts, world, refused: None, broken: None, unsent: None }
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn graph_batch_sizes(&self) -> &[usize] {
        &self.p.graph_batches
    }

    fn attention_ranks(&self) -> usize {
        if self.p.dp_attention {
            self.world
        } else {
            1
        }
    }

    /// Checks every plan before any rank starts: a rank that refused its plan after the others
    /// entered a collective would leave them waiting.
    fn check(&self, plans: &[StepPlan]) -> anyhow::Result<()> {
        let ranks = self.attention_ranks();
        anyhow::ensure!(plans.len() == ranks, "the step has {} plans for {ranks} attention ranks", plans.len());
        let (c, cfg) = (&self.p.cache, &self.p.cfg);
        for plan in plans {
            plan.validate(c.block_size, c.num_blocks, cfg.vocab_size, self.p.max_model_len)?;
            anyhow::ensure!(self.p.forks_blocks || !plan.has_forks(), "these ranks do not fork cache blocks");
            anyhow::ensure!(
                self.p.shaped_drafts || !plan.has_shaped_drafts(),
                "these ranks do not verify drafts of requests with penalties or logit_bias"
            );
        }
        Ok(self.p.step_limits.check(plans)?)
    }

    fn send_to_nodes(&mut self, step: &NodeStep) {
        for (r, _) in &mut self.p.remotes {
            r.start(step);
        }
    }

    fn abort_all(&mut self) {
        tracing::error!("aborting the collectives of every rank");
        self.p.aborters.iter().for_each(|a| spawn_abort(a.clone()));
        self.p.remotes.iter_mut().for_each(|(r, _)| r.abort());
    }

    /// Waits for every rank's output (local ranks, then each node's), stopping the group on a
    /// failure or at the watchdog.
    fn collect(&mut self) -> Result<Vec<StepOutput>, String> {
        let aborters = self.p.aborters.clone();
        let GroupParts { local, remotes, watchdog, .. } = &mut self.p;
        let mut locals: Vec<LocalRank<W>> =
            local.iter_mut().enumerate().map(|(rank, thread)| LocalRank { rank, thread }).collect();
        let mut parts: Vec<&mut dyn Participant> = locals.iter_mut().map(|l| l as &mut dyn Participant).collect();
        parts.extend(remotes.iter_mut().map(|(r, _)| r as &mut dyn Participant));
        // Remote nodes abort on their side once told, which `abort_all` does after this returns.
        let r = collect(&mut parts, *watchdog, &|| aborters.iter().for_each(|a| spawn_abort(a.clone())));
        if r.is_err() {
            remotes.iter_mut().for_each(|(r, _)| r.abort());
        }
        r
    }
}

impl<W: StepRunner<Step = NodeStep, Output = StepOutput>> Backend for GroupBackend<W> {
    fn device_name(&self) -> String {
        self.p.name.clone()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.p.cfg
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![self.p.cache; self.attention_ranks()]
    }

    fn step_limits(&self) -> StepLimits {
        self.p.step_limits
    }

    fn verifies_sampled_drafts(&self) -> bool {
        self.p.sampled_drafts
    }

    fn forks_blocks(&self) -> bool {
        self.p.forks_blocks
    }

    fn verifies_shaped_drafts(&self) -> bool {
        self.p.shaped_drafts
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        if let Err(e) = self.check(plans) {
            self.refused = Some(e);
            return;
        }
        if self.broken.is_some() {
            return;
        }
        let agreed = self.p.dp_attention.then(|| agree(plans, &self.p.graph_batches, self.p.graphable));
        let step = Arc::new(NodeStep { plans: plans.clone(), agreed });
        // Other nodes get the plans serialised, and a structured-output mask serialises as its
        // words, which the engine computes only after this returns: such a step goes out at
        // the start of `finish_step` instead (the local ranks start now and wait for the
        // remote ones in their first collective).
        if plans.iter().any(StepPlan::has_pending_masks) {
            self.unsent = Some(step.clone());
        } else {
            self.send_to_nodes(&step);
        }
        for t in &mut self.p.local {
            t.start_step(&step);
        }
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        if let Some(step) = self.unsent.take() {
            self.send_to_nodes(&step);
        }
        if let Some(e) = self.refused.take() {
            return Err(e);
        }
        if let Some(why) = &self.broken {
            return Err(FatalBackendError(format!("the rank group stopped earlier: {why}")).into());
        }
        let mut outs = match self.collect() {
            Ok(outs) => outs,
            Err(why) => {
                self.broken = Some(why.clone());
                return Err(FatalBackendError(why).into());
            }
        };
        if self.p.dp_attention {
            return Ok(outs);
        }
        // Tensor parallel: every rank sampled from the same all-reduced logits.
        let tokens = |o: &StepOutput| o.seqs.iter().map(|s| s.sampled.as_ref().map(|t| t.token)).collect::<Vec<_>>();
        if let Some(r) = outs.iter().position(|o| tokens(o) != tokens(&outs[0])) {
            let why = format!("rank {r} sampled other tokens than rank 0 from the same all-reduced sums");
            self.broken = Some(why.clone());
            self.abort_all();
            return Err(FatalBackendError(why).into());
        }
        outs.truncate(1);
        Ok(outs)
    }
}

impl<W: StepRunner<Step = NodeStep, Output = StepOutput>> Drop for GroupBackend<W> {
    fn drop(&mut self) {
        if self.broken.is_none() {
            // The other nodes leave cleanly; the local rank threads end and free their devices.
            self.p.remotes.iter_mut().for_each(|(r, _)| r.stop());
            return;
        }
        // A rank may still be stuck on its device: abort (again) and leave the threads to the
        // process's exit rather than hang in a join.
        self.abort_all();
        for t in self.p.local.drain(..) {
            t.detach();
        }
    }
}
