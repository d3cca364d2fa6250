//! `CudaGroupBackend`: one copy of the model over several GPUs of one process, a worker thread
//! per GPU (its rank), as tensor parallelism or DP attention (see `RankMode`). The ranks talk to
//! each other only through their `DeviceCollective` (NCCL); this backend hands every rank its
//! share of each step and collects the answers:
//! - tensor parallel: every rank runs the engine's one plan; all of them compute the same
//!   tokens, and rank 0's output is the answer;
//! - DP attention: rank r runs plan r; before any rank starts, the group agrees on graph or eager
//!   and on the rows per rank (`mla_core::agreement`), and an idle rank still runs every FFN
//!   collective.
//!
//! A rank that fails (an error, a panic, a device fault) leaves the others waiting in a
//! collective: the group gives them a moment to fail too, then aborts every rank's collectives
//! and reports a `FatalBackendError`. So does a step that outlives the watchdog.

use crate::backend::{CudaOptions, WeightsFrom};
use crate::collective::{Aborter, GroupConnector};
use crate::model::graph_expressible;
use crate::ops::PAGE_SIZE;
use crate::worker::{start_worker, RankJoin, Worker};
use mla_core::agreement::{agree, StepAgreement};
use mla_core::collective::ThreadGroup;
use mla_core::plan::{StepOutput, StepPlan};
use mla_core::step_thread::{StepRunner, StepShape, StepSize, StepThread};
use mla_core::{Backend, CacheLayout, FatalBackendError, ModelConfig, RankLayout};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the other ranks get to fail on their own after one rank failed, before the group
/// aborts their collectives.
const PEER_GRACE: Duration = Duration::from_secs(2);
/// How long ranks get to return once their collectives were aborted.
const ABORT_GRACE: Duration = Duration::from_secs(5);
/// How long the host-side agreement at startup (KV size) waits for the slowest rank.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1800);

/// The layout of a group and how it behaves.
#[derive(Clone)]
pub struct GroupOptions {
    /// Ranks (GPUs `options.device .. options.device + world`).
    pub world: usize,
    /// DP attention instead of tensor parallelism.
    pub dp_attention: bool,
    /// A step that takes longer than this stops the group.
    pub watchdog: Duration,
    pub connector: Arc<dyn GroupConnector>,
}

pub struct CudaGroupBackend {
    cfg: ModelConfig,
    dp_attention: bool,
    ranks: Vec<StepThread<RankWorker>>,
    layouts: Vec<CacheLayout>,
    max_model_len: usize,
    max_tokens: usize,
    graph_batches: Vec<usize>,
    name: String,
    aborters: Vec<Aborter>,
    watchdog: Duration,
    /// Why the step in flight could not start (a plan that does not fit), or None.
    refused: Option<anyhow::Error>,
    /// A rank failed: the group's collectives are broken for good.
    broken: Option<String>,
}

/// What every rank gets for one step.
struct GroupStep {
    plans: Arc<Vec<StepPlan>>,
    /// DP attention's agreement; tensor-parallel ranks decide alike on their own.
    agreed: Option<StepAgreement>,
}

impl StepSize for GroupStep {
    fn size(&self) -> StepShape {
        self.plans.as_ref().size()
    }
}

struct RankWorker {
    worker: Worker,
    /// The plan this rank runs: its own under DP attention, the one shared plan otherwise.
    plan_index: usize,
    rank: usize,
    steps: u64,
}

impl StepRunner for RankWorker {
    type Step = GroupStep;
    type Output = StepOutput;

    fn run_step(&mut self, step: &GroupStep) -> anyhow::Result<StepOutput> {
        self.steps += 1;
        mla_core::fault::maybe_kill(self.rank, self.steps);
        let plan = &step.plans[self.plan_index];
        match &step.agreed {
            None => self.worker.step(plan),
            Some(a) => self.worker.step_agreed(plan, a),
        }
    }
}

/// What a rank reports once it is ready.
struct Ready {
    name: String,
    num_blocks: usize,
    graph_batches: Vec<usize>,
    aborter: Aborter,
}

