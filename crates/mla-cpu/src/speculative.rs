//! Speculative decoding on the CPU reference (docs/speculative-decoding.md): after the rank has
//! verified the drafts a decode row feeds (`crate::verdict::verify`), the MTP layer over
//! the step's rows (`mla_core::speculative::first_pass_rows`), then the next drafts, chaining the
//! layer's own output.
//!
//! The MTP layer's rows live in cache layer `num_hidden_layers`. Row `i` pairs the main model's
//! hidden state at position `i` with the token at `i + 1`; a row whose pair is not known this
//! step (a prompt chunk that does not sample and names no next token) is left as it was. That
//! can only lower acceptance: what is emitted is decided by verification against the target.
//! The passes and their rows follow from the plan alone, so DP-attention ranks, each with its
//! own plan, know every rank's rows in every pass (`mla_core::speculative::mtp_pass_counts`).

use crate::kv_cache::LatentCache;
use crate::mla::{AttentionPath, SeqSpan};
use crate::model::{CpuModel, MtpInput, Peers};
use crate::model_weights::MtpWeights;
use crate::verdict::{propose, Proposals};
use mla_core::runtime::collective::{Collective, CollectiveError};
use mla_core::speculative::{drafts_from, first_pass_rows, Verified};
use mla_core::step::plan::StepPlan;

/// One sequence's MTP rows this step, in the batch of MTP rows.
struct MtpRows {
    /// Index of the sequence in the plan.
    seq: usize,
    /// First and count of its rows in the MTP batch.
    start: usize,
    len: usize,
    /// Its row of the last emitted token, from `start` (the one that drafts).
    last: usize,
}

/// Runs the MTP passes of a step and returns, per sequence of `plan`, its drafts for the next
/// step. `hidden` holds the target's rows after `model.norm`, laid out as the step's tokens;
/// `verified` each sequence's verification; `passes[p][r]` rank r's rows in pass p (one entry per
/// pass under tensor parallelism or alone, where every rank runs the same plan). Each pass meets
/// the other ranks through `comm`, also when this rank has no rows in it.
#[allow(clippy::too_many_arguments)]
pub fn draft(
    model: &CpuModel,
    mtp: &MtpWeights,
    plan: &StepPlan,
    hidden: &[f32],
    verified: &[Verified],
    cache: &mut LatentCache,
    comm: &mut dyn Collective,
    passes: &[Vec<usize>],
) -> Result<Proposals, CollectiveError> {
    let h = model.config().hidden_size;
    let first_decode = plan.num_prefill();
    let mut out = Proposals::new(plan.seqs.len());
    let Some((first_counts, chain_counts)) = passes.split_first() else { return Ok(out) };
    let (mut tokens, mut prev, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    let mut at = 0;
    for (i, (s, v)) in plan.seqs.iter().zip(verified).enumerate() {
        let start_row = at;
        at += s.tokens.len();
        let n = first_pass_rows(s);
        if n == 0 {
            continue;
        }
        // Row j's pair: the target's draw at row j where the row samples (for the rows up to
        // the last emitted one, the next emitted token), else the next fed token, or the chunk's
        // `next_token`.
        let sampled_from = s.tokens.len() - v.choices.len();
        let next_fed = s.tokens[1..].iter().copied().chain(s.mtp.and_then(|m| m.next_token));
        let next: Vec<u32> = next_fed
            .chain(std::iter::repeat(0))
            .take(n)
            .enumerate()
            .map(|(j, fed)| if j >= sampled_from { v.choices[j - sampled_from].token } else { fed })
            .collect();
        // The row of the last emitted token (the last row where nothing is verified).
        let last = n - 1 - (v.choices.len() - v.emitted);
        rows.push(MtpRows { seq: i, start: tokens.len(), len: n, last });
        tokens.extend_from_slice(&next);
        prev.extend_from_slice(&hidden[start_row * h..(start_row + n) * h]);
    }
    let spans: Vec<SeqSpan> = rows
        .iter()
        .map(|r| {
            let s = &plan.seqs[r.seq];
            let path = if r.seq < first_decode { AttentionPath::Normal } else { AttentionPath::Absorbed };
            SeqSpan { start: r.start, len: r.len, context_len: s.context_len, block_table: &s.block_table, path }
        })
        .collect();
    let wants = |r: &MtpRows| drafts_from(&plan.seqs[r.seq]);
    let mut want = vec![false; tokens.len()];
    for r in rows.iter().filter(|r| wants(r)) {
        want[r.start + r.last] = true;
    }
    let peers = Peers { comm: &mut *comm, counts: first_counts };
    let pass =
        model.mtp_forward_rank(mtp, MtpInput { prev_hidden: &prev, tokens: &tokens }, &spans, cache, &want, peers)?;
    let request = |seq: usize| plan.seqs[seq].sample.as_ref().expect("a drafting sequence samples");

    // The chain: each drafting sequence's last emitted row, then one row per further draft.
    let mut chain: Vec<(usize, usize, Vec<f32>)> = Vec::new(); // (seq, position of the row, its hidden)
    for r in rows.iter().filter(|r| wants(r)) {
        let row = r.start + r.last;
        let logits = pass.logits[row].as_ref().expect("the drafting row's logits were asked for");
        out.push(r.seq, propose(logits, request(r.seq), 0));
        let pos = plan.seqs[r.seq].context_len + r.last;
        chain.push((r.seq, pos, pass.hidden[row * h..(row + 1) * h].to_vec()));
    }
    let drafts = |out: &Proposals, seq: usize| out.drafts[seq].len();
    for counts in chain_counts {
        chain.retain(|(seq, _, _)| drafts(&out, *seq) < plan.seqs[*seq].mtp.map_or(0, |m| m.draft));
        let tokens: Vec<u32> = chain.iter().map(|(seq, _, _)| *out.drafts[*seq].last().unwrap()).collect();
        let prev: Vec<f32> = chain.iter().flat_map(|(_, _, hid)| hid.iter().copied()).collect();
        let spans: Vec<SeqSpan> = chain
            .iter()
            .enumerate()
            .map(|(k, (seq, pos, _))| SeqSpan {
                start: k,
                len: 1,
                context_len: pos + 1,
                block_table: &plan.seqs[*seq].block_table,
                path: AttentionPath::Absorbed,
            })
            .collect();
        let peers = Peers { comm: &mut *comm, counts };
        let want = vec![true; tokens.len()];
        let pass = model.mtp_forward_rank(
            mtp,
            MtpInput { prev_hidden: &prev, tokens: &tokens },
            &spans,
            cache,
            &want,
            peers,
        )?;
        for (k, (seq, pos, hid)) in chain.iter_mut().enumerate() {
            let logits = pass.logits[k].as_ref().expect("every chain row's logits");
            let j = out.drafts[*seq].len();
            out.push(*seq, propose(logits, request(*seq), j));
            *pos += 1;
            hid.copy_from_slice(&pass.hidden[k * h..(k + 1) * h]);
        }
    }
    Ok(out)
}
