//! The envelope every result file carries: GPU, date, commit and the exact command.

use serde_json::{json, Value};

pub fn envelope(gpu: &str, results: Value) -> Value {
    json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date_utc": utc_now(),
        "git_commit": std::env::var("MLA_GIT_COMMIT").unwrap_or_else(|_| "unknown (set MLA_GIT_COMMIT)".into()),
        "gpu": gpu,
        "results": results,
    })
}

pub fn write(path: Option<&std::path::Path>, v: &Value) -> anyhow::Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(v)? + "\n")
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock (civil-from-days, no time-zone database).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    civil(secs)
}

fn civil(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil(0), "1970-01-01T00:00:00Z");
        // `date -u -d @1795243496` → 2026-11-21T06:44:56Z
        assert_eq!(super::civil(1_795_243_496), "2026-11-21T06:44:56Z");
        assert_eq!(super::civil(951_782_400), "2000-02-29T00:00:00Z");
    }
}
