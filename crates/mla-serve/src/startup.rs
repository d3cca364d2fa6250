//! Everything done once before serving: resolve the model, load tokenizer and weights, size the
//! KV cache, start the engine, and describe it all in the startup log.

use crate::backends;
use crate::cli::{Args, Device};
use crate::model_source::{self, ModelSource};
use crate::sizing::Sizing;
use anyhow::Context;
use mla_core::{ModelSpec, Parallel};
use mla_engine::{Engine, EngineConfig, EngineHandle};
use mla_server::generation_config::GenerationDefaults;
use mla_server::metrics::MetricsConfig;
use mla_server::state::AppState;
use mla_server::structured::Grammars;
use mla_server::text::TextPipeline;
use mla_server::tokenizer::TextTokenizer;
use mla_server::validate::ModelLimits;
use std::sync::Arc;

pub struct Started {
    pub state: Arc<AppState>,
    pub engine: EngineHandle,
}

pub fn start(args: &Args) -> anyhow::Result<Started> {
    let device = args.check_supported()?;
    let parsers = args.parsers()?;
    let source = model_source::resolve(args)?;
    for w in &source.warnings {
        tracing::warn!("{w}");
    }
    if let Some(overrides) = &args.hf_overrides {
        tracing::info!(
            "model config overridden by --hf-overrides {overrides}: {} layers, {} routed experts",
            source.config.num_hidden_layers,
            source.config.n_routed_experts
        );
    }
    let text = Arc::new(load_text(args, &source)?);
    let defaults = match &source.generation_config_dir {
        Some(dir) => GenerationDefaults::from_model_dir(dir)?,
        None => GenerationDefaults::default(),
    };
    // The structured-output tables (a trie of the vocabulary, llguidance's token slices) take
    // about a second for a 128k vocabulary: built on their own thread while the weights load.
    let grammars = {
        let (text, vocab, eos) = (text.clone(), source.config.vocab_size, eos_ids(&source, &text, &defaults));
        std::thread::Builder::new()
            .name("grammars".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let g = Grammars::new(text, vocab, &eos);
                (g, started.elapsed())
            })
            .context("starting the structured-output thread")?
    };
    let params = ModelSpec::new(&source.config).num_params();
    let parallel = args.parallel()?;
    let device = backends::resolve_device(device, &source.config, args)?;
    args.check_dtype(device == Device::Cuda)?;
    let backends::Loaded { backends, sizing } = backends::load(device, &source, args, parallel)?;
    let limits = ModelLimits {
        max_logprobs: args.compat.max_logprobs(source.config.vocab_size),
        ..model_limits(&source, &text, &defaults, &sizing)
    };
    let metrics = metrics_config(args, device, &sizing);
    if device == Device::Cuda && limits.max_logprobs > mla_server::validate::MAX_LOGPROBS {
        anyhow::bail!(
            "--max-logprobs {}: the CUDA sampler returns at most {} alternatives per token",
            args.compat.max_logprobs,
            mla_server::validate::MAX_LOGPROBS
        );
    }
    let devices: Vec<String> = backends.iter().map(|b| b.device_name()).collect();
    let spec = args.speculative.request()?;
    let mtp_drafts = spec.map_or(0, |r| r.draft_tokens);
    let spec_disable_batch = spec.and_then(|r| r.disable_by_batch_size);
    if mtp_drafts > 0 {
        let mut pause = spec_disable_batch
            .map_or(String::new(), |n| format!("; paused while {n} or more sequences run (disable_by_batch_size)"));
        if spec.is_some_and(|r| r.measured_rule) {
            pause.push_str(
                "; at each batch size only while it measures faster there (--speculative-load-rule measured)",
            );
        }
        // Drafts of sampled draws are verified by rejection sampling where the backend can.
        let draws = match backends.iter().all(|b| b.verifies_sampled_drafts()) {
            true => "greedy and sampled requests",
            false => "greedy requests (sampled ones: a backend here does not verify them)",
        };
        // Penalties, logit_bias and a grammar's mask shape each verify row by the drafts before
        // it where the backend can.
        let (without, others) = match backends.iter().all(|b| b.verifies_shaped_drafts()) {
            true => ("", ""),
            false => (" without penalties, logit_bias or a grammar", "; others decode one token per step"),
        };
        tracing::info!(
            "speculative decoding: the MTP layer drafts {mtp_drafts} token(s) per step for {draws}{without}{others}{pause}"
        );
    }
    let engine = Engine::start_replicas(
        backends,
        EngineConfig {
            long_prefill_token_threshold: args.long_prefill_token_threshold(),
            max_model_len: sizing.max_model_len,
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens(),
            max_queued_requests: args.max_queued_requests,
            seed: args.seed,
            prefix_caching: !args.no_enable_prefix_caching,
            mixed_steps: !args.no_enable_mixed_chunk,
            mtp_drafts,
            spec_disable_batch,
            spec_load_rule: spec.is_some_and(|r| r.measured_rule),
            step_watchdog: args.watchdog(),
            router: args.routing.config(!args.no_enable_prefix_caching),
        },
    )?;

    let (model_name, model_aliases) = args.served_names(&source.name);
    tracing::info!(
        "model: {model_name} from {} ({:?}, {} parameters)",
        source.origin,
        source.config.model_type,
        human(params)
    );
    for (i, d) in devices.iter().enumerate() {
        match devices.len() {
            1 => tracing::info!("device: {d}"),
            _ => tracing::info!("replica {i}: {d}"),
        }
    }
    tracing::info!("parallel layout: {}", describe(&parallel));
    // What one step may hold, after the layout and the memory planner (`StepLimits`).
    let (_, notes) = args.step_limits(&parallel)?;
    for note in notes {
        tracing::info!("{note}");
    }
    let cfg = engine.config();
    tracing::info!(
        "steps: at most {} tokens and {} sequences per attention rank{}",
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        if parallel.dp_attention {
            format!(", the FFN over the {} ranks' rows together", parallel.tp)
        } else {
            String::new()
        }
    );
    let ranks = engine.cache_layouts();
    let total: usize = ranks.iter().map(|l| l.capacity_tokens()).sum();
    tracing::info!(
        "KV cache: {} tokens per attention rank ({} blocks of {}, {:.1} MiB, {} bytes per token in {}) x {} rank(s) = {total} tokens; max model length {} tokens",
        sizing.kv_tokens(),
        sizing.num_blocks,
        sizing.block_size,
        sizing.kv_bytes() as f64 / (1 << 20) as f64,
        sizing.bytes_per_token,
        args.kv_cache_dtype().map(|d| d.name()).unwrap_or("auto"),
        ranks.len(),
        sizing.max_model_len
    );
    let hidden = parsers.hidden_markers(text.tokenizer());
    if !hidden.is_empty() {
        tracing::warn!(
            "the tokenizer drops {} when it skips special tokens: replies will not be parsed there (requests need skip_special_tokens: false)",
            hidden.join(" ")
        );
    }
    let grammars = match grammars.join() {
        Ok((Ok(g), took)) => {
            tracing::info!("structured output: grammar tables for {} tokens built in {took:.2?}", limits.vocab_size);
            Some(Arc::new(g))
        }
        Ok((Err(e), _)) => {
            tracing::warn!("structured output is unavailable: {e:#}");
            None
        }
        Err(_) => anyhow::bail!("building the structured-output tables panicked"),
    };
    let state = AppState {
        engine: engine.clone(),
        model_name,
        model_aliases,
        model_root: source.name.clone(),
        limits,
        defaults,
        text,
        parsers,
        api_key: args.api_key.clone(),
        started: mla_server::protocol::unix_now(),
        grammars,
        metrics,
        force_include_usage: args.compat.enable_force_include_usage,
        return_tokens_as_token_ids: args.compat.return_tokens_as_token_ids,
        connections: Default::default(),
    };
    Ok(Started { state: Arc::new(state), engine })
}

