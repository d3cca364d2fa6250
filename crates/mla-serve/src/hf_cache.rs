//! Finding a HF repo id (`deepseek-ai/DeepSeek-V2-Lite-Chat`) in the local HF hub cache, laid
//! out by huggingface_hub as `<hub>/models--ORG--NAME/{refs/main, snapshots/<rev>/...}`.
//! Nothing is downloaded: the server must start the same way with or without a network.

use std::path::{Path, PathBuf};

/// Hub cache directories in huggingface_hub's order of precedence, without duplicates.
pub fn hub_roots() -> Vec<PathBuf> {
    let mut roots = vec![];
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        roots.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        roots.push(PathBuf::from(p).join("hub"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".cache/huggingface/hub"));
    }
    roots.dedup();
    roots
}

/// Whether `s` has the shape of a repo id rather than a path or preset.
pub fn looks_like_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    matches!((parts.next(), parts.next(), parts.next()), (Some(o), Some(n), None) if !o.is_empty() && !n.is_empty() && !o.starts_with('.'))
}

/// The snapshot directory of `repo_id` (the `refs/main` revision, else the newest snapshot with a
/// config.json). On failure returns every directory it looked in, for the error message.
pub fn find_snapshot(repo_id: &str, roots: &[PathBuf]) -> Result<PathBuf, Vec<PathBuf>> {
    let folder = format!("models--{}", repo_id.replace('/', "--"));
    let mut looked = vec![];
    for root in roots {
        let repo = root.join(&folder);
        looked.push(repo.clone());
        if let Some(snapshot) = snapshot_in(&repo) {
            return Ok(snapshot);
        }
    }
    Err(looked)
}

fn snapshot_in(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if dir.join("config.json").is_file() {
            return Some(dir);
        }
    }
    let mut candidates: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file())
        .map(|p| (std::fs::metadata(&p).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH), p))
        .collect();
    candidates.sort();
    candidates.pop().map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_recognised() {
        assert!(looks_like_repo_id("deepseek-ai/DeepSeek-V2-Lite-Chat"));
        assert!(!looks_like_repo_id("deepseek-v2-lite"));
        assert!(!looks_like_repo_id("/models/x"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("./x"));
    }

    #[test]
    fn finds_the_refs_main_snapshot_and_reports_where_it_looked() {
        let tmp = std::env::temp_dir().join(format!("mla-hf-cache-test-{}", std::process::id()));
        let repo = tmp.join("hub/models--org--name");
        for rev in ["aaa", "bbb"] {
            std::fs::create_dir_all(repo.join("snapshots").join(rev)).unwrap();
            std::fs::write(repo.join("snapshots").join(rev).join("config.json"), "{}").unwrap();
        }
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "aaa\n").unwrap();
        let roots = vec![tmp.join("empty"), tmp.join("hub")];
        assert_eq!(find_snapshot("org/name", &roots).unwrap(), repo.join("snapshots/aaa"));
        let looked = find_snapshot("org/other", &roots).unwrap_err();
        assert_eq!(looked, vec![tmp.join("empty/models--org--other"), tmp.join("hub/models--org--other")]);
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
