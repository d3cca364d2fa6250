//! Speculative decoding flags in vLLM's spelling (`--speculative-config JSON`) and SGLang's
//! (`--speculative-algorithm` with `--speculative-num-steps`, `--speculative-eagle-topk`,
//! `--speculative-num-draft-tokens`). Both name the same thing for DeepSeek-V3/R1: the model's own
//! multi-token-prediction layer as the draft model, K draft tokens per step.
//!
//! The flags are read and checked in full, so a command line written for vLLM or SGLang gets an
//! exact answer. Speculative decoding runs on the CPU backend or one GPU per replica so far;
//! elsewhere it is refused with the reason (`backends::load`), never accepted and ignored.

use clap::Args as ClapArgs;

#[derive(Debug, Clone, Default, ClapArgs)]
pub struct SpeculativeArgs {
    /// vLLM's speculative decoding config, e.g. '{"method": "mtp", "num_speculative_tokens": 1}':
    /// the model's MTP layer drafts that many tokens per step; "disable_by_batch_size": N pauses
    /// drafting while N or more sequences run.
    #[arg(long, value_name = "JSON")]
    pub speculative_config: Option<String>,

    /// SGLang's speculative algorithm (EAGLE or NEXTN: the model's MTP layer for DeepSeek), with
    /// --speculative-num-steps drafts per step.
    #[arg(long, value_name = "NAME")]
    pub speculative_algorithm: Option<String>,

    /// SGLang: draft steps per verify step (with --speculative-algorithm).
    #[arg(long, value_name = "N")]
    pub speculative_num_steps: Option<usize>,

    /// SGLang: drafts kept per step (with --speculative-algorithm); only 1, a chain, is planned.
    #[arg(long, value_name = "N")]
    pub speculative_eagle_topk: Option<usize>,

    /// SGLang: tokens per verify step, the drafts plus one (with --speculative-algorithm).
    #[arg(long, value_name = "N")]
    pub speculative_num_draft_tokens: Option<usize>,

    /// How drafting follows the load (this server's own): `measured` (the default) drafts at a
    /// batch size only while drafting has measured faster there, on this model and machine;
    /// `off` drafts at every batch size, as vLLM and SGLang do (up to disable_by_batch_size).
    #[arg(long, value_enum, value_name = "RULE")]
    pub speculative_load_rule: Option<LoadRule>,
}

/// `--speculative-load-rule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadRule {
    Measured,
    Off,
}

/// What the flags ask for, once read: MTP drafting `draft_tokens` tokens per step, paused while
/// `disable_by_batch_size` or more sequences run, and at batch sizes where it measured slower
/// unless `measured_rule` is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeRequest {
    pub draft_tokens: usize,
    pub disable_by_batch_size: Option<usize>,
    pub measured_rule: bool,
}

impl SpeculativeArgs {
    /// Reads the flags: `None` without any, an error naming the flag for anything malformed or
    /// that is not the model's MTP layer.
    pub fn request(&self) -> anyhow::Result<Option<SpeculativeRequest>> {
        let request = self.drafting()?;
        if request.is_none() && self.speculative_load_rule.is_some() {
            anyhow::bail!("--speculative-load-rule belongs with --speculative-config or --speculative-algorithm");
        }
        let measured_rule = self.speculative_load_rule != Some(LoadRule::Off);
        Ok(request.map(|r| SpeculativeRequest { measured_rule, ..r }))
    }

    /// The drafting the vLLM or SGLang flags ask for.
    fn drafting(&self) -> anyhow::Result<Option<SpeculativeRequest>> {
        match (&self.speculative_config, &self.speculative_algorithm) {
            (Some(_), Some(_)) => anyhow::bail!(
                "--speculative-config (vLLM) and --speculative-algorithm (SGLang) say the same thing; give one"
            ),
            (Some(json), None) => {
                self.no_sglang_details("--speculative-config")?;
                vllm_config(json).map(Some)
            }
            (None, Some(name)) => self.sglang(name).map(Some),
            (None, None) => {
                self.no_sglang_details("no --speculative-algorithm")?;
                Ok(None)
            }
        }
    }

