//! The measured load rule of speculative decoding: draft at a batch size only while it pays
//! there, as this engine measures it on this model and machine.
//!
//! A verify step costs more than a plain step (its rows route to more experts, it runs the MTP
//! passes) and gains the drafts that stand. Which wins depends on the batch size (a plain step's
//! cost grows with it, the extra rows' cost grows faster once the experts are all read anyway),
//! on the acceptance (the model, the prompts, the sampling) and on the machine: a fixed
//! `disable_by_batch_size` is right for one deployment at best. So the engine keeps, per batch
//! size bucket (powers of two), the average duration of its decode steps with drafts and without,
//! and the tokens a sequence has emitted per verify step lately, and drafts at a bucket while
//! `tokens per sequence / verify step time` beats `1 / plain step time`. A bucket not yet measured
//! both ways is measured (first with drafts, then a plain step), and now and then a bucket runs
//! the other way (one plain step, or two drafting ones: the first drafts, the second verifies;
//! every 64 steps after a turn, up to every 1,024 while the decision stands), so the estimates
//! follow the context lengths and the acceptance as they drift. A switch needs a `MARGIN` lead,
//! so noise does not flip it.
//!
//! One rule serves every rank of an engine, with every rank's rows: the ranks of a DP-attention
//! group step together, so their steps' time is one, and one rank drafting slows them all.
//!
//! Only decode steps count: a mixed step's time is mostly its prompt chunk's. A step that drafts
//! without verifying (the first after drafting resumes) is neither kind and is not counted, nor
//! is a step the rule ruled out of drafting in which rows verified all the same: requests with a
//! seed and sampling draft whatever the rule says, so that their tokens reproduce (whether a
//! step drafts decides which uniforms draw them), and such a step measures neither mode.

use mla_core::step::plan::{StepKind, StepOutput, StepPlan};
use std::time::Duration;

/// Steps of a bucket between two runs of the mode it is not in, to keep both estimates fresh:
/// `PROBE_EVERY` after the decision turns, doubling with each probe that leaves it standing up to
/// `PROBE_EVERY_MAX`. A probe of the losing mode costs its extra time: at 64 steps a run where
/// drafting never pays lost 5% to its probes (run S65), at 1,024 under 0.5%.
const PROBE_EVERY: u32 = 64;
const PROBE_EVERY_MAX: u32 = 1024;
/// How much faster (tokens per second per sequence) the other mode must measure to switch.
const MARGIN: f64 = 0.03;
/// Weight of a new sample in the running averages (about the last 10 samples count).
const EMA_WEIGHT: f64 = 0.1;
/// Buckets: batch sizes 1, 2, 3-4, ..., up to 2^(BUCKETS - 1) and beyond.
const BUCKETS: usize = 12;

/// A running average, unknown until its first sample.
#[derive(Debug, Clone, Copy, Default)]
struct Ema(Option<f64>);

impl Ema {
    fn add(&mut self, x: f64) {
        self.0 = Some(self.0.map_or(x, |v| v + EMA_WEIGHT * (x - v)));
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Seconds per decode step with drafts verified, and without drafting.
    verify: Ema,
    plain: Ema,
    /// Whether the bucket drafts (its decision between probes).
    drafting: bool,
    /// Decisions taken since the last probe, and how many make the next one.
    since_probe: u32,
    probe_every: u32,
    /// Steps of the probe under way still to run the other way.
    probe_left: u32,
}

/// A finished decode step as the rule counts it.
#[derive(Debug, Clone, Copy)]
pub struct StepSample {
    /// Sequences the step decoded.
    pub batch: usize,
    /// Rows that verified drafts.
    pub verify_rows: usize,
    /// Tokens the step's sequences emitted (1 each, and the drafts that stood).
    pub emitted: usize,
    /// Whether any row drafted for the next step (the MTP passes ran).
    pub drafted: bool,
    pub took: Duration,
}

/// What the rule decided for one step, and whether that changed the bucket's decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub drafts: bool,
    /// `Some` when the bucket's decision turned: tokens per second per sequence with drafts and
    /// without, as measured.
    pub turned: Option<(f64, f64)>,
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct SpecRule {
    buckets: [Bucket; BUCKETS],
    /// Tokens a sequence emits in a verify step.
    per_seq: Ema,
    /// The last decision ruled the step out of drafting.
    ruled_out: bool,
}

impl Default for SpecRule {
    fn default() -> Self {
        let bucket = Bucket { drafting: true, probe_every: PROBE_EVERY, ..Bucket::default() };
        SpecRule { buckets: [bucket; BUCKETS], per_seq: Ema::default(), ruled_out: false }
    }
}

impl SpecRule {
    /// Whether the decode step being built drafts, for `batch` sequences over every rank (once
    /// a step); the log says when a batch size's answer turns.
    pub fn consult(&mut self, batch: usize) -> bool {
        let d = self.decide(batch);
        self.ruled_out = !d.drafts;
        if let Some((drafting, plain)) = d.turned {
            let (now, was) = if d.drafts { ("resumes", "stopped") } else { ("stops", "drafted") };
            tracing::info!(
                "speculative decoding {now} at {batch} sequences (it {was} there): measured {:.0} tokens/s a sequence drafting against {:.0} without",
                drafting,
                plain
            );
        }
        d.drafts
    }

