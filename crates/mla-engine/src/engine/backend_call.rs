//! Calling the backend defensively: a panic becomes an error, and an answer that does not match
//! the plans is refused before the schedulers trust it.

use crate::sequence::SeqKey;
use anyhow::anyhow;
use mla_core::step::plan::{StepKind, StepOutput, StepPlan};
use mla_core::Backend;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Runs one step (one plan per attention rank) to the end and checks its outputs.
pub(super) fn run_checked(backend: &mut dyn Backend, plans: &[StepPlan]) -> anyhow::Result<Vec<StepOutput>> {
    let plans = Arc::new(plans.to_vec());
    let outs = catch_unwind(AssertUnwindSafe(|| {
        backend.start_step(&plans);
        backend.finish_step()
    }))
    .unwrap_or_else(|p| Err(anyhow!("backend panicked: {}", panic_text(&p))))?;
    check_outputs(&plans, &outs)?;
    Ok(outs)
}

/// The plan's sequences grouped by request, in plan order, each group a step of its own kind:
/// its prompt chunks (which lead it, as they lead the plan) and its decode rows.
pub(super) fn split_by_request(plan: &StepPlan) -> Vec<(u64, StepPlan)> {
    let first_decode = plan.num_prefill();
    let mut parts: Vec<(u64, usize, StepPlan)> = Vec::new();
    for (i, s) in plan.seqs.iter().enumerate() {
        let id = SeqKey::from_seq_id(s.seq_id).request;
        let at = match parts.iter().position(|(r, _, _)| *r == id) {
            Some(at) => at,
            None => {
                parts.push((id, 0, StepPlan { kind: StepKind::Decode, seqs: vec![] }));
                parts.len() - 1
            }
        };
        let (_, prefill, part) = &mut parts[at];
        *prefill += usize::from(i < first_decode);
        part.seqs.push(s.clone());
    }
    parts
        .into_iter()
        .map(|(id, prefill, mut part)| {
            part.kind = match (prefill, part.seqs.len() - prefill) {
                (0, _) => StepKind::Decode,
                (_, 0) => StepKind::Prefill,
                (p, _) => StepKind::Mixed { prefill: p },
            };
            (id, part)
        })
        .collect()
}

/// One output per rank, and in each the backend must answer every sequence, in order, with a
/// token exactly where one was asked.
pub(super) fn check_outputs(plans: &[StepPlan], outs: &[StepOutput]) -> anyhow::Result<()> {
    if outs.len() != plans.len() {
        anyhow::bail!("backend answered for {} attention ranks of {}", outs.len(), plans.len());
    }
    for (rank, (plan, out)) in plans.iter().zip(outs).enumerate() {
        if out.seqs.len() != plan.seqs.len() {
            anyhow::bail!("backend answered {} sequences of {} on rank {rank}", out.seqs.len(), plan.seqs.len());
        }
        for (s, r) in plan.seqs.iter().zip(&out.seqs) {
            if s.seq_id != r.seq_id || s.sample.is_some() != r.sampled.is_some() {
                anyhow::bail!("backend answer for sequence {} does not match the plan (got {})", s.seq_id, r.seq_id);
            }
        }
    }
    Ok(())
}

pub(super) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}