    /// Checks the flags before anything loads; where they can run is checked once the device
    /// and the model are known (`backends::load`).
    pub fn check(&self) -> anyhow::Result<()> {
        self.request().map(|_| ())
    }

    fn no_sglang_details(&self, context: &str) -> anyhow::Result<()> {
        for (flag, v) in [
            ("--speculative-num-steps", self.speculative_num_steps),
            ("--speculative-eagle-topk", self.speculative_eagle_topk),
            ("--speculative-num-draft-tokens", self.speculative_num_draft_tokens),
        ] {
            if v.is_some() {
                anyhow::bail!("{flag} belongs with --speculative-algorithm ({context})");
            }
        }
        Ok(())
    }

    /// SGLang: EAGLE and NEXTN both run DeepSeek's MTP layer; steps and draft tokens must agree
    /// (a chain of `steps` drafts is verified as `steps + 1` tokens).
    fn sglang(&self, name: &str) -> anyhow::Result<SpeculativeRequest> {
        if !["EAGLE", "NEXTN"].contains(&name.to_ascii_uppercase().as_str()) {
            anyhow::bail!(
                "--speculative-algorithm {name}: only EAGLE or NEXTN (the model's own MTP layer) are meant for DeepSeek models"
            );
        }
        if let Some(k) = self.speculative_eagle_topk.filter(|&k| k != 1) {
            anyhow::bail!("--speculative-eagle-topk {k}: only 1 (a chain of drafts, no tree) is planned");
        }
        let steps = self.speculative_num_steps;
        let draft = self.speculative_num_draft_tokens;
        let k = match (steps, draft) {
            (Some(s), Some(d)) if d != s + 1 => anyhow::bail!(
                "--speculative-num-draft-tokens {d} with --speculative-num-steps {s}: a chain of {s} drafts verifies {} tokens",
                s + 1
            ),
            (Some(s), _) => s,
            (None, Some(d)) => d.saturating_sub(1),
            // SGLang's own default for DeepSeek.
            (None, None) => 3,
        };
        if k == 0 {
            anyhow::bail!("--speculative-num-steps must be at least 1 (--speculative-num-draft-tokens at least 2)");
        }
        Ok(SpeculativeRequest { draft_tokens: k, disable_by_batch_size: None, measured_rule: true })
    }
}

