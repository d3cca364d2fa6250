//! Offline engine benchmark: the real `Engine` driving the CUDA backends of a parallel layout
//! (one GPU, replicas, tensor parallel or DP attention) with dummy weights, no HTTP. Prefill throughput of one long prompt, and decode throughput at a chosen batch and
//! context, with the host time between steps (the GPU's idle gap) from the backend's step clock.

use mla_core::{Backend, CacheLayout, Parallel, SamplingParams};
use mla_cuda::{CudaBackend, CudaOptions, StepClock, WeightsFrom};
use mla_engine::{Engine, EngineConfig, EngineEvent, EngineHandle, GenerateRequest};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct EngineArgs {
    pub parallel: Parallel,
    pub config: PathBuf,
    pub gpu_memory_utilization: f64,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub prefill_len: usize,
    pub prefill_reps: usize,
    /// (batch, context, measured decode steps)
    pub decode: Vec<(usize, usize, usize)>,
    pub graphs: bool,
    pub gemv: bool,
    pub seed: u64,
    /// `fp8`: block-FP8 linear weights (as mla-serve's --quantization).
    pub quantization: Option<String>,
    /// JSON object of config overrides (as mla-serve's --hf-overrides).
    pub hf_overrides: Option<String>,
    pub fp8_w8a8: bool,
    /// What the latent cache stores (as mla-serve's --kv-cache-dtype).
    pub kv_cache_dtype: mla_core::KvCacheDtype,
}

/// Parses `BxCTXxSTEPS` items, e.g. `1x1024x256,256x4096x64`.
pub fn parse_decode(s: &str) -> anyhow::Result<Vec<(usize, usize, usize)>> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|item| {
            let v: Vec<usize> = item
                .split('x')
                .map(|p| p.trim().parse())
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("--decode {item}: {e}"))?;
            anyhow::ensure!(
                v.len() == 3 && v.iter().all(|&x| x > 0),
                "--decode {item}: expected BATCHxCONTEXTxSTEPS, all positive"
            );
            Ok((v[0], v[1], v[2]))
        })
        .collect()
}

/// The clock of a single-GPU backend; groups keep none (zeros).
fn snapshot(c: Option<&Arc<Mutex<StepClock>>>) -> StepClock {
    c.map(|c| *c.lock().expect("the step clock is never poisoned")).unwrap_or_default()
}

fn clock_delta(a: &StepClock, b: &StepClock) -> Value {
    let steps = (b.steps - a.steps).max(1) as f64;
    let graph_steps = b.graph_steps - a.graph_steps;
    json!({
        "steps": b.steps - a.steps,
        "graph_steps": graph_steps,
        "host_between_steps_us_mean": (b.between_steps_s - a.between_steps_s) / steps * 1e6,
        "graph_prep_us_mean": if graph_steps > 0 { (b.graph_prep_s - a.graph_prep_s) / graph_steps as f64 * 1e6 } else { 0.0 },
        "in_step_ms_mean": (b.in_step_s - a.in_step_s) / steps * 1e3,
    })
}

/// A greedy request for a random prompt of `len` tokens, no stop token (also the host benchmark's).
pub(crate) fn request(rng: &mut rand::rngs::StdRng, len: usize, vocab: usize, max_tokens: usize) -> GenerateRequest {
    let prompt = (0..len).map(|_| rng.random_range(0..vocab as u32)).collect();
    GenerateRequest { seed: Some(1), ..GenerateRequest::new(prompt, SamplingParams::greedy(), max_tokens) }
}

/// One token event as seen by the benchmark: (request, arrival, last of its request).
type Arrival = (usize, Instant, bool);

