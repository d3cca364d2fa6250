//! Flags common in vLLM command lines, each with its meaning here, and the metrics prefix that
//! lets vLLM's dashboards read this server unchanged.

use clap::Args as ClapArgs;

#[derive(Debug, Clone, ClapArgs)]
pub struct CompatArgs {
    /// Runs every decode step eagerly, capturing no CUDA graphs (vLLM's flag; on the CPU there
    /// are none to turn off).
    #[arg(long)]
    pub enforce_eager: bool,

    /// Accepted for vLLM command lines: chunked prefill is always on here (prompts longer than
    /// --max-num-batched-tokens are prefilled in chunks, between decode steps).
    #[arg(long, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,

    /// Refused: chunked prefill cannot be turned off.
    #[arg(long, overrides_with = "enable_chunked_prefill")]
    pub no_enable_chunked_prefill: bool,

    /// Every streamed response carries the usage, on every chunk, as if the request had sent
    /// `stream_options: {"include_usage": true, "continuous_usage_stats": true}` (vLLM's flag).
    #[arg(long)]
    pub enable_force_include_usage: bool,

    /// Logprob tokens are named `token_id:<id>` unless a request says otherwise (the default of
    /// `return_tokens_as_token_ids`; vLLM's flag).
    #[arg(long)]
    pub return_tokens_as_token_ids: bool,

    /// Accepted for vLLM command lines: `usage.prompt_tokens_details` (the prompt tokens the
    /// prefix cache held) is always sent here.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,

    /// Most logprob alternatives a request may ask for (`logprobs`, `top_logprobs`,
    /// `prompt_logprobs`); -1: the whole vocabulary. vLLM's flag and default.
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_name = "N")]
    pub max_logprobs: i64,

    /// The prefix of every /metrics series: `mla` (`mla:num_requests_running`), or `vllm` for
    /// dashboards and alerts written for vLLM, which then work unchanged.
    #[arg(long, default_value = "mla", value_name = "PREFIX")]
    pub metrics_prefix: String,
}

impl CompatArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.no_enable_chunked_prefill {
            anyhow::bail!(
                "--no-enable-chunked-prefill: chunked prefill cannot be turned off (long prompts are always prefilled in chunks of --max-num-batched-tokens)"
            );
        }
        if self.max_logprobs < -1 {
            anyhow::bail!("--max-logprobs must be -1 (the whole vocabulary) or at least 0, got {}", self.max_logprobs);
        }
        let valid = |c: char| c.is_ascii_alphanumeric() || c == '_';
        if self.metrics_prefix.is_empty()
            || !self.metrics_prefix.chars().all(valid)
            || self.metrics_prefix.starts_with(|c: char| c.is_ascii_digit())
        {
            anyhow::bail!(
                "--metrics-prefix {:?}: a Prometheus name part (letters, digits and _, not starting with a digit), e.g. mla or vllm",
                self.metrics_prefix
            );
        }
        Ok(())
    }

    /// `--max-logprobs` for a vocabulary of `vocab_size` tokens.
    pub fn max_logprobs(&self, vocab_size: usize) -> usize {
        usize::try_from(self.max_logprobs).unwrap_or(vocab_size)
    }

    /// Logs what the accepted-for-compatibility flags do.
    pub fn explain(&self) {
        if self.enable_chunked_prefill {
            tracing::info!("--enable-chunked-prefill: chunked prefill is always on");
        }
        if self.enable_prompt_tokens_details {
            tracing::info!("--enable-prompt-tokens-details: usage.prompt_tokens_details is always sent");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::{normalize, Args};
    use clap::Parser;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(normalize(std::iter::once("mla-serve").chain(args.iter().copied()))).unwrap()
    }

    #[test]
    fn defaults_are_vllms() {
        let a = parse(&[]);
        assert_eq!((a.compat.max_logprobs(512), a.compat.metrics_prefix.as_str()), (20, "mla"));
        assert!(a.compat.check().is_ok());
        assert_eq!(parse(&["--max-logprobs", "-1"]).compat.max_logprobs(512), 512);
    }

    #[test]
    fn refusals_say_why() {
        for (args, needle) in [
            (&["--no-enable-chunked-prefill"][..], "cannot be turned off"),
            (&["--max-logprobs", "-2"][..], "--max-logprobs"),
            (&["--metrics-prefix", "vllm:"][..], "--metrics-prefix"),
            (&["--metrics-prefix", "9x"][..], "--metrics-prefix"),
        ] {
            let err = parse(args).compat.check().unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
        assert!(parse(&["--enforce-eager", "--enable-chunked-prefill", "--metrics-prefix", "vllm"])
            .compat
            .check()
            .is_ok());
    }

    #[test]
    fn a_repeated_flag_takes_its_last_value_as_in_vllm() {
        let a = parse(&[
            "--enable-chunked-prefill",
            "--max-logprobs",
            "5",
            "--enable-chunked-prefill",
            "--max-logprobs",
            "7",
        ]);
        assert!(a.compat.enable_chunked_prefill);
        assert_eq!(a.compat.max_logprobs(512), 7);
    }
}
