//! Prometheus text exposition (format 0.0.4): each family declared once with `# HELP` and
//! `# TYPE` before its samples, every sample labelled with the served model's name and every
//! name prefixed (`mla:` or `vllm:`).

use mla_engine::Histogram;
use std::fmt::Write;

pub struct Exposition {
    out: String,
    /// `mla:`, `vllm:`, or nothing.
    prefix: String,
    /// `model_name="..."`, first on every sample as vLLM puts it.
    model: String,
}

impl Exposition {
    /// Names get `prefix:` in front (none with an empty prefix).
    pub fn new(prefix: &str, model_name: &str) -> Self {
        let prefix = if prefix.is_empty() { String::new() } else { format!("{prefix}:") };
        Exposition { out: String::new(), prefix, model: format!("model_name=\"{}\"", escape_label(model_name)) }
    }

    pub fn into_text(self) -> String {
        self.out
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, help, "gauge");
        self.sample(name, "", value);
    }

    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, help, "counter");
        self.sample(name, "", value as f64);
    }

    /// One family with a sample per extra label set (`rank="0"`, `finished_reason="stop"`).
    pub fn labelled(&mut self, name: &str, help: &str, kind: &str, samples: impl IntoIterator<Item = (String, f64)>) {
        self.family(name, help, kind);
        for (labels, value) in samples {
            self.sample(name, &labels, value);
        }
    }

    /// Prometheus buckets are cumulative; the engine's counts are per bucket.
    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.family(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (bound, count) in h.bounds.iter().zip(&h.counts) {
            cumulative += count;
            self.sample(&bucket, &format!("le=\"{}\"", number(*bound)), cumulative as f64);
        }
        self.sample(&bucket, "le=\"+Inf\"", h.count as f64);
        self.sample(&format!("{name}_sum"), "", h.sum);
        self.sample(&format!("{name}_count"), "", h.count as f64);
    }

    fn family(&mut self, name: &str, help: &str, kind: &str) {
        let prefix = &self.prefix;
        let _ = writeln!(self.out, "# HELP {prefix}{name} {help}");
        let _ = writeln!(self.out, "# TYPE {prefix}{name} {kind}");
    }

    fn sample(&mut self, name: &str, extra_labels: &str, value: f64) {
        let sep = if extra_labels.is_empty() { "" } else { "," };
        let _ = writeln!(self.out, "{}{name}{{{}{sep}{extra_labels}}} {}", self.prefix, self.model, number(value));
    }
}

/// Go-style float text: integers without a fraction, special values as Prometheus spells them.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        let mut h = Histogram::with_bounds(&[0.01, 0.1, 1.0]);
        for v in [0.005, 0.05, 0.07, 3.0] {
            h.observe(v);
        }
        let mut e = Exposition::new("", "m");
        e.histogram("x_seconds", "X.", &h);
        // Hand-computed: one value <= 0.01, three <= 0.1, three <= 1, four in all; sum 3.125.
        assert_eq!(
            e.into_text(),
            "# HELP x_seconds X.\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{model_name=\"m\",le=\"0.01\"} 1\n\
             x_seconds_bucket{model_name=\"m\",le=\"0.1\"} 3\n\
             x_seconds_bucket{model_name=\"m\",le=\"1\"} 3\n\
             x_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4\n\
             x_seconds_sum{model_name=\"m\"} 3.125\n\
             x_seconds_count{model_name=\"m\"} 4\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let mut e = Exposition::new("", "a\"b\\c\nd");
        e.gauge("g", "G.", 1.0);
        assert!(e.into_text().contains("g{model_name=\"a\\\"b\\\\c\\nd\"} 1\n"));
    }

    #[test]
    fn special_values_are_spelled_as_prometheus_does() {
        assert_eq!([number(f64::INFINITY), number(f64::NEG_INFINITY), number(f64::NAN)], ["+Inf", "-Inf", "NaN"]);
        assert_eq!([number(2.0), number(0.25)], ["2", "0.25"]);
    }
}
