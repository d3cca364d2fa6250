//! KV cache size and context length for the CPU backend, from the flags and the model config.

use crate::cli::Args;
use anyhow::bail;
use mla_core::ModelConfig;

/// Default CPU KV budget: enough for real work on a laptop without surprising anyone's RAM.
const DEFAULT_CPU_KV_BYTES: usize = 1 << 30;
/// ... but no more than this many full contexts (the demo's tiny cache would otherwise be huge).
const DEFAULT_CONTEXTS: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_model_len: usize,
    pub bytes_per_token: usize,
}

impl Sizing {
    pub fn kv_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv_tokens() * self.bytes_per_token
    }
}

/// The CPU cache stores `[c_kv ; k_pe]` for every layer, in f32 or as FP8 rows.
pub fn cpu_sizing(cfg: &ModelConfig, args: &Args) -> anyhow::Result<Sizing> {
    let row = mla_cpu::kv_cache::bytes_per_row(args.kv_cache_dtype()?, cfg.kv_cache_dim());
    let bytes_per_token = cfg.num_hidden_layers * row;
    let max_pos = cfg.max_position_embeddings;
    if let Some(m) = args.max_model_len {
        if m > max_pos {
            bail!("--max-model-len {m} exceeds the model's max_position_embeddings ({max_pos})");
        }
    }
    let context = args.max_model_len.unwrap_or(max_pos);
    let kv_tokens = args
        .kv_cache_tokens
        .unwrap_or_else(|| (DEFAULT_CPU_KV_BYTES / bytes_per_token).min(DEFAULT_CONTEXTS * context).max(1));
    let block_size = args.block_size;
    let num_blocks = kv_tokens.div_ceil(block_size);
    let capacity = num_blocks * block_size;
    let max_model_len = match args.max_model_len {
        Some(m) if m > capacity => bail!(
            "--max-model-len {m} does not fit the KV cache of {capacity} tokens; raise --kv-cache-tokens or lower --max-model-len"
        ),
        Some(m) => m,
        None => max_pos.min(capacity),
    };
    Ok(Sizing { num_blocks, block_size, max_model_len, bytes_per_token })
}

/// Refuses to start a model the machine cannot hold: the CPU backend keeps every weight in f32
/// plus `caches` KV caches (one per rank), and running out of memory halfway through loading
/// helps nobody. `params` counts every rank's weights.
pub fn check_cpu_memory(params: usize, caches: usize, sizing: &Sizing) -> anyhow::Result<()> {
    let need = params * std::mem::size_of::<f32>() + caches * sizing.kv_bytes();
    if let Some(available) = mem_available() {
        if need > available {
            bail!(
                "the CPU backend needs {:.1} GiB (f32 weights {:.1} GiB + {caches} KV cache(s) of {:.1} GiB) but only {:.1} GiB of memory is available; \
                 choose a smaller model or layout, or lower --kv-cache-tokens",
                gib(need),
                gib(params * 4),
                gib(sizing.kv_bytes()),
                gib(available)
            );
        }
    }
    Ok(())
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `MemAvailable` from /proc/meminfo; `None` where that does not exist (the check is skipped).
fn mem_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    const DEMO: &str = include_str!("../../../assets/demo/config.json");

    fn sizing(flags: &[&str]) -> anyhow::Result<Sizing> {
        let args = Args::try_parse_from(std::iter::once("mla-serve").chain(flags.iter().copied())).unwrap();
        cpu_sizing(&ModelConfig::from_json_str(DEMO, "demo").unwrap(), &args)
    }

    #[test]
    fn demo_defaults() {
        // 2 layers x (64 + 16) values x 4 bytes = 640 bytes per token; 32 contexts of 4096.
        let s = sizing(&[]).unwrap();
        assert_eq!(s.bytes_per_token, 640);
        assert_eq!(s.kv_tokens(), 32 * 4096);
        assert_eq!(s.max_model_len, 4096);
        // FP8 rows: 80 codes + 2 exponents, padded to 96 bytes; 1 GiB would hold more than 32
        // contexts either way.
        let s = sizing(&["--kv-cache-dtype", "fp8"]).unwrap();
        assert_eq!(s.bytes_per_token, 2 * 96);
        assert_eq!(s.kv_tokens(), 32 * 4096);
    }

    #[test]
    fn flags_round_to_blocks_and_are_checked() {
        let s = sizing(&["--kv-cache-tokens", "1000", "--block-size", "16"]).unwrap();
        assert_eq!((s.num_blocks, s.kv_tokens(), s.max_model_len), (63, 1008, 1008));
        assert!(sizing(&["--max-model-len", "5000"]).unwrap_err().to_string().contains("max_position_embeddings"));
        assert!(sizing(&["--max-model-len", "2048", "--kv-cache-tokens", "1024"])
            .unwrap_err()
            .to_string()
            .contains("--kv-cache-tokens"));
    }

    #[test]
    fn absurd_models_are_refused_before_loading() {
        let s = sizing(&[]).unwrap();
        assert!(check_cpu_memory(1000, 1, &s).is_ok());
        if mem_available().is_some() {
            let err = check_cpu_memory(usize::MAX / 8, 1, &s).unwrap_err().to_string();
            assert!(err.contains("GiB"), "{err}");
        }
    }
}
