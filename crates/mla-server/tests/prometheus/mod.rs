//! A strict reader of Prometheus text exposition (format 0.0.4) for the tests: it refuses what a
//! Prometheus server would refuse, and a few things it would accept but that mean a bug here
//! (a family declared twice, samples away from their family, a series repeated, a histogram
//! whose buckets are not cumulative).

#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

#[derive(Debug, Clone)]
pub struct Family {
    pub name: String,
    pub kind: String,
    pub help: String,
    pub samples: Vec<Sample>,
}

#[derive(Debug, Default)]
pub struct Scrape {
    pub families: Vec<Family>,
}

impl Scrape {
    /// The value of the one sample named `name` whose labels include every pair of `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self
            .samples()
            .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(v)))
            .collect();
        assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}");
        found[0].value
    }

    pub fn samples(&self) -> impl Iterator<Item = &Sample> {
        self.families.iter().flat_map(|f| &f.samples)
    }

    pub fn sample_names(&self) -> HashSet<&str> {
        self.samples().map(|s| s.name.as_str()).collect()
    }

    pub fn label_names(&self) -> HashSet<&str> {
        self.samples().flat_map(|s| s.labels.keys().map(String::as_str)).collect()
    }

    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.iter().find(|f| f.name == name)
    }
}

/// Parses and checks a whole exposition.
pub fn parse(text: &str) -> Result<Scrape, String> {
    if !text.ends_with('\n') {
        return Err("the exposition must end with a newline".into());
    }
    let mut scrape = Scrape::default();
    let mut declared = HashSet::new();
    let mut series = HashSet::new();
    // HELP then TYPE, then the samples: a family is open from its TYPE line to the next HELP.
    let mut pending_help: Option<(String, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", i + 1);
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').ok_or_else(|| at("HELP without text".into()))?;
            check_metric_name(name).map_err(at)?;
            if pending_help.is_some() {
                return Err(at("two HELP lines without a TYPE between".into()));
            }
            pending_help = Some((name.to_string(), help.to_string()));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| at("TYPE without a type".into()))?;
            let Some((help_name, help)) = pending_help.take() else {
                return Err(at("TYPE without a HELP line before it".into()));
            };
            if help_name != name {
                return Err(at(format!("TYPE of {name} after HELP of {help_name}")));
            }
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(at(format!("unknown type {kind}")));
            }
            if !declared.insert(name.to_string()) {
                return Err(at(format!("{name} declared twice")));
            }
            scrape.families.push(Family { name: name.into(), kind: kind.into(), help, samples: vec![] });
        } else if line.starts_with('#') {
            return Err(at("a comment other than HELP or TYPE".into()));
        } else if line.is_empty() {
            return Err(at("an empty line".into()));
        } else {
            if pending_help.is_some() {
                return Err(at("a sample between HELP and TYPE".into()));
            }
            let sample = parse_sample(line).map_err(at)?;
            let family = scrape.families.last_mut().ok_or_else(|| at("a sample before any TYPE".into()))?;
            if !belongs(&sample.name, family) {
                return Err(at(format!("sample of {} inside the {} family {}", sample.name, family.kind, family.name)));
            }
            if family.kind == "counter" && (sample.value.is_nan() || sample.value < 0.0) {
                return Err(at("a negative or NaN counter".into()));
            }
            if !series.insert(format!("{}{:?}", sample.name, sample.labels)) {
                return Err(at("the same series twice".into()));
            }
            family.samples.push(sample);
        }
    }
    if let Some((name, _)) = pending_help {
        return Err(format!("HELP of {name} without a TYPE"));
    }
    for f in scrape.families.iter().filter(|f| f.kind == "histogram") {
        check_histogram(f)?;
    }
    Ok(scrape)
}

fn belongs(sample: &str, family: &Family) -> bool {
    match family.kind.as_str() {
        "histogram" => ["_bucket", "_sum", "_count"].iter().any(|s| sample.strip_suffix(s) == Some(&family.name)),
        _ => sample == family.name,
    }
}

