//! Host work between decode steps, measured on the CPU alone: the real `Engine` drives a backend
//! that answers every step at once (after `--step-us` of simulated device time), so what remains
//! is the host path the GPU waits for: the engine applying the step, handling commands,
//! scheduling and handing the next plan over, plus the CUDA backend's own host work per graph
//! step (plan validation, borrowing the graph's padding rows, `StepMeta::build_rows`, the copy
//! into the staging buffer, assembling the output; `--no-cuda-meta` leaves it out). The steps run
//! on mla-core's `StepThread`, the worker thread `CudaBackend` runs on, started asynchronously as
//! the engine starts CUDA steps; `--inline` runs them on the engine thread instead.
//!
//! `between_steps_us` is measured like the CUDA backend's step clock: from the end of one step's
//! work on the worker to the start of the next, over steps where every request decodes (`batch`
//! sequences, decode after decode); `cuda_meta_prep_us` is the metadata work at the start of a
//! step (the step clock's graph prep, less the upload and launch); `host_total_us` is both.

use mla_core::runtime::step_thread::{StepRunner, StepThread};
use mla_core::step::plan::{SampledToken, SeqResult, SeqStep, StepOutput};
use mla_core::{Backend, CacheLayout, ModelConfig, PendingStep, StepKind, StepPlan};
use mla_cuda::model::graph::{graph_step_meta, pad_rows};
use mla_cuda::model::{MetaLimits, StepMeta};
use mla_cuda::DEFAULT_GRAPH_BATCH_SIZES;
use mla_engine::{Engine, EngineConfig, EngineEvent};
use rand::SeedableRng;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct HostArgs {
    pub config: PathBuf,
    pub batch: usize,
    pub context: usize,
    /// Full-batch decode steps to measure.
    pub steps: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Do the CUDA backend's host-side work per step (validate, pad, build metadata, stage).
    pub cuda_meta: bool,
    /// Run steps on a worker thread, handed over as `CudaBackend` does.
    pub thread: bool,
    /// Simulated device time per step (the worker sleeps): what the engine can hide its
    /// bookkeeping behind, and what makes threads go idle between hand-overs.
    pub step_us: u64,
    pub seed: u64,
}

/// One step as the backend saw it.
#[derive(Debug, Clone, Copy)]
struct StepRecord {
    kind: StepKind,
    seqs: usize,
    /// Since the previous step's end (None for the first).
    gap: Option<Duration>,
    /// The CUDA-side host work of this step (metadata), zero without `cuda_meta`.
    prep: Duration,
}

/// The host side of a step that answers at once: what `CudaModel::step_with_graphs` does on the
/// host, minus the device calls.
struct HostStep {
    lim: MetaLimits,
    num_blocks: usize,
    vocab: usize,
    max_model_len: usize,
    cuda_meta: bool,
    step_us: u64,
    /// Stands in for the pinned staging buffer.
    staging: Vec<i32>,
    /// Graph padding rows and the reused metadata words, as `DecodeGraphs` keeps them.
    pads: Vec<SeqStep>,
    spare_words: Vec<i32>,
    last_end: Option<Instant>,
    records: Arc<Mutex<Vec<StepRecord>>>,
    counter: u64,
    /// The first step waits until every request is submitted, so all of them run together.
    start: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl HostStep {
    fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        if self.last_end.is_none() {
            let (lock, cv) = &*self.start;
            let _go = cv.wait_while(lock.lock().unwrap(), |go| !*go).unwrap();
        }
        let start = Instant::now();
        let gap = self.last_end.map(|e| start - e);
        let out = if self.cuda_meta { self.cuda_host_work(plan)? } else { self.answer(plan) };
        let prep = if self.cuda_meta { start.elapsed() } else { Duration::ZERO };
        if self.step_us > 0 {
            // The device's share of the step. Sleeping leaves the core to the engine and the
            // clients, as it is on a machine with cores to spare (the real worker spins in
            // the stream synchronisation); it only ends late, inside the step, not in the gap.
            std::thread::sleep(Duration::from_micros(self.step_us));
        }
        self.records.lock().unwrap().push(StepRecord { kind: plan.kind, seqs: plan.seqs.len(), gap, prep });
        self.last_end = Some(Instant::now());
        Ok(out)
    }

    fn token(&mut self, seq_id: u64) -> u32 {
        self.counter = self.counter.wrapping_add(1);
        ((seq_id.wrapping_mul(31).wrapping_add(self.counter)) % self.vocab as u64) as u32
    }