impl CudaGroupBackend {
    /// Starts `group.world` ranks of `cfg` (the whole model's config; each rank takes its share)
    /// on consecutive GPUs from `opts.device`, all at once (their communicators' setup waits for
    /// every rank), and returns when all are ready or the first has failed.
    pub fn new(cfg: ModelConfig, weights: WeightsFrom, opts: CudaOptions, group: GroupOptions) -> anyhow::Result<Self> {
        let world = group.world;
        anyhow::ensure!(world >= 1, "a group has at least one rank");
        crate::model::check_supported(&cfg)?;
        for r in 0..world {
            let layout = RankLayout { rank: r, world, dp_attention: group.dp_attention };
            crate::model::check_supported(&layout.local_config(&cfg))
                .map_err(|e| anyhow::anyhow!("rank {r} of {world}: {e}"))?;
        }
        let inits: Vec<_> = ThreadGroup::ranks(world, STARTUP_TIMEOUT)
            .into_iter()
            .enumerate()
            .map(|(r, host)| {
                let (cfg, weights, connector) = (cfg.clone(), weights.clone(), group.connector.clone());
                let opts = CudaOptions { device: opts.device + r, ..opts.clone() };
                let layout = RankLayout { rank: r, world, dp_attention: group.dp_attention };
                let init = move || {
                    let join = RankJoin { layout, connector, host };
                    let worker = start_worker(cfg, weights, &opts, Some(join))?;
                    let comm = worker.model.mode.comm().expect("a rank of a group has a collective");
                    let ready = Ready {
                        name: worker.describe(opts.device),
                        num_blocks: worker.model.num_blocks,
                        graph_batches: worker.graphs.batch_sizes(),
                        aborter: comm.aborter(),
                    };
                    let plan_index = if group.dp_attention { r } else { 0 };
                    Ok((RankWorker { worker, plan_index, rank: r, steps: 0 }, ready))
                };
                (format!("cuda-rank-{r}"), init)
            })
            .collect();
        let started = StepThread::spawn_group(inits)?;
        let ready: Vec<&Ready> = started.iter().map(|(_, r)| r).collect();
        // The ranks agreed on the cache size and captured the same graphs; check, since a
        // mismatch would hang the first step that relies on it.
        let num_blocks = ready[0].num_blocks;
        let graph_batches = ready[0].graph_batches.clone();
        for (r, x) in ready.iter().enumerate() {
            anyhow::ensure!(
                x.num_blocks == num_blocks && x.graph_batches == graph_batches,
                "rank {r} disagrees with rank 0 on the KV cache ({} blocks, not {num_blocks}) or the decode graphs ({:?}, not {graph_batches:?})",
                x.num_blocks,
                x.graph_batches
            );
        }
        let mode = if group.dp_attention { "DP attention" } else { "tensor parallel" };
        let name =
            format!("{world} GPUs, {mode}: {}", ready.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", "));
        let aborters = ready.iter().map(|r| r.aborter.clone()).collect();
        let attention_ranks = if group.dp_attention { world } else { 1 };
        let layout = CacheLayout { block_size: PAGE_SIZE, num_blocks };
        let max_model_len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        Ok(CudaGroupBackend {
            cfg,
            dp_attention: group.dp_attention,
            ranks: started.into_iter().map(|(t, _)| t).collect(),
            layouts: vec![layout; attention_ranks],
            max_model_len,
            max_tokens: opts.max_num_batched_tokens,
            graph_batches,
            name,
            aborters,
            watchdog: group.watchdog,
            refused: None,
            broken: None,
        })
    }

    /// Decode batch sizes every rank replays from CUDA graphs.
    pub fn graph_batch_sizes(&self) -> &[usize] {
        &self.graph_batches
    }

    /// Checks every plan before any rank starts: a rank that refused its plan after the others
    /// entered a collective would leave them waiting.
    fn check(&self, plans: &[StepPlan]) -> anyhow::Result<()> {
        anyhow::ensure!(
            plans.len() == self.layouts.len(),
            "the step has {} plans for {} attention ranks",
            plans.len(),
            self.layouts.len()
        );
        for (plan, l) in plans.iter().zip(&self.layouts) {
            plan.validate(l.block_size, l.num_blocks, self.cfg.vocab_size, self.max_model_len)?;
            anyhow::ensure!(
                plan.num_tokens() <= self.max_tokens,
                "a plan of {} tokens exceeds the {} a rank's step holds",
                plan.num_tokens(),
                self.max_tokens
            );
        }
        Ok(())
    }

    /// Waits for every rank's output; a failure or the watchdog ends the group (see the module
    /// documentation).
    fn collect(&mut self) -> Result<Vec<StepOutput>, String> {
        let started = Instant::now();
        let n = self.ranks.len();
        let mut answers: Vec<Option<anyhow::Result<StepOutput>>> = (0..n).map(|_| None).collect();
        let mut first_failure: Option<Instant> = None;
        let mut aborted: Option<Instant> = None;
        let mut notes: Vec<String> = Vec::new();
        loop {
            let mut pending = 0;
            for (t, answer) in self.ranks.iter_mut().zip(&mut answers) {
                if answer.is_some() {
                    continue;
                }
                // Wait on the first pending rank, look at the others in passing.
                let wait = if pending == 0 { Duration::from_millis(50) } else { Duration::ZERO };
                match t.finish_step_until(Some(Instant::now() + wait)) {
                    Some(a) => {
                        if a.is_err() {
                            first_failure.get_or_insert_with(Instant::now);
                        }
                        *answer = Some(a);
                    }
                    None => pending += 1,
                }
            }
            if pending == 0 {
                break;
            }
            let overdue = started.elapsed() > self.watchdog;
            let peers_stuck = first_failure.is_some_and(|t| t.elapsed() > PEER_GRACE);
            match aborted {
                None if overdue || peers_stuck => {
                    if overdue {
                        notes.push(format!(
                            "the step outlived the watchdog ({:.0} s, --watchdog-timeout)",
                            self.watchdog.as_secs_f64()
                        ));
                    }
                    self.abort_all();
                    aborted = Some(Instant::now());
                }
                Some(t) if t.elapsed() > ABORT_GRACE => {
                    notes.push(format!("{pending} rank(s) did not return after their collectives were aborted"));
                    break;
                }
                _ => {}
            }
        }
        // Every failing rank is named: the one that died and the ones its death broke.
        let mut failures: Vec<String> = answers
            .iter()
            .enumerate()
            .filter_map(|(r, a)| match a {
                Some(Err(e)) => Some(format!("rank {r}: {e:#}")),
                _ => None,
            })
            .collect();
        failures.extend(notes);
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(answers.into_iter().map(|a| a.expect("every rank answered").expect("no rank failed")).collect())
    }

    /// Aborts every rank's collectives, each on a thread of its own and without waiting: an
    /// abort may block while its device still runs (NCCL does not promise to interrupt a kernel
    /// inside a graph), and nothing here may hang on it.
    fn abort_all(&self) {
        tracing::error!("aborting the collectives of every rank");
        for (r, a) in self.aborters.iter().enumerate() {
            let a = a.clone();
            let spawned = std::thread::Builder::new().name(format!("nccl-abort-{r}")).spawn(move || a());
            if let Err(e) = spawned {
                tracing::error!("cannot start a thread to abort rank {r}: {e}");
            }
        }
    }
}

