//! Prometheus-style histograms of the engine's latencies and sizes (bucket bounds in `buckets`).

/// Prometheus-style histogram: `counts[i]` observations fell at or below `bounds[i]` and above
/// `bounds[i-1]`; the last count is for values above every bound (+Inf bucket minus the rest).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    pub bounds: Vec<f64>,
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn with_bounds(bounds: &[f64]) -> Self {
        Histogram { bounds: bounds.to_vec(), counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, value: f64) {
        let i = self.bounds.iter().position(|&b| value <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }
}

impl Histogram {
    /// Adds another histogram's observations; both must have the same bounds.
    pub fn merge(&mut self, other: &Histogram) {
        assert_eq!(self.bounds, other.bounds, "merging histograms with different buckets");
        self.counts.iter_mut().zip(&other.counts).for_each(|(a, b)| *a += b);
        self.sum += other.sum;
        self.count += other.count;
    }
}
