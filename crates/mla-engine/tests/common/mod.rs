//! A backend for engine tests that checks the engine's cache bookkeeping for real: it keeps its
//! own paged token cache, written and read only through each step's block tables, and derives
//! every next-token distribution from the full history it reads back. A wrong block table, a
//! write into a shared block or a bad recompute after preemption changes the outputs, which the
//! tests compare with `reference`, a plain loop that never sees a block.

#![allow(dead_code)]

use anyhow::{bail, Context};
use mla_core::runtime::step_thread::{StepRunner, StepThread};
use mla_core::sampling::sample;
use mla_core::step::plan::{slot_of, LogitsRequest, PenaltyTokens, SampleRequest, SeqResult, StepOutput};
use mla_core::SplitMix64;
use mla_core::{Backend, CacheLayout, ModelConfig, PendingStep, SamplingParams, StepKind, StepPlan};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub mod ranks;

pub const VOCAB: usize = 64;

/// What the backend saw, for assertions.
#[derive(Debug, Default)]
pub struct Log {
    pub steps: usize,
    pub kinds: Vec<StepKind>,
    /// Sequence ids of every step, in order (failed steps included).
    pub seqs: Vec<Vec<u64>>,
    /// Last block table seen per sequence id.
    pub tables: HashMap<u64, Vec<u32>>,
    /// Tokens fed per sequence id, all steps together.
    pub fed: HashMap<u64, usize>,
    /// Block forks run (`SeqStep::fork`).
    pub forks: usize,
}

pub struct HistoryBackend {
    model: ModelConfig,
    layout: CacheLayout,
    cache: Vec<Option<u32>>,
    /// A step feeding this token fails (and nothing else does).
    pub poison: Option<u32>,
    pub delay: Duration,
    pub log: Arc<Mutex<Log>>,
    /// When set, every step waits for a permit, so a test can act between two known steps.
    pub gate: Option<Arc<StepGate>>,
    /// Copies blocks as plans ask (`Backend::forks_blocks`).
    pub forks: bool,
    pending: PendingStep,
}

/// Lets a test run the engine one step at a time: a step starts only with a permit, and the
/// test can wait until the engine is parked at the start of a given step (the one before it
/// fully delivered and published).
#[derive(Debug, Default)]
pub struct StepGate {
    state: Mutex<GateState>,
    changed: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    permits: usize,
    /// Steps that have asked to start (the one parked included).
    arrived: usize,
    open: bool,
}

impl StepGate {
    /// Called by the backend at the start of each step.
    fn pass(&self) {
        let mut s = self.state.lock().unwrap();
        s.arrived += 1;
        self.changed.notify_all();
        while !s.open && s.permits == 0 {
            s = self.changed.wait(s).unwrap();
        }
        if !s.open {
            s.permits -= 1;
        }
    }

    /// Lets `k` more steps run.
    pub fn allow(&self, k: usize) {
        self.state.lock().unwrap().permits += k;
        self.changed.notify_all();
    }

    /// Lets every step run from now on.
    pub fn open(&self) {
        self.state.lock().unwrap().open = true;
        self.changed.notify_all();
    }

    /// Waits until step number `step` (1-based) has asked to start: every step before it has
    /// been applied, its events sent and the statistics published.
    pub fn wait_parked_at(&self, step: usize) {
        let s = self.state.lock().unwrap();
        let (s, timeout) = self.changed.wait_timeout_while(s, Duration::from_secs(10), |s| s.arrived < step).unwrap();
        assert!(!timeout.timed_out(), "the engine never reached step {step} (at {})", s.arrived);
    }
}

pub fn model_config(max_len: usize) -> ModelConfig {
    let text = include_str!("../../../../configs/deepseek-v2-lite.json");
    let mut m = ModelConfig::from_json_str(text, "v2-lite").unwrap();
    m.vocab_size = VOCAB;
    m.max_position_embeddings = max_len;
    m
}

impl HistoryBackend {
    pub fn new(layout: CacheLayout, max_len: usize) -> Self {
        HistoryBackend {
            model: model_config(max_len),
            layout,
            cache: vec![None; layout.capacity_tokens()],
            poison: None,
            delay: Duration::ZERO,
            log: Arc::default(),
            gate: None,
            forks: false,
            pending: PendingStep::default(),
        }
    }
}