impl Backend for CudaGroupBackend {
    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.layouts.clone()
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        if let Err(e) = self.check(plans) {
            self.refused = Some(e);
            return;
        }
        if self.broken.is_some() {
            return;
        }
        let agreed = self.dp_attention.then(|| agree(plans, &self.graph_batches, graph_expressible));
        let step = Arc::new(GroupStep { plans: plans.clone(), agreed });
        for r in &mut self.ranks {
            r.start_step(&step);
        }
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        if let Some(e) = self.refused.take() {
            return Err(e);
        }
        if let Some(why) = &self.broken {
            return Err(FatalBackendError(format!("the GPU rank group stopped earlier: {why}")).into());
        }
        let mut outs = match self.collect() {
            Ok(outs) => outs,
            Err(why) => {
                self.broken = Some(why.clone());
                return Err(FatalBackendError(why).into());
            }
        };
        if self.dp_attention {
            return Ok(outs);
        }
        // Tensor parallel: every rank sampled from the same all-reduced logits.
        let tokens = |o: &StepOutput| o.seqs.iter().map(|s| s.sampled.as_ref().map(|t| t.token)).collect::<Vec<_>>();
        if let Some(r) = outs.iter().position(|o| tokens(o) != tokens(&outs[0])) {
            let why = format!("rank {r} sampled other tokens than rank 0 from the same all-reduced sums");
            self.broken = Some(why.clone());
            return Err(FatalBackendError(why).into());
        }
        outs.truncate(1);
        Ok(outs)
    }
}

impl Drop for CudaGroupBackend {
    fn drop(&mut self) {
        if self.broken.is_none() {
            return; // The rank threads end and free their devices on their own threads.
        }
        // A rank may still be stuck on its device: abort (again) and leave the threads to the
        // process's exit rather than hang in a join.
        self.abort_all();
        for t in self.ranks.drain(..) {
            t.detach();
        }
    }
}
