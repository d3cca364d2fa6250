//! The bundled demo model (config, generation config, tokenizer from `assets/demo/`), compiled
//! into the binary so `mla-serve` with no arguments works wherever the binary is copied.
//! The files are written once to a temp directory named after their content, because the model
//! and tokenizer loaders read directories; concurrent servers share it safely.

use std::path::PathBuf;

const FILES: &[(&str, &[u8])] = &[
    ("config.json", include_bytes!("../../../assets/demo/config.json")),
    ("generation_config.json", include_bytes!("../../../assets/demo/generation_config.json")),
    ("tokenizer.json", include_bytes!("../../../assets/demo/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../../assets/demo/tokenizer_config.json")),
];

/// Writes the demo files (if not already there) and returns their directory.
pub fn materialize() -> std::io::Result<PathBuf> {
    let hash = FILES.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, (name, bytes)| {
        name.bytes().chain(bytes.iter().copied()).fold(h, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
    });
    let dir = std::env::temp_dir().join(format!("mla-serve-demo-{hash:016x}"));
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|have| have == *bytes) {
            continue;
        }
        // Write-then-rename: another server starting at the same time never reads half a file.
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    #[test]
    fn materializes_identical_files_idempotently() {
        let a = super::materialize().unwrap();
        let b = super::materialize().unwrap();
        assert_eq!(a, b);
        for (name, bytes) in super::FILES {
            assert_eq!(std::fs::read(a.join(name)).unwrap(), *bytes);
        }
    }
}