/// Per label set (without `le`): bounds rising to `+Inf`, cumulative counts that never fall, the
/// `+Inf` bucket equal to `_count`, and a `_sum`.
fn check_histogram(f: &Family) -> Result<(), String> {
    let mut groups: BTreeMap<BTreeMap<String, String>, Vec<(f64, f64)>> = BTreeMap::new();
    for s in f.samples.iter().filter(|s| s.name.ends_with("_bucket")) {
        let mut labels = s.labels.clone();
        let le = labels.remove("le").ok_or_else(|| format!("{}: a bucket without le", f.name))?;
        let bound = parse_value(&le).map_err(|e| format!("{}: le {e}", f.name))?;
        groups.entry(labels).or_default().push((bound, s.value));
    }
    if groups.is_empty() {
        return Err(format!("{}: a histogram without buckets", f.name));
    }
    for (labels, buckets) in groups {
        let what = format!("{} {labels:?}", f.name);
        if !buckets.windows(2).all(|w| w[0].0 < w[1].0) {
            return Err(format!("{what}: bucket bounds do not rise: {buckets:?}"));
        }
        if !buckets.windows(2).all(|w| w[0].1 <= w[1].1) {
            return Err(format!("{what}: bucket counts are not cumulative: {buckets:?}"));
        }
        let &(last_bound, inf_count) = buckets.last().unwrap();
        if last_bound != f64::INFINITY {
            return Err(format!("{what}: no le=\"+Inf\" bucket"));
        }
        let find = |suffix: &str| {
            f.samples
                .iter()
                .find(|s| s.name == format!("{}{suffix}", f.name) && s.labels == labels)
                .map(|s| s.value)
                .ok_or_else(|| format!("{what}: no {suffix}"))
        };
        let count = find("_count")?;
        find("_sum")?;
        if count != inf_count {
            return Err(format!("{what}: _count {count} but the +Inf bucket holds {inf_count}"));
        }
    }
    Ok(())
}

pub fn is_metric_name(name: &str) -> bool {
    check_metric_name(name).is_ok()
}

fn check_metric_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':');
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
        Ok(())
    } else {
        Err(format!("bad metric name {name:?}"))
    }
}

fn check_label_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') && !name.starts_with("__") {
        Ok(())
    } else {
        Err(format!("bad label name {name:?}"))
    }
}

fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse::<f64>().map_err(|_| format!("bad value {v:?}")),
    }
}

/// `name{label="value",...} value` (no timestamp: this server writes none).
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("a sample without a value")?;
    let name = &line[..name_end];
    check_metric_name(name)?;
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        rest = inner;
        loop {
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = rest.find('=').ok_or("a label without a value")?;
            let label = &rest[..eq];
            check_label_name(label)?;
            let quoted = rest[eq + 1..].strip_prefix('"').ok_or("an unquoted label value")?;
            let (value, after) = unescape_until_quote(quoted)?;
            if labels.insert(label.to_string(), value).is_some() {
                return Err(format!("label {label} twice"));
            }
            rest = after.strip_prefix(',').unwrap_or(after);
            if !after.starts_with(',') && !after.starts_with('}') {
                return Err("labels must be separated by commas".into());
            }
        }
    }
    let value = rest.strip_prefix(' ').ok_or("no space before the value")?;
    Ok(Sample { name: name.into(), labels, value: parse_value(value)? })
}

/// A label value up to its closing quote, with `\\`, `\"` and `\n` unescaped; and what follows.
fn unescape_until_quote(s: &str) -> Result<(String, &str), String> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((out, &s[i + 1..])),
            '\\' => match chars.next() {
                Some((_, '\\')) => out.push('\\'),
                Some((_, '"')) => out.push('"'),
                Some((_, 'n')) => out.push('\n'),
                other => return Err(format!("bad escape {other:?}")),
            },
            c => out.push(c),
        }
    }
    Err("an unterminated label value".into())
}

#[test]
fn the_reader_refuses_what_it_should() {
    let good = "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3\nh_count 2\n";
    assert!(parse(good).is_ok(), "{:?}", parse(good));
    for (bad, why) in [
        (good.replace("h_count 2", "h_count 3"), "count"),
        (good.replace("le=\"1\"} 1", "le=\"1\"} 5"), "cumulative"),
        (good.replace("h_bucket{le=\"+Inf\"} 2\n", ""), "+Inf"),
        (good.replace("h_sum 3\n", ""), "_sum"),
        (good.replace("# HELP h H.\n", ""), "HELP"),
        (format!("{good}# HELP h H.\n# TYPE h histogram\n"), "twice"),
        (good.replace("h_sum 3", "g 3"), "inside"),
        (good.replace("le=\"1\"", "le=\"1\",le=\"2\""), "twice"),
        ("# HELP c C.\n# TYPE c counter\nc{a=\"x\"} 1\nc{a=\"x\"} 2\n".into(), "same series"),
        ("# HELP c C.\n# TYPE c counter\nc{a=x} 1\n".into(), "unquoted"),
        ("# HELP c C.\n# TYPE c counter\nc -1\n".into(), "negative"),
        ("# HELP c C.\n# TYPE c counter\nc 1".into(), "newline"),
    ] {
        let err = parse(&bad).expect_err(why);
        assert!(err.contains(why), "{why}: {err}");
    }
}
