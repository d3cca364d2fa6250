//! `--allowed-origins` and its companions, in vLLM's forms: each list is one JSON array, as
//! vLLM parses it (`--allowed-origins '["https://app.example"]'`).
//!
//! One deliberate difference: vLLM allows every origin unless told otherwise; here CORS is off
//! unless `--allowed-origins` is given, so a server on a workstation cannot be driven by
//! whatever page its browser opens. `'["*"]'` restores vLLM's default. The method and header
//! lists default to `["*"]` as in vLLM.

use clap::Args as ClapArgs;
use mla_server::cors::{CorsLayer, CorsPolicy};

#[derive(Debug, Clone, ClapArgs)]
pub struct CorsArgs {
    /// JSON list of origins whose web pages may call the API from a browser, e.g.
    /// '["https://app.example"]'; '["*"]' for any. Default: none, and no CORS headers at all
    /// (vLLM's default is '["*"]').
    #[arg(long, value_name = "JSON")]
    pub allowed_origins: Option<String>,

    /// JSON list of methods those pages may use (default '["*"]'). Needs --allowed-origins.
    #[arg(long, value_name = "JSON")]
    pub allowed_methods: Option<String>,

    /// JSON list of request headers those pages may send (default '["*"]'; Content-Type and
    /// the other CORS-safelisted headers are always allowed). Needs --allowed-origins.
    #[arg(long, value_name = "JSON")]
    pub allowed_headers: Option<String>,

    /// Lets those pages send cookies and HTTP authentication. Needs --allowed-origins.
    #[arg(long)]
    pub allow_credentials: bool,
}

impl CorsArgs {
    /// The CORS layer the flags ask for; none without --allowed-origins.
    pub fn layer(&self) -> anyhow::Result<Option<CorsLayer>> {
        let Some(origins) = &self.allowed_origins else {
            if let Some(flag) = self.companion_given() {
                anyhow::bail!(
                    "{flag} has no effect without --allowed-origins: CORS is off unless it is given \
                     (vLLM's default is --allowed-origins '[\"*\"]'; pass that for vLLM's behaviour)"
                );
            }
            return Ok(None);
        };
        // vLLM's default for the method and header lists: anything.
        let or_any = |flag: &str, value: &Option<String>| match value {
            Some(v) => json_list(flag, v),
            None => Ok(vec!["*".to_string()]),
        };
        let policy = CorsPolicy {
            origins: json_list("--allowed-origins", origins)?,
            methods: or_any("--allowed-methods", &self.allowed_methods)?,
            headers: or_any("--allowed-headers", &self.allowed_headers)?,
            credentials: self.allow_credentials,
        };
        policy.layer().map(Some).map_err(|e| anyhow::anyhow!("CORS flags: {e}"))
    }

    fn companion_given(&self) -> Option<&'static str> {
        [
            (self.allowed_methods.is_some(), "--allowed-methods"),
            (self.allowed_headers.is_some(), "--allowed-headers"),
            (self.allow_credentials, "--allow-credentials"),
        ]
        .into_iter()
        .find_map(|(given, flag)| given.then_some(flag))
    }
}

/// A JSON array of strings, the form vLLM takes; anything else is refused with an example.
fn json_list(flag: &str, value: &str) -> anyhow::Result<Vec<String>> {
    match serde_json::from_str::<Vec<String>>(value) {
        Ok(list) if !list.is_empty() => Ok(list),
        Ok(_) => anyhow::bail!("{flag} is an empty list; leave the flag out, or name at least one value"),
        Err(_) => {
            anyhow::bail!("{flag} takes a JSON list of strings, e.g. {flag} '[\"https://app.example\"]'; got {value}")
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::Args;
    use clap::Parser;

    fn layer(args: &[&str]) -> anyhow::Result<bool> {
        let a = Args::try_parse_from(std::iter::once("mla-serve").chain(args.iter().copied())).unwrap();
        Ok(a.cors.layer()?.is_some())
    }

    #[test]
    fn off_unless_origins_are_given() {
        assert!(!layer(&[]).unwrap());
        assert!(layer(&["--allowed-origins", r#"["https://a.example"]"#]).unwrap());
        assert!(layer(&["--allowed-origins", r#"["*"]"#, "--allow-credentials"]).unwrap());
        let both = [
            "--allowed-origins",
            r#"["https://a.example"]"#,
            "--allowed-methods",
            r#"["GET","POST"]"#,
            "--allowed-headers",
            r#"["Authorization"]"#,
        ];
        assert!(layer(&both).unwrap());
    }

    #[test]
    fn mistakes_are_explained() {
        for (args, needle) in [
            (&["--allow-credentials"][..], "--allow-credentials has no effect without --allowed-origins"),
            (&["--allowed-methods", r#"["GET"]"#][..], "--allowed-methods has no effect"),
            (&["--allowed-origins", "https://a.example"][..], "JSON list of strings"),
            (&["--allowed-origins", "[]"][..], "empty list"),
            (&["--allowed-origins", r#"["https://a.example/"]"#][..], "is not an origin"),
            (&["--allowed-origins", r#"["*"]"#, "--allowed-methods", r#"["G E T"]"#][..], "not an HTTP method"),
        ] {
            let err = layer(args).unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }
}
