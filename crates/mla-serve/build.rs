//! Embeds every `configs/*.json` preset so `--model deepseek-v2-lite` works wherever the binary
//! is copied, and a new preset file needs no code change.

use std::fmt::Write;
use std::path::Path;

fn main() {
    // Read at run time, not baked in with env!(): a build-script binary reused from another
    // checkout sharing the target directory (a git worktree) must read this checkout's configs.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("../../configs");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("configs/ next to the workspace root")
        .map(|e| e.expect("readable configs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    entries.sort();
    let mut code = String::from(
        "/// (preset name, config.json text) for every file in configs/.\npub const PRESETS: &[(&str, &str)] = &[\n",
    );
    for p in &entries {
        println!("cargo:rerun-if-changed={}", p.display());
        let name = p.file_stem().unwrap().to_string_lossy();
        let path = p.canonicalize().unwrap();
        writeln!(code, "    ({name:?}, include_str!({:?})),", path.display().to_string()).unwrap();
    }
    code.push_str("];\n");
    let out = Path::new(&std::env::var("OUT_DIR").unwrap()).join("presets.rs");
    std::fs::write(out, code).unwrap();
}
