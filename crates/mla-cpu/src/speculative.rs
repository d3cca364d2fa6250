//! Speculative decoding on the CPU reference (docs/speculative-decoding.md): greedy verification
//! of the drafts a decode row feeds, then the MTP layer over every row whose next token is now
//! known, then the next drafts, chaining the layer's own output.
//!
//! The MTP layer's rows live in cache layer `num_hidden_layers`. Row `i` pairs the main model's
//! hidden state at position `i` with the token at `i + 1`; a row whose pair is not known this
//! step (a prompt chunk that does not sample and names no next token) is left as it was. That
//! can only lower acceptance: what is emitted is decided by verification against the target.

use crate::kv_cache::LatentCache;
use crate::mla::{AttentionPath, SeqSpan};
use crate::model::{CpuModel, MtpInput, Peers};
use crate::model_weights::MtpWeights;
use mla_core::runtime::collective::Collective;
use mla_core::sampling::{argmax, sample};
use mla_core::speculative::greedy_emitted;
use mla_core::step::plan::{SampledToken, SeqStep, StepPlan};
use mla_core::step::token_mask::MaskError;

/// The tokens one sequence emits this step: its draw, and with drafts fed, the drafts that stood
/// and the target's own choice after them. `logits[j]` is the target's row `j`.
pub fn emitted_tokens(s: &SeqStep, rows: &[Option<Vec<f32>>]) -> Result<Vec<SampledToken>, MaskError> {
    let Some(req) = &s.sample else { return Ok(vec![]) };
    let fed = s.drafts_fed();
    let first = rows.len() - 1 - fed;
    let mut choices = rows[first..]
        .iter()
        .map(|row| sample(row.as_ref().expect("verified rows have logits"), req))
        .collect::<Result<Vec<_>, _>>()?;
    let tokens: Vec<u32> = choices.iter().map(|c| c.token).collect();
    choices.truncate(greedy_emitted(&tokens, &s.tokens[s.tokens.len() - fed..]));
    Ok(choices)
}

/// One sequence's MTP rows this step, in the batch of MTP rows.
struct MtpRows {
    /// Index of the sequence in the plan.
    seq: usize,
    /// First and count of its rows in the MTP batch.
    start: usize,
    len: usize,
}

/// Runs the MTP layer for every sequence of `plan` that asks for it and returns, per sequence,
/// its drafts for the next step. `hidden` holds the target's rows after `model.norm`, laid out
/// as the step's tokens; `emitted` what each sequence emits this step. Under tensor parallelism
/// every rank runs the same passes (the same plan, and the same emitted tokens from the same
/// reduced logits) and meets the others through `comm` in each.
pub fn draft(
    model: &CpuModel,
    mtp: &MtpWeights,
    plan: &StepPlan,
    hidden: &[f32],
    emitted: &[Vec<SampledToken>],
    cache: &mut LatentCache,
    comm: &mut dyn Collective,
) -> Result<Vec<Vec<u32>>, mla_core::runtime::collective::CollectiveError> {
    let h = model.config().hidden_size;
    let first_decode = plan.num_prefill();
    let (mut tokens, mut prev, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    let mut at = 0;
    for (i, s) in plan.seqs.iter().enumerate() {
        let start_row = at;
        at += s.tokens.len();
        let Some(m) = s.mtp else { continue };
        // The token after each fed position: the next fed token, then what the step supplies.
        // A decode row's fed drafts that stood are also its emitted tokens, so its pairs are
        // exactly the emitted ones.
        let next: Vec<u32> = if i >= first_decode {
            emitted[i].iter().map(|t| t.token).collect()
        } else {
            let after = m.next_token.or(emitted[i].first().map(|t| t.token));
            s.tokens[1..].iter().copied().chain(after).collect()
        };
        if next.is_empty() {
            continue;
        }
        rows.push(MtpRows { seq: i, start: tokens.len(), len: next.len() });
        tokens.extend_from_slice(&next);
        prev.extend_from_slice(&hidden[start_row * h..(start_row + next.len()) * h]);
    }
    let spans: Vec<SeqSpan> = rows
        .iter()
        .map(|r| {
            let s = &plan.seqs[r.seq];
            let path = if r.seq < first_decode { AttentionPath::Normal } else { AttentionPath::Absorbed };
            SeqSpan { start: r.start, len: r.len, context_len: s.context_len, block_table: &s.block_table, path }
        })
        .collect();
    let wants = |r: &MtpRows| plan.seqs[r.seq].mtp.is_some_and(|m| m.draft > 0);
    let mut want = vec![false; tokens.len()];
    for r in rows.iter().filter(|r| wants(r)) {
        want[r.start + r.len - 1] = true;
    }
    let counts = [tokens.len()];
    let peers = Peers { comm: &mut *comm, counts: &counts };
    let out =
        model.mtp_forward_rank(mtp, MtpInput { prev_hidden: &prev, tokens: &tokens }, &spans, cache, &want, peers)?;

    let mut drafts = vec![Vec::new(); plan.seqs.len()];
    // The chain: each drafting sequence's last row, then one row per further draft.
    let mut chain: Vec<(usize, usize, Vec<f32>)> = Vec::new(); // (seq, position of the row, its hidden)
    for r in rows.iter().filter(|r| wants(r)) {
        let last = r.start + r.len - 1;
        let logits = out.logits[last].as_ref().expect("the last row's logits were asked for");
        drafts[r.seq].push(argmax(logits));
        let pos = plan.seqs[r.seq].context_len + r.len - 1;
        chain.push((r.seq, pos, out.hidden[last * h..(last + 1) * h].to_vec()));
    }
    loop {
        chain.retain(|(seq, _, _)| drafts[*seq].len() < plan.seqs[*seq].mtp.map_or(0, |m| m.draft));
        if chain.is_empty() {
            break;
        }
        let tokens: Vec<u32> = chain.iter().map(|(seq, _, _)| *drafts[*seq].last().unwrap()).collect();
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
        let counts = [tokens.len()];
        let peers = Peers { comm: &mut *comm, counts: &counts };
        let want = vec![true; tokens.len()];
        let out = model.mtp_forward_rank(
            mtp,
            MtpInput { prev_hidden: &prev, tokens: &tokens },
            &spans,
            cache,
            &want,
            peers,
        )?;
        for (k, (seq, pos, hid)) in chain.iter_mut().enumerate() {
            drafts[*seq].push(argmax(out.logits[k].as_ref().expect("every chain row's logits")));
            *pos += 1;
            hid.copy_from_slice(&out.hidden[k * h..(k + 1) * h]);
        }
    }
    Ok(drafts)
}