    /// Counts a finished step: every rank's decode rows together (DP-attention ranks step
    /// together, so a rank that drafts slows the others' step too), its verifying rows and what
    /// they emitted, and how long it took. A step with a prompt chunk on any rank is not counted.
    pub fn observe(&mut self, plans: &[StepPlan], outs: &[StepOutput], took: Duration) {
        let decodes = plans.iter().all(|p| p.kind == StepKind::Decode || p.seqs.is_empty());
        let mut sample = StepSample { batch: 0, verify_rows: 0, emitted: 0, drafted: false, took };
        for (s, r) in plans.iter().zip(outs).flat_map(|(p, o)| p.seqs.iter().zip(&o.seqs)) {
            sample.batch += 1;
            sample.drafted |= s.mtp.is_some_and(|m| m.draft > 0);
            sample.verify_rows += usize::from(s.drafts_fed() > 0);
            sample.emitted += usize::from(r.sampled.is_some()) + r.extra_tokens.len();
        }
        if decodes && sample.batch > 0 {
            self.record(sample, self.ruled_out);
        }
    }
}

fn bucket_of(batch: usize) -> usize {
    (batch.max(1).next_power_of_two().trailing_zeros() as usize).min(BUCKETS - 1)
}

impl SpecRule {
    /// Whether a decode step of `batch` sequences drafts.
    fn decide(&mut self, batch: usize) -> Decision {
        let per_seq = self.per_seq.0;
        let b = &mut self.buckets[bucket_of(batch)];
        let (verify, plain) = match (b.verify.0, b.plain.0, per_seq) {
            // Unmeasured: draft first (that measures the verify step), then one plain step.
            (None, _, _) | (_, _, None) => return Decision { drafts: true, turned: None },
            (Some(_), None, _) => return Decision { drafts: false, turned: None },
            (Some(v), Some(p), Some(r)) => (r / v, 1.0 / p),
        };
        let better = if b.drafting { plain > verify * (1.0 + MARGIN) } else { verify > plain * (1.0 + MARGIN) };
        let turned = better.then(|| {
            b.drafting = !b.drafting;
            b.since_probe = 0;
            b.probe_every = PROBE_EVERY;
            (verify, plain)
        });
        if b.probe_left > 0 {
            b.probe_left -= 1;
            return Decision { drafts: !b.drafting, turned };
        }
        b.since_probe += 1;
        if b.since_probe > b.probe_every {
            // A probe the other way keeps that estimate current; the decision stands. Measuring a
            // verify step takes two: the first drafts, the second verifies.
            b.since_probe = 0;
            b.probe_every = (2 * b.probe_every).min(PROBE_EVERY_MAX);
            b.probe_left = if b.drafting { 0 } else { 1 };
            return Decision { drafts: !b.drafting, turned };
        }
        Decision { drafts: b.drafting, turned }
    }