/// A node other than 0: resolves the model as node 0 does and serves this node's ranks.
pub fn serve_for_node0(args: &Args) -> anyhow::Result<()> {
    let device = args.check_supported()?;
    let source = model_source::resolve(args)?;
    let parallel = args.parallel()?;
    let device = backends::resolve_device(device, &source.config, args)?;
    args.check_dtype(device == Device::Cuda)?;
    backends::serve_for_node0(device, &source, args, parallel)?;
    tracing::info!("node 0 stopped the group; exiting");
    Ok(())
}

fn load_text(args: &Args, source: &ModelSource) -> anyhow::Result<TextPipeline> {
    let tokenizer = TextTokenizer::from_dir(&source.tokenizer_dir)?;
    let vocab = source.config.vocab_size;
    if tokenizer.vocab_size() > vocab {
        anyhow::bail!(
            "the tokenizer in {} has {} tokens but the model's vocab_size is {vocab}: they do not belong together",
            source.tokenizer_dir.display(),
            tokenizer.vocab_size()
        );
    }
    let template = args.chat_template.as_deref().map(chat_template_source).transpose()?;
    let text = TextPipeline::new(tokenizer, template).context("compiling the chat template")?;
    if !text.has_chat_template() {
        tracing::warn!("the model has no chat template: /v1/chat/completions answers 400 (pass --chat-template FILE)");
    }
    Ok(text)
}