    fn answer(&mut self, plan: &StepPlan) -> StepOutput {
        let seqs = plan
            .seqs
            .iter()
            .map(|s| SeqResult {
                scores: vec![],
                seq_id: s.seq_id,
                logits: vec![],
                sampled: s.sample.as_ref().map(|_| SampledToken {
                    token: self.token(s.seq_id),
                    logprob: 0.0,
                    top_logprobs: vec![],
                }),
                extra_tokens: vec![],
                drafts: vec![],
            })
            .collect();
        StepOutput { seqs }
    }

    fn cuda_host_work(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        plan.validate(mla_cuda::ops::PAGE_SIZE, self.num_blocks, self.vocab, self.max_model_len)?;
        let meta = match DEFAULT_GRAPH_BATCH_SIZES.iter().find(|&&b| b >= plan.seqs.len()) {
            Some(&batch) if plan.kind == StepKind::Decode => {
                graph_step_meta(plan, &self.pads, batch, &self.lim, std::mem::take(&mut self.spare_words))?
            }
            _ => StepMeta::build(plan, &self.lim)?,
        };
        if self.staging.len() < meta.words.len() {
            self.staging.resize(meta.words.len().next_power_of_two(), 0);
        }
        self.staging[..meta.words.len()].copy_from_slice(&meta.words);
        std::hint::black_box(&self.staging);
        // As `read_outputs`: one result per sequence, in order, from the metadata's rows.
        let seqs = meta
            .outputs
            .iter()
            .map(|o| SeqResult {
                scores: vec![],
                seq_id: o.seq_id,
                logits: vec![],
                sampled: o.sample_row.map(|_| SampledToken {
                    token: self.token(o.seq_id),
                    logprob: 0.0,
                    top_logprobs: vec![],
                }),
                extra_tokens: vec![],
                drafts: vec![],
            })
            .collect();
        self.spare_words = meta.words;
        Ok(StepOutput { seqs })
    }
}

impl StepRunner for HostStep {
    type Step = Vec<StepPlan>;
    type Output = Vec<StepOutput>;

    fn run_step(&mut self, plans: &Vec<StepPlan>) -> anyhow::Result<Vec<StepOutput>> {
        plans.iter().map(|p| self.step(p)).collect()
    }
}

/// A backend answering at once, on the engine thread or on a worker thread of its own.
struct InstantBackend {
    cfg: ModelConfig,
    layout: CacheLayout,
    run: Runner,
}

enum Runner {
    Inline(HostStep, PendingStep),
    Thread(StepThread<HostStep>),
}