/// Submits every request at once and forwards each token's arrival to one channel.
fn submit_all(
    rt: &tokio::runtime::Runtime,
    h: &EngineHandle,
    reqs: Vec<GenerateRequest>,
) -> anyhow::Result<(Instant, tokio::sync::mpsc::UnboundedReceiver<Arrival>)> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let t0 = Instant::now();
    for (i, r) in reqs.into_iter().enumerate() {
        let mut stream = h.submit(r).map_err(|e| anyhow::anyhow!("submit: {e}"))?;
        let tx = tx.clone();
        rt.spawn(async move {
            while let Some(ev) = stream.events.recv().await {
                match ev {
                    EngineEvent::Token { finish, .. } => {
                        let _ = tx.send((i, Instant::now(), finish.is_some()));
                        if finish.is_some() {
                            break;
                        }
                    }
                    EngineEvent::Finished { .. } => break,
                    EngineEvent::Admitted { .. } | EngineEvent::PromptLogprobs { .. } => {}
                    EngineEvent::Error { message } | EngineEvent::Rejected { message } => {
                        panic!("engine error: {message}")
                    }
                }
            }
        });
    }
    Ok((t0, rx))
}

fn prefill(
    rt: &tokio::runtime::Runtime,
    h: &EngineHandle,
    a: &EngineArgs,
    vocab: usize,
    rng: &mut rand::rngs::StdRng,
) -> anyhow::Result<Value> {
    anyhow::ensure!(a.prefill_reps >= 1, "--prefill-reps must be at least 1 (the prefill row is a median)");
    let mut times = vec![];
    for _ in 0..a.prefill_reps {
        let (t0, mut rx) = submit_all(rt, h, vec![request(rng, a.prefill_len, vocab, 1)])?;
        let (_, t, _) = rt.block_on(rx.recv()).ok_or_else(|| anyhow::anyhow!("no token"))?;
        times.push((t - t0).as_secs_f64());
        while rt.block_on(rx.recv()).is_some() {}
    }
    let mut sorted = times.clone();
    sorted.sort_by(|x, y| x.partial_cmp(y).unwrap());
    let median = sorted[sorted.len() / 2];
    Ok(json!({
        "prompt_tokens": a.prefill_len,
        "ttft_ms_all": times.iter().map(|t| t * 1e3).collect::<Vec<_>>(),
        "ttft_ms_median": median * 1e3,
        "tokens_per_s": a.prefill_len as f64 / median,
        "note": "submit to first sampled token through the engine: one prefill step (chunks of max_num_batched_tokens) plus scheduling",
    }))
}

fn decode_case(
    rt: &tokio::runtime::Runtime,
    h: &EngineHandle,
    clock: Option<&Arc<Mutex<StepClock>>>,
    (batch, ctx, steps): (usize, usize, usize),
    a: &EngineArgs,
    vocab: usize,
    rng: &mut rand::rngs::StdRng,
) -> anyhow::Result<Value> {
    // Prefill and decode steps alternate while prompts are prefilled, so early requests decode
    // before the last prompt is in; each asks for enough tokens that every request is still
    // decoding for `steps` steps once all are in. The window measured is [last first token,
    // first finish]: every step in it is a full decode batch of `batch` sequences.
    let prefill_steps = (batch * ctx).div_ceil(a.max_num_batched_tokens);
    let max_tokens = steps + prefill_steps + 2;
    anyhow::ensure!(
        ctx + max_tokens <= a.max_model_len,
        "context {ctx} + {max_tokens} tokens exceeds --max-model-len {}",
        a.max_model_len
    );
    check_fits(&h.cache_layouts(), h.config().max_num_seqs, batch, ctx + max_tokens)?;
    let reqs = (0..batch).map(|_| request(rng, ctx, vocab, max_tokens)).collect();
    let (t0, mut rx) = submit_all(rt, h, reqs)?;
    let mut first = vec![None::<Instant>; batch];
    let mut n_first = 0;
    let (mut start, mut end) = (None::<(Instant, StepClock)>, None::<(Instant, StepClock)>);
    let mut arrivals = Vec::with_capacity(batch * max_tokens);
    while let Some((i, t, last)) = rt.block_on(rx.recv()) {
        arrivals.push(t);
        if first[i].is_none() {
            first[i] = Some(t);
            n_first += 1;
            if n_first == batch {
                start = Some((t, snapshot(clock)));
            }
        }
        if last && end.is_none() {
            end = Some((t, snapshot(clock)));
        }
    }
    let (ts, cs) = start.ok_or_else(|| anyhow::anyhow!("not every request produced a token"))?;
    let (te, ce) = end.ok_or_else(|| anyhow::anyhow!("no request finished"))?;
    let in_window = arrivals.iter().filter(|&&t| t > ts && t <= te).count();
    let secs = (te - ts).as_secs_f64();
    // A request that finished before the last one started decoding leaves no full-batch window
    // (preemption, or a context the batch did not fit): say so rather than divide by zero.
    anyhow::ensure!(
        in_window > 0 && secs > 0.0,
        "decode B={batch} ctx={ctx}: no window where every request decoded (a request finished before the last          one's first token); raise the steps or lower the batch"
    );
    let step_clock = clock.map(|_| clock_delta(&cs, &ce));
    // Without a step clock (several GPUs), every step of the window decodes the whole batch.
    let steps_in_window = match &step_clock {
        Some(c) => c["steps"].as_u64().unwrap_or(0).max(1) as f64,
        None => (in_window as f64 / batch as f64).max(1.0),
    };
    Ok(json!({
        "batch": batch,
        "context": ctx,
        "prefill_s": (ts - t0).as_secs_f64(),
        "window_s": secs,
        "window_tokens": in_window,
        "tokens_per_s": in_window as f64 / secs,
        "step_ms": secs / steps_in_window * 1e3,
        "step_clock": step_clock,
    }))
}