    /// Counts a finished decode step; `ruled_out`: the rule had ruled it out of drafting.
    fn record(&mut self, s: StepSample, ruled_out: bool) {
        let b = &mut self.buckets[bucket_of(s.batch)];
        let secs = s.took.as_secs_f64();
        match (s.verify_rows > 0, s.drafted) {
            (false, false) => b.plain.add(secs),
            (true, _) if !ruled_out => {
                b.verify.add(secs);
                self.per_seq.add(s.emitted as f64 / s.batch as f64);
            }
            // Drafting without verifying (the first step after drafting resumed), or seeded
            // requests drafting in a step the rule ruled out.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine where a plain step takes `plain` ms, a verify step `verify` ms, and a sequence
    /// emits `per_seq` tokens a verify step: the rule's choices over `steps` steps at `batch`,
    /// fed back as samples.
    fn simulate(rule: &mut SpecRule, batch: usize, steps: usize, plain: f64, verify: f64, per_seq: f64) -> Vec<bool> {
        let mut previous_drafted = false;
        (0..steps)
            .map(|_| {
                let d = rule.decide(batch).drafts;
                // A step verifies only if the previous one drafted.
                let verifies = d && previous_drafted;
                let took = Duration::from_secs_f64(if verifies { verify } else { plain } / 1e3);
                let rows = if verifies { batch } else { 0 };
                let emitted = if verifies { (per_seq * batch as f64).round() as usize } else { batch };
                rule.record(StepSample { batch, verify_rows: rows, emitted, drafted: d, took }, !d);
                previous_drafted = d;
                d
            })
            .collect()
    }

    #[test]
    fn drafting_stays_where_it_pays_and_stops_where_it_does_not() {
        let mut rule = SpecRule::default();
        // Batch 1: verify 6.4 ms against plain 5.2, 1.8 tokens a row: 0.28 against 0.19 tokens/ms.
        let b1 = simulate(&mut rule, 1, 400, 5.2, 6.4, 1.8);
        assert!(b1[200..].iter().filter(|&&d| d).count() >= 190, "drafts at batch 1");
        // Batch 64 on the same rule: verify 30 ms against plain 20 with 1.2 tokens a row loses.
        let b64 = simulate(&mut rule, 64, 400, 20.0, 30.0, 1.2);
        let late = b64[200..].iter().filter(|&&d| d).count();
        assert!(late <= 200 / PROBE_EVERY as usize * 2 + 2, "mostly plain at batch 64 ({late} of 200 drafted)");
        // Each bucket keeps its own decision: batch 1 still drafts.
        assert!(simulate(&mut rule, 1, 50, 5.2, 6.4, 1.8).iter().filter(|&&d| d).count() >= 45);
    }

    #[test]
    fn acceptance_that_falls_turns_drafting_off_and_back_on() {
        let mut rule = SpecRule::default();
        let on = simulate(&mut rule, 8, 300, 10.0, 12.0, 1.7);
        assert!(on[150..].iter().all(|&d| d) || on[150..].iter().filter(|&&d| d).count() >= 145);
        // Acceptance collapses (1.05 tokens a row): drafting stops within a few dozen steps.
        let off = simulate(&mut rule, 8, 300, 10.0, 12.0, 1.05);
        assert!(off[100..].iter().filter(|&&d| d).count() <= 200 / PROBE_EVERY as usize * 2 + 2);
        // It recovers (probes measure it, rarer the longer the decision stood): drafting comes back.
        let back = simulate(&mut rule, 8, 3000, 10.0, 12.0, 1.8);
        assert!(back[2500..].iter().filter(|&&d| d).count() >= 490);
    }

    #[test]
    fn rows_that_verify_in_a_step_ruled_out_of_drafting_measure_nothing() {
        let mut rule = SpecRule::default();
        let took = Duration::from_millis(5);
        rule.record(StepSample { batch: 4, verify_rows: 1, emitted: 6, drafted: true, took }, true);
        assert!(rule.per_seq.0.is_none() && rule.buckets[2].verify.0.is_none());
        rule.record(StepSample { batch: 4, verify_rows: 4, emitted: 6, drafted: true, took }, false);
        assert_eq!(rule.per_seq.0, Some(1.5));
        rule.record(StepSample { batch: 4, verify_rows: 0, emitted: 4, drafted: false, took }, true);
        assert_eq!(rule.buckets[2].plain.0, Some(0.005));
    }

    #[test]
    fn probes_grow_rarer_while_the_decision_stands() {
        let mut rule = SpecRule::default();
        let steps = simulate(&mut rule, 16, 6000, 10.0, 30.0, 1.0);
        let probes = steps[1000..].iter().filter(|&&d| d).count();
        // Two drafting steps a probe, at most one probe per 1,024 steps by then.
        assert!(probes <= 2 * (5000 / PROBE_EVERY_MAX as usize + 1), "{probes} drafting steps in the last 5,000");
        assert!(probes > 0, "it still probes");
    }

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9, 256, 100_000].map(bucket_of), [0, 1, 2, 2, 3, 3, 4, 8, BUCKETS - 1]);
    }
}
