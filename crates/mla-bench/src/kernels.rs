//! Kernel micro-benchmarks: runs the CUDA backend's benchmark binary (`benches/mla_cuda_bench.rs`,
//! built with `cargo bench -p mla-cuda --bench mla_cuda_bench --no-run`), which times decode
//! attention at B = 1, 32, 128, 256 (ctx 4096) and causal prefill attention over 4 x 4096
//! tokens with CUDA events, and writes its own JSON. Kept as one program so the kernel owners
//! and this tool report the same numbers.

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn default_bench_bin() -> PathBuf {
    let me = std::env::current_exe().unwrap_or_default();
    me.with_file_name("mla_cuda_bench")
}

pub fn run(bin: &Path, out: Option<&Path>, only: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        bin.exists(),
        "kernel benchmark binary {} not found: build it with `cargo bench -p mla-cuda --bench mla_cuda_bench --no-run` and pass --bench-bin",
        bin.display()
    );
    let mut cmd = Command::new(bin);
    cmd.args(["--only", only]);
    if let Some(o) = out {
        cmd.arg("--out").arg(o);
    }
    let status = cmd.status().map_err(|e| anyhow::anyhow!("running {}: {e}", bin.display()))?;
    anyhow::ensure!(status.success(), "{} exited with {status}", bin.display());
    Ok(())
}