/// Refuses a decode case the engine cannot hold at once: the batch spread over the attention
/// ranks (`layouts`), each sequence `len` tokens, must fit every rank's batch (`max_seqs`) and KV
/// cache (otherwise the engine preempts, and no step of the window decodes the whole batch).
fn check_fits(layouts: &[CacheLayout], max_seqs: usize, batch: usize, len: usize) -> anyhow::Result<()> {
    let per_rank = batch.div_ceil(layouts.len());
    anyhow::ensure!(
        per_rank <= max_seqs,
        "decode B={batch}: {per_rank} sequences per attention rank, above max_num_seqs {max_seqs}"
    );
    let smallest = layouts.iter().min_by_key(|l| l.num_blocks).expect("an engine has a rank");
    let need = per_rank * len.div_ceil(smallest.block_size);
    anyhow::ensure!(
        need <= smallest.num_blocks,
        "decode B={batch} over {} attention rank(s) needs {need} KV blocks of {} tokens per rank for {len} tokens \
         each, the cache holds {} ({} tokens); lower the batch or context, or raise --gpu-memory-utilization",
        layouts.len(),
        smallest.block_size,
        smallest.num_blocks,
        smallest.capacity_tokens()
    );
    Ok(())
}

pub fn run(a: &EngineArgs) -> anyhow::Result<Value> {
    let cfg = crate::dummy_model::config(&a.config, a.hf_overrides.as_deref(), a.quantization.as_deref())?;
    let fp8_weights = cfg.quantization.is_some();
    let vocab = cfg.vocab_size;
    let mut opts = CudaOptions {
        gpu_memory_utilization: a.gpu_memory_utilization,
        max_num_batched_tokens: a.max_num_batched_tokens,
        max_num_seqs: a.max_num_seqs,
        max_model_len: Some(a.max_model_len),
        fp8_w8a8: a.fp8_w8a8,
        kv_cache_dtype: a.kv_cache_dtype,
        ..CudaOptions::default()
    };
    if !a.graphs {
        opts.cuda_graph_batch_sizes.clear();
    }
    opts.small_batch_gemv = a.gemv;
    let t = Instant::now();
    let weights = WeightsFrom::DummyOnDevice { seed: a.seed };
    let (backends, clock, graph_sizes): (Vec<Box<dyn Backend>>, _, _) = if a.parallel.is_single() {
        let b = CudaBackend::new(cfg, weights, opts)?;
        let (clock, sizes) = (b.step_clock(), b.graph_batch_sizes().to_vec());
        (vec![Box::new(b)], Some(clock), sizes)
    } else {
        let watchdog = std::time::Duration::from_secs(600);
        (mla_cuda::layout::backends_for(&cfg, &weights, &opts, a.parallel, watchdog)?, None, vec![])
    };
    let startup_s = t.elapsed().as_secs_f64();
    let gpu = backends.iter().map(|b| b.device_name()).collect::<Vec<_>>().join("; ");
    let blocks: Vec<usize> = backends.iter().flat_map(|b| b.cache_layouts()).map(|l| l.num_blocks).collect();
    let h = Engine::start_replicas(
        backends,
        EngineConfig {
            spec_load_rule: false,
            long_prefill_token_threshold: None,
            max_model_len: a.max_model_len,
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: a.max_num_batched_tokens,
            max_queued_requests: 1 << 20,
            seed: a.seed,
            // The prefill measurement repeats one prompt: a cache hit would hide the compute.
            prefix_caching: false,
            mixed_steps: false,
            mtp_drafts: 0,
            spec_disable_batch: None,
            step_watchdog: std::time::Duration::from_secs(600),
            // By load, as the engine benchmark always measured (no cache to route by).
            router: mla_engine::RouterConfig {
                policy: mla_engine::RouterPolicy::LeastLoaded,
                ..mla_engine::RouterConfig::default()
            },
        },
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    // Warm-up: first launches of every kernel and cuBLAS heuristics stay out of the figures.
    let (_, mut rx) = submit_all(&rt, &h, vec![request(&mut rng, 300, vocab, 16)])?;
    while rt.block_on(rx.recv()).is_some() {}
    let pre = prefill(&rt, &h, a, vocab, &mut rng)?;
    eprintln!(
        "prefill {} tokens: {:.0} tok/s (median TTFT {:.2} ms)",
        a.prefill_len,
        pre["tokens_per_s"].as_f64().unwrap(),
        pre["ttft_ms_median"].as_f64().unwrap()
    );
    let mut dec = vec![];
    for &case in &a.decode {
        let r = decode_case(&rt, &h, clock.as_ref(), case, a, vocab, &mut rng)?;
        eprintln!(
            "decode B={} ctx={}: {:.0} tok/s, {:.3} ms/step, host between steps {:.1} us, graph steps {}",
            case.0,
            case.1,
            r["tokens_per_s"].as_f64().unwrap(),
            r["step_ms"].as_f64().unwrap(),
            r["step_clock"]["host_between_steps_us_mean"].as_f64().unwrap_or(f64::NAN),
            r["step_clock"]["graph_steps"]
        );
        dec.push(r);
    }
    h.shutdown(std::time::Duration::from_secs(5));
    let v = json!({
        "gpu": gpu,
        "model": format!("{} with dummy weights drawn on the device", a.config.display()),
        "backend_startup_s": startup_s,
        "parallel": {
            "tp": a.parallel.tp,
            "dp": a.parallel.replicas,
            "dp_attention": a.parallel.dp_attention,
            "gpus": a.parallel.devices(),
            "attention_ranks": blocks.len(),
        },
        "kv_cache_blocks_per_rank": blocks,
        "cuda_graph_batch_sizes": graph_sizes,
        "small_batch_gemv": a.gemv,
        "weights": if fp8_weights { "block-FP8 linear weights" } else { "bf16" },
        "fp8_w8a8": a.fp8_w8a8,
        "kv_cache_dtype": a.kv_cache_dtype.name(),
        "hf_overrides": a.hf_overrides,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_num_seqs": a.max_num_seqs,
        "max_model_len": a.max_model_len,
        "prefill": pre,
        "decode": dec,
    });
    Ok(v)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_decode_case_that_cannot_fit_is_refused_with_the_numbers() {
        use mla_core::CacheLayout;
        // Two ranks of 100 blocks of 64 tokens: 16 sequences of 1,000 tokens need 8 x 16 = 128
        // blocks per rank.
        let ranks = [CacheLayout { block_size: 64, num_blocks: 100 }; 2];
        let e = super::check_fits(&ranks, 256, 16, 1000).unwrap_err().to_string();
        assert!(e.contains("needs 128 KV blocks") && e.contains("holds 100"), "{e}");
        super::check_fits(&ranks, 256, 12, 1000).unwrap();
        let e = super::check_fits(&ranks, 4, 12, 100).unwrap_err().to_string();
        assert!(e.contains("6 sequences per attention rank, above max_num_seqs 4"), "{e}");
    }

    #[test]
    fn decode_cases_parse() {
        assert_eq!(super::parse_decode("1x1024x256,256x4096x64").unwrap(), vec![(1, 1024, 256), (256, 4096, 64)]);
        assert!(super::parse_decode("1x2").is_err());
        assert!(super::parse_decode("0x2x3").is_err());
    }
}
