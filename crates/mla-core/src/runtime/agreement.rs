//! What every rank of a DP-attention group runs in one step, decided from all the ranks' plans
//! before any rank starts. The ranks meet in the FFN collectives of every layer, so they must
//! agree on how many rows each one sends and on whether the step is a graph replay (a graph's
//! collectives are captured with fixed sizes, and replaying one is collective across the ranks).
//! A single node decides it on the engine's thread, which sees every plan; nothing about it is
//! exchanged between ranks.

use crate::step::plan::StepPlan;

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepAgreement {
    /// Every rank replays its decode graph of `batch` rows, padding its own sequences (an idle
    /// rank: padding rows only).
    Graph { batch: usize },
    /// Every rank runs eagerly, and each layer's FFN collectives carry `counts[r]` rows from
    /// rank r (its tokens), packed. An idle rank (count 0) runs only the FFN and its collectives.
    Eager { counts: Vec<usize> },
}

/// The agreement for `plans` (one per rank) when the ranks captured decode graphs of
/// `graph_batches` rows (ascending; the same on every rank) and `graphable` says whether a
/// graph can run a plan. A graph is replayed when every rank's plan can run from one and the
/// largest batch fits a graph; otherwise the step runs eagerly.
pub fn agree(plans: &[StepPlan], graph_batches: &[usize], graphable: impl Fn(&StepPlan) -> bool) -> StepAgreement {
    let batch = plans.iter().map(|p| p.seqs.len()).max().unwrap_or(0);
    let all_graphable = batch > 0 && plans.iter().all(|p| p.seqs.is_empty() || graphable(p));
    match graph_batches.iter().find(|&&b| b >= batch) {
        Some(&b) if all_graphable => StepAgreement::Graph { batch: b },
        _ => StepAgreement::Eager { counts: plans.iter().map(StepPlan::num_tokens).collect() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::plan::{LogitsRequest, SampleRequest, SeqStep, StepKind};
    use crate::SamplingParams;

    fn plan(kind: StepKind, seqs: usize, tokens_each: usize) -> StepPlan {
        let seq = |i: usize| SeqStep {
            fork: None,
            seq_id: i as u64,
            tokens: vec![1; tokens_each],
            context_len: 0,
            block_table: vec![0],
            logits: LogitsRequest::None,
            sample: Some(SampleRequest::new(SamplingParams::greedy(), 0)),
            mtp: None,
        };
        StepPlan { kind, seqs: (0..seqs).map(seq).collect() }
    }

    fn decode_only(p: &StepPlan) -> bool {
        p.kind == StepKind::Decode
    }

    const BUCKETS: [usize; 4] = [1, 2, 4, 8];

    #[test]
    fn decoding_ranks_replay_the_bucket_of_the_largest_batch() {
        let plans = [plan(StepKind::Decode, 3, 1), plan(StepKind::Decode, 1, 1)];
        assert_eq!(agree(&plans, &BUCKETS, decode_only), StepAgreement::Graph { batch: 4 });
        // An idle rank replays the same graph with padding rows only.
        let plans = [plan(StepKind::Decode, 0, 1), plan(StepKind::Decode, 2, 1), plan(StepKind::Decode, 0, 1)];
        assert_eq!(agree(&plans, &BUCKETS, decode_only), StepAgreement::Graph { batch: 2 });
    }

    #[test]
    fn any_rank_that_cannot_replay_makes_the_step_eager() {
        // One rank prefills 40 tokens: everyone runs eagerly, each rank's rows packed.
        let plans = [plan(StepKind::Decode, 3, 1), plan(StepKind::Prefill, 2, 20), plan(StepKind::Decode, 0, 1)];
        assert_eq!(agree(&plans, &BUCKETS, decode_only), StepAgreement::Eager { counts: vec![3, 40, 0] });
        // A batch above the largest graph.
        let plans = [plan(StepKind::Decode, 9, 1), plan(StepKind::Decode, 1, 1)];
        assert_eq!(agree(&plans, &BUCKETS, decode_only), StepAgreement::Eager { counts: vec![9, 1] });
        // No graphs captured.
        assert_eq!(agree(&plans, &[], decode_only), StepAgreement::Eager { counts: vec![9, 1] });
        // Every rank idle (the engine never starts such a step; it stays well defined).
        let plans = [plan(StepKind::Decode, 0, 1), plan(StepKind::Decode, 0, 1)];
        assert_eq!(agree(&plans, &BUCKETS, decode_only), StepAgreement::Eager { counts: vec![0, 0] });
    }

    #[test]
    fn every_rank_reaches_the_same_agreement_whatever_its_index() {
        // The agreement is a function of the set of plans: rotating the ranks changes nothing.
        let mut plans = vec![plan(StepKind::Decode, 5, 1), plan(StepKind::Decode, 0, 1), plan(StepKind::Decode, 2, 1)];
        let first = agree(&plans, &BUCKETS, decode_only);
        for _ in 0..plans.len() {
            plans.rotate_left(1);
            assert_eq!(agree(&plans, &BUCKETS, decode_only), first);
        }
    }
}