/// The model: logits are a hash of the whole history, so any change in it shows.
pub fn logits_for(history: &[u32]) -> Vec<f32> {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &t in history {
        h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    (0..VOCAB as u64)
        .map(|v| {
            (SplitMix64::new(h ^ v.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64() >> 40) as f32 / (1u64 << 24) as f32
                * 4.0
        })
        .collect()
}

impl Backend for HistoryBackend {
    fn device_name(&self) -> String {
        "history test backend".into()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.model
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![self.layout]
    }

    fn step_limits(&self) -> mla_core::StepLimits {
        mla_core::StepLimits::unlimited()
    }

    fn forks_blocks(&self) -> bool {
        self.forks
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.pending.set(plans);
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        match self.pending.take()?.as_slice() {
            [plan] => self.run(plan).map(|o| vec![o]),
            plans => bail!("one attention rank, {} plans", plans.len()),
        }
    }
}

impl HistoryBackend {
    fn run(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        // Logged before the gate, so a test parked at a step sees the tables it was built with
        // (the engine published its statistics after building it).
        {
            let mut log = self.log.lock().unwrap();
            log.steps += 1;
            log.kinds.push(plan.kind);
            log.seqs.push(plan.seqs.iter().map(|s| s.seq_id).collect());
            for s in &plan.seqs {
                log.tables.insert(s.seq_id, s.block_table.clone());
                *log.fed.entry(s.seq_id).or_default() += s.tokens.len();
            }
        }
        if let Some(gate) = &self.gate {
            gate.pass();
        }
        let bs = self.layout.block_size;
        plan.validate(bs, self.layout.num_blocks, VOCAB, self.model.max_position_embeddings)?;
        // Logged before the delay, so a test that sees a step logged knows the engine is busy
        // with it for `delay` longer.
        std::thread::sleep(self.delay);
        if let Some(p) = self.poison.filter(|p| plan.seqs.iter().any(|s| s.tokens.contains(p))) {
            bail!("poison token {p} fed");
        }
        // Forks copy whole blocks before anything is written, as the real backends do; the
        // slots past what the source holds carry their garbage (here: None, or stale tokens).
        for f in plan.seqs.iter().filter_map(|s| s.fork) {
            anyhow::ensure!(self.forks, "a fork asked of a backend that said it does not fork");
            let (from, to) = (f.from as usize * bs, f.to as usize * bs);
            self.cache.copy_within(from..from + bs, to);
            self.log.lock().unwrap().forks += 1;
        }
        // Every write lands before any read, as in a real forward pass, so two sequences
        // writing one slot in the same step corrupt each other's history visibly.
        for s in &plan.seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                self.cache[slot_of(&s.block_table, bs, s.context_len + i)] = Some(t);
            }
        }
        let mut seqs = vec![];
        for s in &plan.seqs {
            let history = (0..s.end_pos())
                .map(|p| {
                    self.cache[slot_of(&s.block_table, bs, p)]
                        .with_context(|| format!("seq {} reads unwritten position {p}", s.seq_id))
                })
                .collect::<anyhow::Result<Vec<u32>>>()?;
            let sampled = s.sample.as_ref().map(|r| sample(&logits_for(&history), r)).transpose()?;
            let all = || (s.context_len..s.end_pos()).map(|p| logits_for(&history[..=p])).collect::<Vec<_>>();
            let (logits, scores) = match s.logits {
                LogitsRequest::None => (vec![], vec![]),
                LogitsRequest::Last => (vec![logits_for(&history)], vec![]),
                LogitsRequest::All => (all(), vec![]),
                LogitsRequest::Scored { top, after } => {
                    (vec![], mla_core::sampling::score_rows(&all(), &s.tokens, top, after))
                }
            };
            seqs.push(SeqResult { seq_id: s.seq_id, logits, sampled, extra_tokens: vec![], drafts: vec![], scores });
        }
        Ok(StepOutput { seqs })
    }
}

impl StepRunner for HistoryBackend {
    type Step = Vec<StepPlan>;
    type Output = Vec<StepOutput>;

    fn run_step(&mut self, plans: &Vec<StepPlan>) -> anyhow::Result<Vec<StepOutput>> {
        self.start_step(&Arc::new(plans.clone()));
        self.finish_step()
    }
}

/// `HistoryBackend` on a `StepThread` of its own, as the CUDA backend runs: the engine starts
/// each step and collects it later (`Backend::start_step`), delivering the previous step's
/// events in between.
pub struct Threaded {
    thread: StepThread<HistoryBackend>,
    model: ModelConfig,
    layout: CacheLayout,
    /// Steps the engine started asynchronously.
    pub started: Arc<AtomicUsize>,
}

impl Threaded {
    pub fn new(b: HistoryBackend) -> Self {
        let (model, layout) = (b.model.clone(), b.layout);
        let (thread, ()) = StepThread::spawn("threaded-history-backend".into(), move || Ok((b, ()))).unwrap();
        Threaded { thread, model, layout, started: Arc::default() }
    }
}

impl Backend for Threaded {
    fn device_name(&self) -> String {
        "threaded history test backend".into()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.model
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![self.layout]
    }

    fn step_limits(&self) -> mla_core::StepLimits {
        mla_core::StepLimits::unlimited()
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.thread.start_step(plans);
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        self.thread.finish_step()
    }
}

