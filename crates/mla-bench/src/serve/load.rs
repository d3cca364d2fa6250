//! Driving the server as `vllm bench serve` does: one test request first (a benchmark that
//! cannot succeed stops there), optional warm-up requests, then every prompt sent at its
//! scheduled time whatever the server's pace, each waiting for one of `--max-concurrency`
//! slots before it goes out (that wait is its client queue time).

use super::client::Client;
use super::dataset::Prompt;
use super::metrics::RequestRecord;
use super::request::{self, RequestSpec};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

pub struct Load {
    pub client: Arc<Client>,
    pub spec: Arc<RequestSpec>,
    pub max_concurrency: Option<usize>,
    /// Prefix of each request's `x-request-id`, followed by its index.
    pub request_id_prefix: String,
}

impl Load {
    fn slots(&self) -> Option<Arc<Semaphore>> {
        self.max_concurrency.map(|c| Arc::new(Semaphore::new(c.max(1))))
    }

    /// Sends `p` until it succeeds or `ready_timeout` has passed (one try when zero); its error
    /// ends the benchmark before anything is timed, as vLLM's initial test run does.
    pub async fn initial_test(&self, p: &Prompt, want_ids: bool, ready_timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + ready_timeout;
        loop {
            let r = request::send(&self.client, &self.spec, p, want_ids, None, Instant::now()).await;
            if r.success {
                return Ok(());
            }
            if Instant::now() + Duration::from_secs(1) > deadline {
                let e = r.error.unwrap_or_default();
                anyhow::bail!(
                    "initial test run failed - check the benchmark arguments ({}): {e}",
                    self.client.target.url(&self.spec.endpoint)
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// `n` copies of `p` at once within the concurrency limit; their results are not kept.
    pub async fn warm_up(&self, p: &Prompt, n: usize) {
        let slots = self.slots();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (client, spec, p, slots) = (self.client.clone(), self.spec.clone(), p.clone(), slots.clone());
                tokio::spawn(async move {
                    let _permit = match &slots {
                        Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
                        None => None,
                    };
                    request::send(&client, &spec, &p, false, None, Instant::now()).await
                })
            })
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    }

    /// Sends prompt i at `times[i]` seconds; returns the records in prompt order and the wall
    /// time from the first send's schedule to the last completion.
    pub async fn run(&self, prompts: Vec<Prompt>, times: &[f64]) -> (Vec<RequestRecord>, Duration) {
        let slots = self.slots();
        let t0 = Instant::now();
        let mut tasks = Vec::with_capacity(prompts.len());
        for (i, (p, &at)) in prompts.into_iter().zip(times).enumerate() {
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(at)).into()).await;
            let arrival = t0.elapsed().as_secs_f64();
            let (client, spec, slots) = (self.client.clone(), self.spec.clone(), slots.clone());
            let id = format!("{}{i}", self.request_id_prefix);
            tasks.push(tokio::spawn(async move {
                let _permit = match &slots {
                    Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
                    None => None,
                };
                let mut r = request::send(&client, &spec, &p, false, Some(id), t0).await;
                r.queue_time = r.start - arrival;
                r
            }));
        }
        let mut records = Vec::with_capacity(tasks.len());
        for t in tasks {
            records.push(t.await.expect("request tasks do not panic"));
        }
        (records, t0.elapsed())
    }

    /// Multi-turn conversations: each holds one slot for all its turns and sends them in order,
    /// turn k + 1's prompt being turn k's prompt, its output and the new tokens of turn k + 1
    /// (as a chat client resends the whole history). `turns[c][k]` are the new tokens of turn k
    /// of conversation c. Between an answer and the next turn the conversation waits
    /// `turn_delay` seconds times a factor drawn from 0.5..1.5 (seeded by `seed` and c).
    pub async fn run_conversations(
        &self,
        turns: Vec<Vec<Vec<u32>>>,
        output_len: usize,
        turn_delay: f64,
        seed: u64,
    ) -> (Vec<RequestRecord>, Duration) {
        let slots = self.slots();
        let t0 = Instant::now();
        let mut tasks = Vec::with_capacity(turns.len());
        for (c, conv) in turns.into_iter().enumerate() {
            let (client, spec, slots) = (self.client.clone(), self.spec.clone(), slots.clone());
            let prefix = format!("{}{c}-", self.request_id_prefix);
            tasks.push(tokio::spawn(async move {
                let arrival = t0.elapsed().as_secs_f64();
                let _permit = match &slots {
                    Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
                    None => None,
                };
                let mut history: Vec<u32> = Vec::new();
                let mut records = Vec::with_capacity(conv.len());
                let mut rng = mla_core::SplitMix64::new(seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for (k, new) in conv.into_iter().enumerate() {
                    if k > 0 && turn_delay > 0.0 {
                        let factor = 0.5 + rng.next_f64();
                        tokio::time::sleep(Duration::from_secs_f64(turn_delay * factor)).await;
                    }
                    history.extend(new);
                    let p = Prompt { prompt: json!(history), prompt_len: history.len(), output_len };
                    let mut r = request::send(&client, &spec, &p, true, Some(format!("{prefix}{k}")), t0).await;
                    r.turn = k;
                    if k == 0 {
                        r.queue_time = r.start - arrival;
                    }
                    let failed = !r.success;
                    history.extend(std::mem::take(&mut r.output_ids));
                    records.push(r);
                    if failed {
                        break;
                    }
                }
                records
            }));
        }
        let mut records = Vec::new();
        for t in tasks {
            records.extend(t.await.expect("conversation tasks do not panic"));
        }
        (records, t0.elapsed())
    }
}
