//! Histogram bucket bounds. Each list holds every bound vLLM uses for the same series, so a
//! dashboard or alert written against vLLM's `le` values finds them all here; where a list has
//! more, the extra bounds are below vLLM's lowest, because MLA on a GPU decodes a token in a few
//! milliseconds and prefills a short prompt in tens, which vLLM's lowest buckets lump together.

/// Time to first token, seconds (vLLM's, unchanged).
pub(crate) const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// Inter-token latency and time per output token, seconds: vLLM's from 0.01 up.
pub(crate) const PER_TOKEN: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];

/// Whole-request times (end to end, queue, prefill, decode, inference), seconds: vLLM's from
/// 0.3 up.
pub(crate) const REQUEST_TIME: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Tokens one rank fed in one step (vLLM's).
pub(crate) const ITERATION_TOKENS: &[f64] =
    &[1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

/// The `n` parameter (vLLM's).
pub(crate) const PARAMS_N: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// Token counts of one request: 1, 2, 5, 10, 20, 50, ... while at most `max_model_len` (at least
/// the bucket 1), as vLLM builds them.
pub(crate) fn request_tokens(max_model_len: usize) -> Vec<f64> {
    let mut bounds = vec![];
    let mut decade = 1usize;
    loop {
        for m in [1, 2, 5] {
            let b = m * decade;
            if b > max_model_len.max(1) {
                return bounds;
            }
            bounds.push(b as f64);
        }
        decade *= 10;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_are_one_two_five_up_to_the_limit() {
        assert_eq!(request_tokens(100), vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]);
        assert_eq!(request_tokens(4096).last(), Some(&2000.0));
        assert_eq!(request_tokens(0), vec![1.0]);
    }

    #[test]
    fn bounds_rise_strictly() {
        for b in [TTFT, PER_TOKEN, REQUEST_TIME, ITERATION_TOKENS, PARAMS_N] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