/// What a completion should produce, computed without any cache.
pub fn reference(
    prompt: &[u32],
    completion: usize,
    params: &SamplingParams,
    seed: u64,
    max_tokens: usize,
    stop: &[u32],
    max_len: usize,
) -> Vec<u32> {
    let mut history = prompt.to_vec();
    let mut out = vec![];
    loop {
        let req = SampleRequest {
            params: params.clone(),
            seed: mla_engine::draw_seed(seed, completion, out.len()),
            top_logprobs: None,
            penalty: params.has_penalties().then(|| PenaltyTokens { prompt: prompt.to_vec(), output: out.clone() }),
            logit_bias: Vec::new(),
            allowed: None,
        };
        let t = sample(&logits_for(&history), &req).expect("no mask").token;
        out.push(t);
        history.push(t);
        if stop.contains(&t) || out.len() == max_tokens || history.len() == max_len {
            return out;
        }
    }
}

/// Events of one request, gathered until the engine closes the stream.
#[derive(Debug, Default)]
pub struct Collected {
    pub tokens: Vec<Vec<u32>>,
    pub logprobs: Vec<Vec<Option<mla_engine::TokenLogprobs>>>,
    pub finish: Vec<Option<mla_engine::FinishReason>>,
    pub error: Option<String>,
    /// `EngineEvent::Rejected`: the request's own constraint could not go on.
    pub rejected: Option<String>,
    /// The prompt tokens the prefix cache held at admission (`EngineEvent::Admitted`).
    pub cached_tokens: Option<usize>,
    /// `EngineEvent::PromptLogprobs`, which must come before any token.
    pub prompt_logprobs: Option<Vec<mla_engine::PromptTokenLogprob>>,
}

pub fn collect(stream: &mut mla_engine::RequestStream, n: usize) -> Collected {
    use mla_engine::EngineEvent;
    let mut c = Collected {
        tokens: vec![vec![]; n],
        logprobs: vec![vec![]; n],
        finish: vec![None; n],
        error: None,
        rejected: None,
        cached_tokens: None,
        prompt_logprobs: None,
    };
    // A stuck engine fails the test instead of hanging it.
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let mut next = || {
        let ev = rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), stream.events.recv()).await });
        ev.expect("no event for 20 s")
    };
    while let Some(ev) = next() {
        match ev {
            EngineEvent::Token { index, token, logprobs, finish } => {
                assert!(c.finish[index].is_none(), "token after the finish of completion {index}");
                c.tokens[index].push(token);
                c.logprobs[index].push(logprobs);
                c.finish[index] = finish;
            }
            EngineEvent::Finished { index, reason } => {
                assert!(c.finish[index].is_none(), "second finish of completion {index}");
                c.finish[index] = Some(reason);
            }
            EngineEvent::Error { message } => c.error = Some(message),
            EngineEvent::Rejected { message } => c.rejected = Some(message),
            EngineEvent::Admitted { cached_tokens } => c.cached_tokens = Some(cached_tokens),
            EngineEvent::PromptLogprobs { entries } => {
                assert!(c.tokens.iter().all(Vec::is_empty), "prompt logprobs after a token");
                assert!(c.prompt_logprobs.replace(entries).is_none(), "prompt logprobs sent twice");
            }
        }
    }
    c
}

pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn engine_config(max_model_len: usize) -> mla_engine::EngineConfig {
    mla_engine::EngineConfig {
        spec_load_rule: false,
        long_prefill_token_threshold: None,
        max_model_len,
        max_num_seqs: 8,
        max_num_batched_tokens: 16,
        max_queued_requests: 64,
        seed: 42,
        prefix_caching: true,
        mixed_steps: false,
        mtp_drafts: 0,
        spec_disable_batch: None,
        step_watchdog: std::time::Duration::from_secs(300),
        router: mla_engine::RouterConfig::default(),
    }
}

pub fn request(
    prompt: Vec<u32>,
    sampling: SamplingParams,
    seed: Option<u64>,
    max_tokens: usize,
) -> mla_engine::GenerateRequest {
    mla_engine::GenerateRequest { seed, ..mla_engine::GenerateRequest::new(prompt, sampling, max_tokens) }
}

/// Distinct prompts of lengths 3, 4, ...
pub fn prompts(count: usize) -> Vec<Vec<u32>> {
    (0..count).map(|r| (0..3 + r).map(|i| ((r * 7 + i * 3) % 60 + 1) as u32).collect()).collect()
}

/// The next event that is not `Admitted` (sent once, before a request's tokens), blocking.
pub fn next_event(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<mla_engine::EngineEvent>,
) -> Option<mla_engine::EngineEvent> {
    loop {
        match events.blocking_recv() {
            Some(mla_engine::EngineEvent::Admitted { .. }) => continue,
            other => return other,
        }
    }
}
