//! Which attention rank (a `--dp` replica, a DP-attention rank) a request goes to: the router
//! policy, and the balance rule of the prefix policy, whose two thresholds are named after
//! SGLang's router's (`--balance-abs-threshold`, `--balance-rel-threshold`).

use clap::{Args as ClapArgs, ValueEnum};
use mla_engine::{RouterConfig, RouterPolicy};

#[derive(Debug, Clone, ClapArgs)]
pub struct RoutingArgs {
    /// How requests are spread over the attention ranks of --dp or --enable-dp-attention.
    /// prefix (default with prefix caching; also cache_aware, SGLang's router's name): to the
    /// rank whose prefix cache holds the longest start of the prompt, unless the balance rule
    /// says that rank has too much work; the least loaded when none holds more than another.
    /// least-loaded (default without prefix caching): to the rank with the least work, in
    /// tokens its requests may hold.
    #[arg(long, value_enum, value_name = "POLICY")]
    pub router_policy: Option<RouterPolicyArg>,

    /// Balance rule of the prefix policy: the rank holding the prefix is passed over for the
    /// least-loaded rank when its work exceeds that rank's by more than TOKENS (tokens the
    /// requests may hold) and by more than --router-balance-rel-threshold times. Default:
    /// 32768.
    #[arg(long, value_name = "TOKENS")]
    pub router_balance_abs_threshold: Option<u64>,

    /// Balance rule of the prefix policy: the relative gap (at least 1). Default 1.5, SGLang's.
    #[arg(long, value_name = "RATIO")]
    pub router_balance_rel_threshold: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RouterPolicyArg {
    #[value(alias = "cache_aware", alias = "cache-aware")]
    Prefix,
    #[value(alias = "least_loaded")]
    LeastLoaded,
}

impl RoutingArgs {
    /// Refuses flags that would change nothing: routing on a layout of one attention rank, the
    /// prefix policy without a prefix cache, a balance rule without the prefix policy.
    pub fn check(&self, attention_ranks: usize, prefix_caching: bool) -> anyhow::Result<()> {
        let given = self.router_policy.is_some()
            || self.router_balance_abs_threshold.is_some()
            || self.router_balance_rel_threshold.is_some();
        if given && attention_ranks == 1 {
            anyhow::bail!(
                "--router-policy and its thresholds choose among attention ranks, and this layout has one; \
                 --dp N and --tp N --enable-dp-attention have several"
            );
        }
        if self.router_policy == Some(RouterPolicyArg::Prefix) && !prefix_caching {
            anyhow::bail!(
                "--router-policy prefix routes by what the prefix caches hold, and prefix caching is off; \
                 drop --no-enable-prefix-caching or use --router-policy least-loaded"
            );
        }
        let thresholds = self.router_balance_abs_threshold.is_some() || self.router_balance_rel_threshold.is_some();
        if thresholds && self.policy(prefix_caching) != RouterPolicy::Prefix {
            anyhow::bail!("--router-balance-abs-threshold and --router-balance-rel-threshold are the prefix policy's; the least-loaded policy has no balance rule");
        }
        if let Some(rel) = self.router_balance_rel_threshold.filter(|r| !(r.is_finite() && *r >= 1.0)) {
            anyhow::bail!("--router-balance-rel-threshold must be at least 1 (a ratio of loads), got {rel}");
        }
        Ok(())
    }

    fn policy(&self, prefix_caching: bool) -> RouterPolicy {
        match self.router_policy {
            Some(RouterPolicyArg::Prefix) => RouterPolicy::Prefix,
            Some(RouterPolicyArg::LeastLoaded) => RouterPolicy::LeastLoaded,
            None if prefix_caching => RouterPolicy::Prefix,
            None => RouterPolicy::LeastLoaded,
        }
    }

    pub fn config(&self, prefix_caching: bool) -> RouterConfig {
        let default = RouterConfig::default();
        RouterConfig {
            policy: self.policy(prefix_caching),
            balance_abs_tokens: self.router_balance_abs_threshold,
            balance_rel: self.router_balance_rel_threshold.unwrap_or(default.balance_rel),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        routing: RoutingArgs,
    }

    fn parse(args: &[&str]) -> RoutingArgs {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).unwrap().routing
    }

    #[test]
    fn prefix_by_default_with_prefix_caching_and_least_loaded_without() {
        assert_eq!(parse(&[]).config(true).policy, RouterPolicy::Prefix);
        assert_eq!(parse(&[]).config(false).policy, RouterPolicy::LeastLoaded);
        assert_eq!(parse(&["--router-policy", "cache_aware"]).config(true).policy, RouterPolicy::Prefix);
        assert_eq!(parse(&["--router-policy", "least-loaded"]).config(true).policy, RouterPolicy::LeastLoaded);
        let c =
            parse(&["--router-balance-abs-threshold", "4096", "--router-balance-rel-threshold", "1.2"]).config(true);
        assert_eq!((c.balance_abs_tokens, c.balance_rel), (Some(4096), 1.2));
        assert_eq!((parse(&[]).config(true).balance_abs_tokens, parse(&[]).config(true).balance_rel), (None, 1.5));
    }

    #[test]
    fn flags_that_would_change_nothing_are_refused() {
        let refused = |args: &[&str], ranks: usize, caching: bool, says: &str| {
            let e = parse(args).check(ranks, caching).unwrap_err().to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        };
        refused(&["--router-policy", "prefix"], 1, true, "this layout has one");
        refused(&["--router-balance-rel-threshold", "2"], 1, true, "this layout has one");
        refused(&["--router-policy", "prefix"], 2, false, "prefix caching is off");
        refused(
            &["--router-policy", "least-loaded", "--router-balance-abs-threshold", "9"],
            2,
            true,
            "no balance rule",
        );
        refused(&["--router-balance-abs-threshold", "9"], 2, false, "no balance rule");
        refused(&["--router-balance-rel-threshold", "0.5"], 2, true, "at least 1");
        refused(&["--router-balance-rel-threshold", "NaN"], 2, true, "at least 1");
        assert!(parse(&[]).check(1, true).is_ok());
        assert!(parse(&["--router-policy", "least-loaded"]).check(2, false).is_ok());
        assert!(parse(&["--router-balance-rel-threshold", "1"]).check(4, true).is_ok());
    }
}