/// vLLM: `{"method": "mtp" | "deepseek_mtp", "num_speculative_tokens": K}`; other keys vLLM
/// knows (a draft model, n-gram lookup, ...) are not MTP and are refused by name.
fn vllm_config(json: &str) -> anyhow::Result<SpeculativeRequest> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| {
        anyhow::anyhow!(
            "--speculative-config: not JSON ({e}); e.g. '{{\"method\": \"mtp\", \"num_speculative_tokens\": 1}}'"
        )
    })?;
    let obj = v.as_object().ok_or_else(|| anyhow::anyhow!("--speculative-config: a JSON object is expected"))?;
    const KEYS: [&str; 3] = ["method", "num_speculative_tokens", "disable_by_batch_size"];
    for key in obj.keys() {
        if !KEYS.contains(&key.as_str()) {
            anyhow::bail!("--speculative-config: `{key}` is not supported (only {})", KEYS.join(", "));
        }
    }
    let disable_by_batch_size = match obj.get("disable_by_batch_size") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => match v.as_u64().filter(|&n| n >= 1) {
            Some(n) => Some(n as usize),
            None => anyhow::bail!("--speculative-config: disable_by_batch_size must be a whole number of at least 1"),
        },
    };
    match obj.get("method").and_then(|m| m.as_str()) {
        Some("mtp" | "deepseek_mtp") => {}
        Some(m) => {
            anyhow::bail!("--speculative-config: method `{m}` is not supported; only `mtp` (the model's own MTP layer)")
        }
        None => anyhow::bail!("--speculative-config: `method` is missing (\"mtp\")"),
    }
    let k = obj.get("num_speculative_tokens").map(|k| k.as_u64().filter(|&k| k >= 1));
    match k {
        Some(Some(k)) => {
            Ok(SpeculativeRequest { draft_tokens: k as usize, disable_by_batch_size, measured_rule: true })
        }
        Some(None) => {
            anyhow::bail!("--speculative-config: num_speculative_tokens must be a whole number of at least 1")
        }
        None => anyhow::bail!("--speculative-config: num_speculative_tokens is missing"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        spec: SpeculativeArgs,
    }

    fn read(args: &[&str]) -> anyhow::Result<Option<SpeculativeRequest>> {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).unwrap().spec.request()
    }

    fn k(n: usize) -> Option<SpeculativeRequest> {
        Some(SpeculativeRequest { draft_tokens: n, disable_by_batch_size: None, measured_rule: true })
    }

    #[test]
    fn vllm_and_sglang_spellings_read_the_same_request() {
        assert_eq!(read(&[]).unwrap(), None);
        assert_eq!(read(&["--speculative-config", r#"{"method": "mtp", "num_speculative_tokens": 1}"#]).unwrap(), k(1));
        assert_eq!(
            read(&["--speculative-config", r#"{"method":"deepseek_mtp","num_speculative_tokens":3}"#]).unwrap(),
            k(3)
        );
        assert_eq!(read(&["--speculative-algorithm", "EAGLE"]).unwrap(), k(3), "SGLang's DeepSeek default");
        assert_eq!(
            read(&[
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-num-steps",
                "1",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "2"
            ])
            .unwrap(),
            k(1)
        );
        assert_eq!(read(&["--speculative-algorithm", "eagle", "--speculative-num-draft-tokens", "3"]).unwrap(), k(2));
        let paused = r#"{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}"#;
        assert_eq!(
            read(&["--speculative-config", paused]).unwrap(),
            Some(SpeculativeRequest { draft_tokens: 2, disable_by_batch_size: Some(64), measured_rule: true })
        );
        let one = r#"{"method": "mtp", "num_speculative_tokens": 1}"#;
        assert_eq!(
            read(&["--speculative-config", one, "--speculative-load-rule", "off"]).unwrap(),
            Some(SpeculativeRequest { draft_tokens: 1, disable_by_batch_size: None, measured_rule: false })
        );
        assert_eq!(read(&["--speculative-config", one, "--speculative-load-rule", "measured"]).unwrap(), k(1));
        let alone = read(&["--speculative-load-rule", "off"]).unwrap_err().to_string();
        assert!(alone.contains("belongs with --speculative-config"), "{alone}");
    }

    #[test]
    fn malformed_or_other_methods_are_refused_by_name() {
        let err = |args: &[&str], says: &str| {
            let e = read(args).unwrap_err().to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        };
        err(&["--speculative-config", "mtp"], "not JSON");
        err(&["--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 2}"#], "method `ngram`");
        err(&["--speculative-config", r#"{"method": "mtp"}"#], "num_speculative_tokens is missing");
        err(&["--speculative-config", r#"{"method": "mtp", "num_speculative_tokens": 0}"#], "at least 1");
        err(&["--speculative-config", r#"{"method": "mtp", "num_speculative_tokens": 1, "model": "x"}"#], "`model`");
        let zero = r#"{"method": "mtp", "num_speculative_tokens": 1, "disable_by_batch_size": 0}"#;
        err(&["--speculative-config", zero], "disable_by_batch_size must be");
        err(&["--speculative-algorithm", "MEDUSA"], "EAGLE or NEXTN");
        err(&["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"], "only 1");
        err(
            &[
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "3",
            ],
            "verifies 4 tokens",
        );
        err(&["--speculative-num-steps", "2"], "belongs with --speculative-algorithm");
        err(
            &[
                "--speculative-config",
                r#"{"method": "mtp", "num_speculative_tokens": 1}"#,
                "--speculative-algorithm",
                "EAGLE",
            ],
            "give one",
        );
    }
}
