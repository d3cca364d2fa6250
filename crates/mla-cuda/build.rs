//! Compiles every `kernels/*.cu` with nvcc into a cubin for sm_90a (Hopper, the target) and PTX
//! for compute_80 (any Ampere or newer GPU, JIT-compiled by the driver), and generates
//! `$OUT_DIR/kernels.rs`, which embeds both with `include_bytes!`.
//!
//! nvcc is looked up in `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `PATH`, then the repository's
//! `.toolchain/cuda` (what `scripts/install_nvcc.sh` installs). Without nvcc the crate still builds
//! (a cargo warning says so) and the runtime reports "built without CUDA kernels", unless
//! `MLA_REQUIRE_NVCC=1`, which turns absence or any compile error into a build error (CI sets it).

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Machine code for the GPUs we tune for; `a` enables wgmma/setmaxnreg should a kernel use them.
const CUBIN_GENCODE: &str = "-gencode=arch=compute_90a,code=sm_90a";
/// Portable fallback: bf16 mma.sync and cp.async need compute capability 8.0.
const PTX_ARCH: &str = "compute_80";

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let repo = manifest.parent().and_then(Path::parent).expect("crate lives in crates/<name>").to_path_buf();
    let kernel_dir = repo.join("kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let require = env::var("MLA_REQUIRE_NVCC").is_ok_and(|v| v == "1");

    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", "MLA_REQUIRE_NVCC", "MLA_NVCC_FLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={}", kernel_dir.display());

    let mut sources = Vec::new();
    let mut headers = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&kernel_dir) {
        for e in entries.flatten() {
            let p = e.path();
            match p.extension().and_then(|x| x.to_str()) {
                Some("cu") => sources.push(p),
                Some("cuh") => headers.push(p),
                _ => {}
            }
        }
    }
    sources.sort();
    for p in sources.iter().chain(&headers) {
        println!("cargo:rerun-if-changed={}", p.display());
    }

    // The shared numbers are needed with or without nvcc (the Rust side sizes buffers by them).
    write_dims(&kernel_dir.join("dims.cuh"), &out_dir.join("dims.rs"));

    let nvcc = find_nvcc(&repo);
    let generated = out_dir.join("kernels.rs");
    let nvcc = match nvcc {
        Some(n) => n,
        None => {
            let msg = "nvcc not found (NVCC, CUDA_HOME, CUDA_PATH, PATH, .toolchain/cuda): building without CUDA kernels; run scripts/install_nvcc.sh to get the pinned compiler";
            if require {
                panic!("MLA_REQUIRE_NVCC=1: {msg}");
            }
            println!("cargo:warning={msg}");
            write_without_kernels(&generated, "nvcc was not found when this binary was built");
            return;
        }
    };

    let extra: Vec<String> =
        env::var("MLA_NVCC_FLAGS").map(|s| s.split_whitespace().map(String::from).collect()).unwrap_or_default();

    // Two compiles per kernel file, run in parallel threads (nvcc is single-threaded).
    let jobs: Vec<(PathBuf, PathBuf, Vec<String>)> = sources
        .iter()
        .flat_map(|src| {
            let stem = src.file_stem().unwrap().to_str().unwrap().to_string();
            let cubin = out_dir.join(format!("{stem}.sm90a.cubin"));
            let ptx = out_dir.join(format!("{stem}.{PTX_ARCH}.ptx"));
            [
                (src.clone(), cubin, vec!["-cubin".to_string(), CUBIN_GENCODE.to_string()]),
                (src.clone(), ptx, vec!["-ptx".to_string(), format!("-arch={PTX_ARCH}")]),
            ]
        })
        .collect();
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(src, out, mode)| {
                let nvcc = &nvcc;
                let kernel_dir = &kernel_dir;
                let extra = &extra;
                s.spawn(move || compile(nvcc, kernel_dir, src, out, mode, extra))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap().err()).collect()
    });
    if !failures.is_empty() {
        let all = failures.join("\n");
        if require {
            panic!("kernel compilation failed:\n{all}");
        }
        // A broken kernel is a bug, not a missing tool: fail loudly even without MLA_REQUIRE_NVCC.
        panic!("kernel compilation failed (nvcc {}):\n{all}", nvcc.display());
    }

    let mut code = String::new();
    writeln!(code, "/// Whether nvcc compiled the kernels into this binary.").unwrap();
    writeln!(code, "pub const KERNELS_BUILT: bool = true;").unwrap();
    writeln!(code, "pub const NVCC: &str = {:?};", nvcc.display().to_string()).unwrap();
    writeln!(code, "pub static MODULES: &[EmbeddedModule] = &[").unwrap();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_str().unwrap();
        let cubin = out_dir.join(format!("{stem}.sm90a.cubin"));
        let ptx = out_dir.join(format!("{stem}.{PTX_ARCH}.ptx"));
        writeln!(
            code,
            "    EmbeddedModule {{ name: {stem:?}, cubin_sm90a: include_bytes!({:?}), ptx: include_bytes!({:?}) }},",
            cubin.display().to_string(),
            ptx.display().to_string()
        )
        .unwrap();
    }
    writeln!(code, "];").unwrap();
    std::fs::write(&generated, code).unwrap();
}

