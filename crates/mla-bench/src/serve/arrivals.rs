//! When each request is sent, as vLLM's `get_request` plans it: gaps drawn from a gamma
//! distribution of shape `burstiness` and mean 1/`rate` (exponential, a Poisson process, at
//! burstiness 1; burstier below 1, steadier above), summed, then stretched so that the last
//! send falls at exactly n/rate seconds, which keeps the offered load independent of the seed.
//! An infinite rate sends everything at once; an infinite burstiness evenly.

use rand::Rng;
use rand_distr::{Distribution, Gamma};

/// Send times in seconds from the start, one per request.
pub fn schedule(n: usize, rate: f64, burstiness: f64, rng: &mut impl Rng) -> anyhow::Result<Vec<f64>> {
    anyhow::ensure!(rate > 0.0, "--request-rate {rate}: must be positive (inf sends all at once)");
    anyhow::ensure!(burstiness > 0.0, "--burstiness {burstiness}: must be positive");
    if rate.is_infinite() || n == 0 {
        return Ok(vec![0.0; n]);
    }
    let gaps: Vec<f64> = if burstiness.is_infinite() {
        vec![1.0 / rate; n]
    } else {
        let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness))?;
        (0..n).map(|_| gamma.sample(rng)).collect()
    };
    let mut t = 0.0;
    let mut times: Vec<f64> = gaps
        .into_iter()
        .map(|g| {
            t += g;
            t
        })
        .collect();
    let last = *times.last().expect("n > 0");
    if last > 0.0 {
        let stretch = n as f64 / rate / last;
        times.iter_mut().for_each(|t| *t *= stretch);
    }
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn arrivals_end_at_n_over_rate_and_burstiness_shapes_the_gaps() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        assert_eq!(schedule(3, f64::INFINITY, 1.0, &mut rng).unwrap(), vec![0.0; 3]);
        assert_eq!(schedule(4, 2.0, f64::INFINITY, &mut rng).unwrap(), vec![0.5, 1.0, 1.5, 2.0]);
        // Gaps' coefficient of variation is 1/sqrt(burstiness): about 1 for Poisson arrivals,
        // about 0.1 at burstiness 100.
        let cv = |b: f64, rng: &mut rand::rngs::StdRng| {
            let t = schedule(20_000, 10.0, b, rng).unwrap();
            assert!((t.last().unwrap() - 2000.0).abs() < 1e-6);
            assert!(t.windows(2).all(|w| w[1] >= w[0]));
            let gaps: Vec<f64> = std::iter::once(t[0]).chain(t.windows(2).map(|w| w[1] - w[0])).collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt() / mean
        };
        assert!((cv(1.0, &mut rng) - 1.0).abs() < 0.05);
        assert!((cv(100.0, &mut rng) - 0.1).abs() < 0.01);
        assert!(schedule(1, 0.0, 1.0, &mut rng).is_err() && schedule(1, 1.0, 0.0, &mut rng).is_err());
    }
}