/// `--chat-template`: a file's contents, or the value itself when it is a template (vLLM's
/// rule: no such file, and Jinja syntax in it).
fn chat_template_source(value: &str) -> anyhow::Result<String> {
    let path = std::path::Path::new(value);
    if path.is_file() {
        return std::fs::read_to_string(path).with_context(|| format!("--chat-template {value}"));
    }
    if value.contains("{{") || value.contains("{%") {
        return Ok(value.to_string());
    }
    anyhow::bail!("--chat-template {value}: no such file, and not a Jinja template (no {{{{ or {{%) either")
}

fn model_limits(
    source: &ModelSource,
    text: &TextPipeline,
    defaults: &GenerationDefaults,
    sizing: &Sizing,
) -> ModelLimits {
    ModelLimits {
        max_model_len: sizing.max_model_len,
        vocab_size: source.config.vocab_size,
        eos_token_ids: eos_ids(source, text, defaults),
        default_max_new_tokens: defaults.max_new_tokens,
        max_logprobs: mla_server::validate::MAX_LOGPROBS,
    }
}

/// The `/metrics` prefix, and vLLM's `cache_config_info` labels with this server's values (the
/// cache of one attention rank; vLLM calls device blocks `num_gpu_blocks` on any device).
fn metrics_config(args: &Args, device: Device, sizing: &Sizing) -> MetricsConfig {
    let python_bool = |b: bool| if b { "True" } else { "False" }.to_string();
    let utilization = match device {
        Device::Cuda => {
            args.gpu_memory_utilization.unwrap_or(mla_cuda::CudaOptions::default().gpu_memory_utilization).to_string()
        }
        _ => "None".to_string(),
    };
    MetricsConfig {
        prefix: args.compat.metrics_prefix.clone(),
        cache_info: vec![
            ("block_size", sizing.block_size.to_string()),
            ("cache_dtype", args.kv_cache_dtype.clone()),
            ("enable_prefix_caching", python_bool(!args.no_enable_prefix_caching)),
            ("gpu_memory_utilization", utilization),
            ("num_gpu_blocks", sizing.num_blocks.to_string()),
            ("num_cpu_blocks", "None".to_string()),
            ("kv_cache_size_tokens", sizing.kv_tokens().to_string()),
            // Requests of --max-model-len tokens the cache holds at once (Python's float text).
            ("kv_cache_max_concurrency", format!("{:?}", sizing.kv_tokens() as f64 / sizing.max_model_len as f64)),
        ],
    }
}

/// End-of-sequence ids from every place a model declares them; any of them ends a completion.
fn eos_ids(source: &ModelSource, text: &TextPipeline, defaults: &GenerationDefaults) -> Vec<u32> {
    let mut eos = source.config.eos_token_ids.clone();
    eos.extend(&defaults.eos_token_ids);
    eos.extend(text.tokenizer().eos().map(|t| t.id));
    eos.sort_unstable();
    eos.dedup();
    eos
}

/// The layout as the flags that give it, for the startup log.
fn describe(p: &Parallel) -> String {
    match (p.tp, p.dp_attention, p.replicas) {
        (1, _, 1) => "one device".into(),
        (tp, true, _) => format!("--tp {tp} --enable-dp-attention ({tp} ranks, attention data parallel, FFN sharded)"),
        (1, false, dp) => format!("--dp {dp} ({dp} replicas)"),
        (tp, false, 1) => format!("--tp {tp} ({tp} ranks, tensor parallel)"),
        (tp, false, dp) => format!("--tp {tp} --dp {dp} ({dp} replicas of {tp} tensor-parallel ranks)"),
    }
}

/// 15.7B, 236M, 1.2K: how parameter counts are usually quoted.
fn human(n: usize) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e9 => format!("{:.1}B", n / 1e9),
        n if n >= 1e6 => format!("{:.1}M", n / 1e6),
        n if n >= 1e3 => format!("{:.1}K", n / 1e3),
        n => format!("{n}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parameter_counts_read_like_model_cards() {
        assert_eq!(super::human(15_706_484_224), "15.7B");
        assert_eq!(super::human(236_000_000), "236.0M");
        assert_eq!(super::human(999), "999");
    }
}
