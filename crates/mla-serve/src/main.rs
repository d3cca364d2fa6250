//! `mla-serve`: parse flags, load the model, serve the OpenAI API until SIGINT/SIGTERM.

mod access_log_args;
mod backends;
mod cli;
mod compat_args;
mod cors_args;
mod demo;
mod hf_cache;
mod http_limits;
mod model_source;
mod nodes;
mod presets;
mod routing_args;
mod shutdown;
mod sizing;
mod speculative_args;
mod startup;
mod stats_log;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::Args::parse_from(cli::normalize(std::env::args_os()));
    init_logging(args.log_level);
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line: "loading X: file Y: reason".
            // Plain stderr rather than the log: it must be seen even with --log-level error.
            eprintln!("error: {e:#}");
            if e.downcast_ref::<shutdown::EngineDied>().is_some() {
                // A rank may still be stuck on its device (a collective its dead peer never
                // joins), and the libraries' exit handlers could wait for it: leave now. Every
                // request has been answered and the listener closed by now.
                shutdown::exit_now(1);
            }
            ExitCode::FAILURE
        }
    }
}

fn run(mut args: cli::Args) -> anyhow::Result<()> {
    tracing::info!("mla-serve {}", env!("CARGO_PKG_VERSION"));
    args.settle()?;
    if args.node_rank > 0 {
        // Another node of --nnodes: no engine and no HTTP, only this node's ranks.
        return startup::serve_for_node0(&args);
    }
    // The port first: a busy one fails now, not after minutes of loading weights. Connections
    // wait in the listen backlog until the server is ready.
    let listener = shutdown::bind(&args)?;
    // Loading is synchronous work; the async runtime starts only once there is something to serve.
    let started = startup::start(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(shutdown::serve(&args, listener, started))
}

fn init_logging(level: cli::LogLevel) {
    let filter = tracing_subscriber::EnvFilter::new(level.as_str());
    // Colours only on a terminal: log files and CI output stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .init();
}