impl Backend for InstantBackend {
    fn device_name(&self) -> String {
        "instant host backend".into()
    }
    fn model_config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![self.layout]
    }

    fn step_limits(&self) -> mla_core::StepLimits {
        mla_core::StepLimits::unlimited()
    }
    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        match &mut self.run {
            Runner::Inline(_, pending) => pending.set(plans),
            Runner::Thread(t) => t.start_step(plans),
        }
    }
    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        match &mut self.run {
            Runner::Inline(h, pending) => h.run_step(pending.take()?.as_ref()),
            Runner::Thread(t) => t.finish_step(),
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(mut v: Vec<f64>) -> Value {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    json!({ "n": v.len(), "median": percentile(&v, 0.5), "p90": percentile(&v, 0.9), "mean": mean, "min": v.first().copied().unwrap_or(0.0) })
}

pub fn run(a: &HostArgs) -> anyhow::Result<Value> {
    let mut cfg = ModelConfig::from_file(&a.config)?;
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(a.max_model_len);
    let vocab = cfg.vocab_size;
    let page = mla_cuda::ops::PAGE_SIZE;
    anyhow::ensure!(a.batch >= 1 && a.batch <= a.max_num_seqs, "--batch must be in 1..=--max-num-seqs");
    let prefill_steps = (a.batch * a.context).div_ceil(a.max_num_batched_tokens);
    let max_tokens = a.steps + 2 * prefill_steps + 4;
    anyhow::ensure!(
        a.context + max_tokens <= a.max_model_len,
        "context {} + {max_tokens} tokens exceeds --max-model-len {}",
        a.context,
        a.max_model_len
    );
    // Room for every sequence to its end, so nothing is preempted (as on the H200's cache).
    let num_blocks = (a.batch * (a.context + max_tokens).div_ceil(page)).max(a.max_model_len.div_ceil(page)) + 64;
    let layout = CacheLayout { block_size: page, num_blocks };
    let lim = MetaLimits {
        max_tokens: a.max_num_batched_tokens,
        max_seqs: a.max_num_seqs,
        max_logit_rows: a.max_num_seqs + 512,
        max_kv_chunk: a.max_num_batched_tokens.max(16384),
        max_blocks_per_seq: a.max_model_len.div_ceil(page),
        vocab,
    };
    let records = Arc::new(Mutex::new(Vec::new()));
    let start = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let host = HostStep {
        lim,
        num_blocks,
        vocab,
        max_model_len: a.max_model_len,
        cuda_meta: a.cuda_meta,
        step_us: a.step_us,
        staging: Vec::new(),
        pads: pad_rows(a.max_num_seqs, num_blocks),
        spare_words: Vec::new(),
        last_end: None,
        records: records.clone(),
        counter: 0,
        start: start.clone(),
    };
    let run = if a.thread {
        Runner::Thread(StepThread::spawn("host-bench-worker".into(), move || Ok((host, ())))?.0)
    } else {
        Runner::Inline(host, PendingStep::default())
    };
    let backend = InstantBackend { cfg, layout, run };
    let h = Engine::start(
        Box::new(backend),
        EngineConfig {
            spec_load_rule: false,
            long_prefill_token_threshold: None,
            max_model_len: a.max_model_len,
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: a.max_num_batched_tokens,
            max_queued_requests: 1 << 20,
            seed: a.seed,
            prefix_caching: true,
            mixed_steps: false,
            mtp_drafts: 0,
            spec_disable_batch: None,
            step_watchdog: std::time::Duration::from_secs(600),
            router: mla_engine::RouterConfig::default(),
        },
    )?;
    // Clients as in the engine benchmark and the server: one task per request on a small runtime.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let (done_tx, done_rx) = mpsc::channel::<usize>();
    let t0 = Instant::now();
    for _ in 0..a.batch {
        let req = crate::engine_bench::request(&mut rng, a.context, vocab, max_tokens);
        let mut stream = h.submit(req).map_err(|e| anyhow::anyhow!("submit: {e}"))?;
        let done = done_tx.clone();
        rt.spawn(async move {
            let mut tokens = 0;
            while let Some(ev) = stream.events.recv().await {
                match ev {
                    EngineEvent::Token { .. } => tokens += 1,
                    EngineEvent::Finished { .. }
                    | EngineEvent::Admitted { .. }
                    | EngineEvent::PromptLogprobs { .. } => {}
                    EngineEvent::Error { message } | EngineEvent::Rejected { message } => {
                        panic!("engine error: {message}")
                    }
                }
            }
            let _ = done.send(tokens);
        });
    }
    drop(done_tx);
    *start.0.lock().unwrap() = true;
    start.1.notify_all();
    let tokens: usize = done_rx.iter().sum();
    let wall = t0.elapsed().as_secs_f64();
    h.shutdown(Duration::from_secs(5));
    anyhow::ensure!(tokens == a.batch * max_tokens, "expected {} tokens, got {tokens}", a.batch * max_tokens);

    let recs = records.lock().unwrap().clone();
    let full = |r: &StepRecord| r.kind == StepKind::Decode && r.seqs == a.batch;
    let mut gaps = vec![];
    let mut preps = vec![];
    for w in recs.windows(2) {
        if full(&w[0]) && full(&w[1]) {
            gaps.push(w[1].gap.map_or(0.0, |g| g.as_secs_f64() * 1e6));
            preps.push(w[1].prep.as_secs_f64() * 1e6);
        }
    }
    // The last steps run with requests finishing; keep the steady state only.
    gaps.truncate(a.steps);
    preps.truncate(a.steps);
    let total: Vec<f64> = gaps.iter().zip(&preps).map(|(g, p)| g + p).collect();
    Ok(json!({
        "batch": a.batch,
        "context": a.context,
        "handoff": if a.thread { "thread" } else { "inline" },
        "cuda_meta": a.cuda_meta,
        "step_us": a.step_us,
        "steps_total": recs.len(),
        "wall_s": wall,
        "between_steps_us": summary(gaps),
        "cuda_meta_prep_us": summary(preps),
        "host_total_us": summary(total),
    }))
}