/// Turns every `constexpr int NAME = EXPR;` of `kernels/dims.cuh` into `pub const NAME: usize =
/// EXPR;`. The header's rules (integer literals, + - * / and parentheses, names defined earlier)
/// make EXPR a valid Rust constant expression with the same value; anything else in a definition
/// fails the build here, naming the line.
fn write_dims(header: &Path, out: &Path) {
    let text = std::fs::read_to_string(header).unwrap_or_else(|e| panic!("{}: {e}", header.display()));
    // Comments and preprocessor lines (`#pragma once`) carry no definitions.
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut rust = String::from("// Generated by build.rs from kernels/dims.cuh; edit that file.\n");
    for statement in code.split(';') {
        let statement = statement.split_whitespace().collect::<Vec<_>>().join(" ");
        let Some(def) = statement.strip_prefix("constexpr int ") else {
            assert!(
                statement.is_empty(),
                "{}: only `constexpr int NAME = EXPR;` definitions may appear, found `{statement}`",
                header.display()
            );
            continue;
        };
        let (name, expr) =
            def.split_once(" = ").unwrap_or_else(|| panic!("{}: `{def}` has no ` = `", header.display()));
        let allowed = |c: char| c.is_ascii_alphanumeric() || "_+-*/() ".contains(c);
        assert!(
            name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') && expr.chars().all(allowed),
            "{}: `{def}` is not NAME = integer expression",
            header.display()
        );
        writeln!(rust, "pub const {name}: usize = {expr};").unwrap();
    }
    std::fs::write(out, rust).unwrap();
}

fn write_without_kernels(path: &Path, why: &str) {
    let code = format!(
        "/// Whether nvcc compiled the kernels into this binary.\npub const KERNELS_BUILT: bool = false;\npub const NVCC: &str = {why:?};\npub static MODULES: &[EmbeddedModule] = &[];\n"
    );
    std::fs::write(path, code).unwrap();
}

fn compile(
    nvcc: &Path,
    include: &Path,
    src: &Path,
    out: &Path,
    mode: &[String],
    extra: &[String],
) -> Result<(), String> {
    let mut cmd = Command::new(nvcc);
    cmd.args(mode)
        .arg("-O3")
        .arg("-std=c++17")
        .arg("-lineinfo")
        .arg("-Xptxas=-warn-spills")
        .arg(format!("-I{}", include.display()))
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg(src);
    let output = cmd.output().map_err(|e| format!("{}: cannot run nvcc: {e}", src.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("{} ({}):\n{stderr}", src.display(), mode.join(" ")));
    }
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning={}: {line}", src.file_name().unwrap().to_string_lossy());
    }
    Ok(())
}

fn find_nvcc(repo: &Path) -> Option<PathBuf> {
    let exe = |p: PathBuf| p.is_file().then_some(p);
    if let Some(p) = env::var_os("NVCC").map(PathBuf::from).and_then(exe) {
        return Some(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = env::var_os(var).map(|d| PathBuf::from(d).join("bin").join("nvcc")).and_then(exe) {
            return Some(p);
        }
    }
    if let Some(paths) = env::var_os("PATH") {
        if let Some(p) = env::split_paths(&paths).map(|d| d.join("nvcc")).find(|p| p.is_file()) {
            return Some(p);
        }
    }
    exe(repo.join(".toolchain/cuda/nvidia/cu13/bin/nvcc"))
}
