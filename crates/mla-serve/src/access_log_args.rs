//! The flags of the access log (one line per HTTP request, see `mla_server::access_log`),
//! spelled as vLLM spells them.
//!
//! In vLLM the access log is uvicorn's and is on by default, while `--disable-log-requests`
//! (deprecated there for `--enable-log-requests`, off by default) governs separate lines that
//! print each request's prompt and parameters. mla-serve never logs request contents, so that
//! flag has nothing to turn off; it is accepted for pasted command lines and says so.

use clap::Args as ClapArgs;
use mla_server::access_log::AccessLogConfig;

#[derive(Debug, Clone, ClapArgs)]
pub struct AccessLogArgs {
    /// Moves the access log (one line per request: status, tokens, latency) to debug level.
    /// vLLM's spelling; there is no uvicorn here.
    #[arg(long = "disable-uvicorn-access-log", visible_alias = "disable-access-log")]
    pub disable_access_log: bool,

    /// Comma-separated paths whose access lines go to debug level only, e.g. "/health,/metrics"
    /// (the default: probes and scrapes would flood the log). vLLM's flag, where nothing is
    /// left out by default; "" logs every path.
    #[arg(long, default_value = "/health,/metrics", value_name = "PATHS")]
    pub disable_access_log_for_endpoints: String,

    /// Accepted for vLLM command lines: vLLM's request log prints prompts and parameters, which
    /// mla-serve never logs; the access log is not affected.
    #[arg(long)]
    pub disable_log_requests: bool,
}

impl AccessLogArgs {
    pub fn config(&self) -> AccessLogConfig {
        let quiet_paths = self
            .disable_access_log_for_endpoints
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        AccessLogConfig { enabled: !self.disable_access_log, quiet_paths }
    }

    /// A path that does not start with `/` never matches a request: a typo, refused.
    pub fn check(&self) -> anyhow::Result<()> {
        if let Some(bad) = self.config().quiet_paths.iter().find(|p| !p.starts_with('/')) {
            anyhow::bail!(
                "--disable-access-log-for-endpoints: {bad:?} is not a path; give paths such as \"/health,/metrics\""
            );
        }
        Ok(())
    }

    /// Logs what the vLLM-only flag did (nothing), once at start.
    pub fn explain(&self) {
        if self.disable_log_requests {
            tracing::info!(
                "--disable-log-requests: mla-serve logs no prompts or outputs anyway; the access log \
                 (one line per request, no contents) stays on unless --disable-uvicorn-access-log"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::Args;
    use clap::Parser;

    fn config(args: &[&str]) -> mla_server::access_log::AccessLogConfig {
        let a = Args::try_parse_from(std::iter::once("mla-serve").chain(args.iter().copied())).unwrap();
        a.access_log.check().unwrap();
        a.access_log.config()
    }

    #[test]
    fn on_by_default_without_probes_and_scrapes() {
        let c = config(&[]);
        assert!(c.enabled);
        assert_eq!(c.quiet_paths, ["/health", "/metrics"]);
    }

    #[test]
    fn vllm_spellings() {
        assert!(!config(&["--disable-uvicorn-access-log"]).enabled);
        assert!(!config(&["--disable-access-log"]).enabled);
        assert!(config(&["--disable-log-requests"]).enabled, "request contents, not the access log");
        assert_eq!(config(&["--disable-access-log-for-endpoints", "/ping, /health"]).quiet_paths, ["/ping", "/health"]);
        assert!(config(&["--disable-access-log-for-endpoints", ""]).quiet_paths.is_empty());
        let a = Args::try_parse_from(["mla-serve", "--disable-access-log-for-endpoints", "health"]).unwrap();
        assert!(a.access_log.check().unwrap_err().to_string().contains("not a path"));
    }
}
