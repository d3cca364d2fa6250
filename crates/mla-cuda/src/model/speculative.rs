//! Speculative decoding with the MTP module on the device (docs/speculative-decoding.md; the CPU
//! reference is mla-cpu's `speculative`, which this follows row for row). A step that asks for it
//! runs in three parts:
//!
//! 1. Verify. A sequence that feeds drafts becomes `1 + drafts` plain decode rows, row `j` at
//!    position `context_len + j` over the same block table. Every layer queues the cache writes
//!    of all its rows before any row's attention (`attention_layer`), and row `j` attends to
//!    positions `0 ..= context_len + j` by its length alone, so the drafts are scored causally
//!    by the ordinary decode path, from a captured graph when one fits: no kernel of its own.
//! 2. Accept, on the host. Greedy draws from the rows' tokens, drawn on the device; sampled
//!    draws (rejection sampling) by `mla_core::speculative::verify`, the CPU reference's own
//!    code, from the rows' logits, read back instead of drawn on the device, and the
//!    distributions the drafts were drawn from (`CudaModel::drawn`). That path is exact (the
//!    GPU passes the same chi-square check as the CPU reference) but reads and ranks whole
//!    vocabulary rows on the host, far too slow under load, so the backend does not offer it
//!    to the engine (`verifies_sampled_drafts`); it is what a device verdict must match.
//! 3. Draft. The MTP module runs over the rows `mla_core::speculative::first_pass_rows` names
//!    (every verify row of a decode sequence, paired with the target's choice there; one per
//!    prompt position with its successor), which also fills its cache layer, and the row of each
//!    drafting sequence's last emitted token proposes the first draft; each further draft is one
//!    more pass of one row per sequence, fed the module's own output. A greedy draft is the
//!    device's argmax; a sampled one is drawn on the host from the row's logits
//!    (`mla_core::speculative::propose`), which keeps the distribution for the next verify. The rows of every pass
//!    follow from the plan alone, so the ranks of a DP-attention group, each with its own plan,
//!    size every pass's FFN collectives alike (`DpaStep`), an idle rank taking part with none.
//!
//! The MTP pass's input is `eh_proj · [enorm(embed(token)); hnorm(prev)]`, computed as two
//! projections summed in f32 into the residual (`weights::MtpLayerWeights`); the decoder layer, norms,
//! head and sampler are the main model's code on the module's weights and cache layer.

use super::forward::{rows, settled, CudaModel};
use super::graph::DecodeGraphs;
use super::meta::StepMeta;
use super::parallel::FfnRows;
use crate::device::Device;
use crate::gpu::DSlice;
use crate::ops::{Embedding, NormDelta, RmsNormF32, PAGE_SIZE};
use half::bf16;
use mla_core::sampling::Distribution;
use mla_core::speculative::{
    self as spec, drafts_from, first_pass_rows, greedy_emitted, mtp_pass_counts, propose, Proposals, Verified,
};
use mla_core::step::plan::{
    LogitsRequest, SampleRequest, SampledToken, SeqResult, SeqStep, StepKind, StepOutput, StepPlan,
};
use mla_core::SamplingParams;
use std::ops::Range;

/// The verify step of a plan: its sequences with drafts spread over rows of their own.
struct Verify {
    plan: StepPlan,
    /// Per sequence of the original plan, its sequences in `plan`.
    groups: Vec<Range<usize>>,
    /// Per sequence of `plan`, its first row among the step's token rows.
    row0: Vec<usize>,
}

impl Verify {
    fn of(plan: &StepPlan) -> Self {
        let first_decode = plan.num_prefill();
        let mut seqs = Vec::with_capacity(plan.num_tokens());
        let mut groups = Vec::with_capacity(plan.seqs.len());
        for (i, s) in plan.seqs.iter().enumerate() {
            let start = seqs.len();
            let plain = SeqStep { mtp: None, ..s.clone() };
            if i < first_decode || s.drafts_fed() == 0 {
                seqs.push(plain);
            } else {
                // A sampled draw's rows return their logits, for the verdict on the host.
                let row =
                    if sampled(s) { SeqStep { sample: None, logits: LogitsRequest::Last, ..plain } } else { plain };
                for (j, &t) in s.tokens.iter().enumerate() {
                    seqs.push(SeqStep { tokens: vec![t], context_len: s.context_len + j, ..row.clone() });
                }
            }
            groups.push(start..seqs.len());
        }
        let row0 = seqs
            .iter()
            .scan(0, |at, s: &SeqStep| {
                let r = *at;
                *at += s.tokens.len();
                Some(r)
            })
            .collect();
        Verify { plan: StepPlan { kind: plan.kind, seqs }, groups, row0 }
    }
}

/// Where an MTP pass takes its `prev` rows from.
#[derive(Clone, Copy)]
enum PrevRows {
    /// The target's last hidden states (`ws.h` after the verify step's final norm).
    Target,
    /// The previous MTP pass's output before `shared_head.norm` (`ws.residual`).
    Mtp,
}

/// One MTP pass: its rows as a plan, and the source row of each of its token rows.
struct MtpPass {
    plan: StepPlan,
    src: Vec<i32>,
}

/// How a DP-attention rank meets the others in a speculative step: every rank's verify rows
/// (`StepAgreement::Eager`'s counts) and every rank's rows in each MTP pass
/// (`mla_core::speculative::mtp_pass_counts` of the step's plans).
#[derive(Clone, Copy)]
pub struct DpaStep<'a> {
    pub counts: &'a [usize],
    pub passes: &'a [Vec<usize>],
}

/// A sequence still drafting: its index in the original plan, the position of its last MTP row,
/// and that row among the last pass's token rows.
struct Chain {
    seq: usize,
    pos: usize,
    row: usize,
}

fn greedy() -> Option<SampleRequest> {
    Some(SampleRequest::new(SamplingParams::greedy(), 0))
}

/// Whether `s` draws by sampling: its verdicts and drafts are decided on the host.
fn sampled(s: &SeqStep) -> bool {
    s.sample.as_ref().is_some_and(|r| !r.params.is_greedy())
}

/// How a drafting row of `s` asks for its draft: the device's argmax for a greedy draw, else
/// the row's logits, from which the host draws (`proposal`).
fn draw(s: &SeqStep) -> (Option<SampleRequest>, LogitsRequest) {
    if sampled(s) {
        (None, LogitsRequest::Last)
    } else {
        (greedy(), LogitsRequest::None)
    }
}

/// The `j`-th draft of `s` from its drafting row's result, with the distribution it was drawn
/// from for a sampled draw.
fn proposal(s: &SeqStep, r: &SeqResult, j: usize) -> anyhow::Result<(u32, Option<Distribution>)> {
    match (&r.sampled, r.logits.first(), &s.sample) {
        (Some(t), _, _) => Ok((t.token, None)),
        (None, Some(logits), Some(req)) => Ok(propose(logits, req, j)),
        _ => anyhow::bail!("sequence {}: a drafting row neither sampled nor returned logits", s.seq_id),
    }
}

impl CudaModel {
    /// Runs a step that asks for speculative decoding (see the module doc); the verify step
    /// replays a decode graph from `graphs` when one fits. `dpa`: this rank's step in a
    /// DP-attention group (run eagerly; its plan may be empty or plain while others draft).
    pub fn step_speculative(
        &mut self,
        dev: &Device,
        graphs: Option<&mut DecodeGraphs>,
        plan: &StepPlan,
        dpa: Option<DpaStep>,
    ) -> anyhow::Result<StepOutput> {
        plan.validate(PAGE_SIZE, self.num_blocks, self.cfg.vocab_size, self.max_model_len)?;
        anyhow::ensure!(
            self.weights.mtp.is_some(),
            "the step asks for speculative decoding but the MTP module is not loaded"
        );
        let verify = Verify::of(plan);
        let out = match dpa {
            Some(d) => self.run_eager(dev, &verify.plan, FfnRows::Packed(d.counts))?,
            None => match graphs.and_then(|set| self.step_with_graphs(dev, set, &verify.plan)) {
                Some(r) => r?.0,
                None => self.step(dev, &verify.plan)?,
            },
        };
        let mut out = out;
        let mut results = Vec::with_capacity(plan.seqs.len());
        let mut verified = Vec::with_capacity(plan.seqs.len());
        for (s, g) in plan.seqs.iter().zip(&verify.groups) {
            let rows = &mut out.seqs[g.clone()];
            let v = if s.drafts_fed() > 0 && sampled(s) {
                let logits: Vec<Option<Vec<f32>>> = rows.iter_mut().map(|r| r.logits.pop()).collect();
                spec::verify(s, &logits, self.drawn.get(&s.seq_id))
                    .map_err(|e| anyhow::anyhow!("sequence {}: {e}", s.seq_id))?
            } else {
                let forced = self.forced_acceptance.as_mut().map(|(p, rng)| stood_at_rate(*p, rng, s.drafts_fed()));
                accept(s, rows, forced)?
            };
            results.push(result(s, &rows[0], v.clone()));
            verified.push(v);
        }
        let own;
        let passes = match dpa {
            Some(d) => d.passes,
            None => {
                own = mtp_pass_counts(std::slice::from_ref(plan));
                &own
            }
        };
        let proposals = self.draft(dev, plan, &verify, &verified, passes, dpa.is_some())?;
        let (drafts, kept) = proposals.keep(plan);
        self.drawn = kept;
        for (r, d) in results.iter_mut().zip(drafts) {
            r.drafts = d;
        }
        Ok(StepOutput { seqs: results })
    }

    /// The MTP passes after a verify step: per sequence of `plan`, its drafts for the next step.
    /// `verified`: each sequence's verification (the target's choice at each of its rows);
    /// `passes[p][r]`: rank r's rows in pass p (this rank's alone outside DP attention, where
    /// `packed` is false).
    fn draft(
        &mut self,
        dev: &Device,
        plan: &StepPlan,
        verify: &Verify,
        verified: &[Verified],
        passes: &[Vec<usize>],
        packed: bool,
    ) -> anyhow::Result<Proposals> {
        let first_decode = plan.num_prefill();
        let mut out = Proposals::new(plan.seqs.len());
        let Some((first_counts, chain_counts)) = passes.split_first() else { return Ok(out) };
        let me = if packed { self.mode.comm().map_or(0, |c| c.rank()) } else { 0 };
        let ffn_rows = |counts: &[usize]| -> anyhow::Result<usize> {
            counts.get(me).copied().ok_or_else(|| anyhow::anyhow!("MTP pass counts {counts:?} name no rank {me}"))
        };
        let (mut chunks, mut rows) = (MtpPass::empty(), MtpPass::empty());
        // Which sequence of the original plan each MTP sequence belongs to, and whether it drafts.
        let (mut chunk_of, mut row_of) = (Vec::new(), Vec::new());
        for (i, (s, v)) in plan.seqs.iter().zip(verified).enumerate() {
            let n = first_pass_rows(s);
            if n == 0 {
                continue;
            }
            let group = verify.groups[i].clone();
            let first_row = verify.row0[group.start];
            let wants = drafts_from(s);
            if i < first_decode {
                // Row j of a prompt chunk pairs position context_len + j with the token after it.
                let after = s.mtp.and_then(|m| m.next_token).or(v.choices.first().map(|t| t.token));
                let next: Vec<u32> = s.tokens[1..].iter().copied().chain(after).collect();
                chunks.src.extend((0..next.len()).map(|j| (first_row + j) as i32));
                let (sample, logits) = if wants { draw(s) } else { (None, LogitsRequest::None) };
                chunks.plan.seqs.push(SeqStep { tokens: next, sample, logits, mtp: None, ..plain(s) });
                chunk_of.push((i, wants));
            } else {
                // Every verify row j, paired with the target's choice there: the next emitted
                // token up to the last one; the rows after it write past the sequence's end.
                anyhow::ensure!(v.choices.len() == group.len(), "sequence {}: a verify row did not sample", s.seq_id);
                for (j, t) in v.choices.iter().enumerate() {
                    rows.src.push((first_row + j) as i32);
                    let drafting = wants && j + 1 == v.emitted;
                    let (sample, logits) = if drafting { draw(s) } else { (None, LogitsRequest::None) };
                    rows.plan.seqs.push(SeqStep {
                        tokens: vec![t.token],
                        context_len: s.context_len + j,
                        sample,
                        logits,
                        mtp: None,
                        ..plain(s)
                    });
                    row_of.push((i, drafting));
                }
            }
        }
        let prefill = chunks.plan.seqs.len();
        let kind = match (prefill, rows.plan.seqs.len()) {
            (_, 0) => StepKind::Prefill,
            (0, _) => StepKind::Decode,
            (p, _) => StepKind::Mixed { prefill: p },
        };
        let pass = MtpPass {
            plan: StepPlan { kind, seqs: chunks.plan.seqs.into_iter().chain(rows.plan.seqs).collect() },
            src: chunks.src.into_iter().chain(rows.src).collect(),
        };
        anyhow::ensure!(
            pass.src.len() == ffn_rows(first_counts)?,
            "the first MTP pass has {} rows where the plan says {:?}",
            pass.src.len(),
            first_counts
        );
        let owners: Vec<(usize, bool)> = chunk_of.into_iter().chain(row_of).collect();
        let first = self.mtp_pass(dev, &pass, PrevRows::Target, packed.then_some(first_counts))?;
        // Each drafting sequence's row of its last emitted token: its first draft, and where
        // the chain goes on.
        let mut chain = Vec::new();
        let mut at = 0;
        for ((seq, drafting), (ms, r)) in owners.iter().zip(pass.plan.seqs.iter().zip(&first.seqs)) {
            let row = at + ms.tokens.len() - 1;
            at += ms.tokens.len();
            if *drafting {
                out.push(*seq, proposal(&plan.seqs[*seq], r, 0)?);
                chain.push(Chain { seq: *seq, pos: ms.context_len + ms.tokens.len() - 1, row });
            }
        }
        for counts in chain_counts {
            chain.retain(|c| out.drafts[c.seq].len() < plan.seqs[c.seq].mtp.map_or(0, |m| m.draft));
            anyhow::ensure!(
                chain.len() == ffn_rows(counts)?,
                "an MTP chain pass of {} rows, not {counts:?}",
                chain.len()
            );
            let seqs = chain
                .iter()
                .map(|c| {
                    let s = &plan.seqs[c.seq];
                    let token = *out.drafts[c.seq].last().expect("a chained sequence has drafted");
                    let (sample, logits) = draw(s);
                    SeqStep { tokens: vec![token], context_len: c.pos + 1, sample, logits, mtp: None, ..plain(s) }
                })
                .collect();
            let pass = MtpPass {
                plan: StepPlan { kind: StepKind::Decode, seqs },
                src: chain.iter().map(|c| c.row as i32).collect(),
            };
            let res = self.mtp_pass(dev, &pass, PrevRows::Mtp, packed.then_some(counts.as_slice()))?;
            for (k, (c, r)) in chain.iter_mut().zip(&res.seqs).enumerate() {
                let j = out.drafts[c.seq].len();
                out.push(c.seq, proposal(&plan.seqs[c.seq], r, j)?);
                c.pos += 1;
                c.row = k;
            }
        }
        Ok(out)
    }

    /// One MTP pass over `pass`'s rows: uploads, queues, samples, reads. `packed`: every DP-
    /// attention rank's rows in this pass, which its FFN collectives carry; a rank with none
    /// runs the module's FFN alone for them.
    fn mtp_pass(
        &mut self,
        dev: &Device,
        pass: &MtpPass,
        prev: PrevRows,
        packed: Option<&[usize]>,
    ) -> anyhow::Result<StepOutput> {
        let ffn_rows = packed.map_or(FfnRows::Padded(pass.src.len()), FfnRows::Packed);
        if pass.src.is_empty() {
            if packed.is_some() {
                let mtp = self.weights.mtp.as_ref().expect("checked by the caller");
                let idle = self.ffn(dev, &mtp.layer.ffn, 0, ffn_rows).and_then(|_| Ok(dev.gpu.sync()?));
                settled(dev, idle)?;
            }
            return Ok(StepOutput::default());
        }
        let bufs = self.ws.mtp.as_ref().expect("the MTP buffers exist when the module is loaded");
        anyhow::ensure!(pass.src.len() <= bufs.src.len(), "MTP pass of {} rows", pass.src.len());
        // The previous pass (or the verify step) was read back already: nothing reads `src` now.
        bufs.src.upload_at(0, &pass.src)?;
        let mut meta = StepMeta::build(&pass.plan, &self.lim)?;
        let run = |me: &mut Self, meta: &mut StepMeta| -> anyhow::Result<StepOutput> {
            me.upload_meta(dev, meta)?;
            let splits = me.default_decode_splits(dev, meta);
            me.queue_mtp(dev, meta, splits, prev, ffn_rows)?;
            me.queue_sampler(dev, meta)?;
            me.read_outputs(dev, meta)
        };
        settled(dev, run(self, &mut meta))
    }

    /// Queues the MTP module over the rows of `m`, whose `prev` rows `ws.mtp.src` names, up to
    /// the logits. Its output before `shared_head.norm` stays in `ws.residual` for the next pass.
    fn queue_mtp(
        &self,
        dev: &Device,
        m: &StepMeta,
        splits: usize,
        prev: PrevRows,
        ffn_rows: FfnRows,
    ) -> anyhow::Result<()> {
        let (s, k, ws) = (dev.stream(), &dev.k, &self.ws);
        let mtp = self.weights.mtp.as_ref().expect("checked by the caller");
        let bufs = ws.mtp.as_ref().expect("the MTP buffers exist when the module is loaded");
        let (n, h) = (m.tokens, self.cfg.hidden_size);
        let words = self.meta.words_for(m.words.len());
        let src = bufs.src.sub(0, n);
        // First the prev rows, before anything overwrites their source.
        match prev {
            PrevRows::Target => {
                k.elementwise.gather_rows(s, ws.h.slice(), src, ws.delta.sub(0, n * h), n, h)?;
                k.elementwise.bf16_to_f32(s, ws.delta.slice(), bufs.prev.slice(), n * h)?;
            }
            PrevRows::Mtp => {
                // f32 rows moved as pairs of 16-bit values: a bit-exact copy.
                // SAFETY: both buffers hold f32 values, seen as twice as many 16-bit ones.
                let (from, to): (DSlice<bf16>, DSlice<bf16>) = unsafe {
                    (ws.residual.slice().reinterpret(2 * ws.residual.len()), bufs.prev.slice().reinterpret(2 * n * h))
                };
                k.elementwise.gather_rows(s, from, src, to, n, 2 * h)?;
            }
        }
        let embedding = Embedding {
            table: self.weights.embed.lin().w,
            vocab: self.cfg.vocab_size,
            ids: m.token_ids.on(words),
            out: ws.residual.slice(),
            tokens: n,
            hidden: h,
        };
        k.elementwise.embedding(s, &embedding)?;
        for (x, weight, out) in [(&ws.residual, &mtp.enorm, &ws.h), (&bufs.prev, &mtp.hnorm, &ws.delta)] {
            let norm = RmsNormF32 {
                x: x.slice(),
                weight: weight.slice(),
                out: out.slice(),
                rows: n,
                hidden: h,
                eps: self.eps,
            };
            k.elementwise.rmsnorm_f32(s, &norm)?;
        }
        // residual = eh_proj[:, h..] · hnorm(prev); then + eh_proj[:, ..h] · enorm(e), both in
        // f32, by the layer's input norm, which adds its delta to the residual (`prev` is free
        // once normed).
        self.linears.linear_f32_out(dev, &mtp.eh_hidden.lin(), rows(&ws.delta, h), n, rows(&ws.residual, h))?;
        self.linears.linear_f32_out(dev, &mtp.eh_embed.lin(), rows(&ws.h, h), n, rows(&bufs.prev, h))?;
        let lw = &mtp.layer;
        self.add_norm(dev, NormDelta::F32(bufs.prev.slice()), lw.input_norm.slice(), n)?;
        self.attention(dev, lw, self.cfg.num_hidden_layers, m, words, splits)?;
        let attn_delta = self.mode.attention_output(dev, ws.delta.slice(), n, h)?;
        self.add_norm(dev, attn_delta, lw.post_norm.slice(), n)?;
        let ffn_delta = self.ffn(dev, &lw.ffn, n, ffn_rows)?;
        self.add_norm(dev, ffn_delta, mtp.shared_head_norm.slice(), n)?;
        self.queue_head(dev, m, words)
    }
}

impl MtpPass {
    fn empty() -> Self {
        MtpPass { plan: StepPlan { kind: StepKind::Decode, seqs: vec![] }, src: vec![] }
    }
}

/// A sequence's step without speculation's fields, for the rows built from it.
fn plain(s: &SeqStep) -> SeqStep {
    SeqStep { logits: LogitsRequest::None, sample: None, mtp: None, ..s.clone() }
}

/// Drafts standing, of `fed`, when each stands with probability `p` (`forced_acceptance`).
fn stood_at_rate(p: f64, rng: &mut mla_core::SplitMix64, fed: usize) -> usize {
    (0..fed).take_while(|_| rng.next_f64() < p).count()
}

/// One greedy sequence's verification from its verify rows `rows` (one, unless it fed drafts),
/// drawn on the device: with drafts, those that stood and the target's own choice after them.
/// `forced`: how many stood, decided elsewhere (benchmarks only), in place of verification.
fn accept(s: &SeqStep, rows: &[SeqResult], forced: Option<usize>) -> anyhow::Result<Verified> {
    let fed = s.drafts_fed();
    if fed == 0 {
        let choices: Vec<SampledToken> = rows[0].sampled.iter().cloned().collect();
        return Ok(Verified { emitted: choices.len(), choices });
    }
    let choices: Vec<SampledToken> = rows
        .iter()
        .map(|r| r.sampled.clone().ok_or_else(|| anyhow::anyhow!("sequence {}: a verify row did not sample", s.seq_id)))
        .collect::<anyhow::Result<_>>()?;
    let tokens: Vec<u32> = choices.iter().map(|c| c.token).collect();
    let emitted = forced.map_or_else(|| greedy_emitted(&tokens, &s.tokens[1..]), |stood| stood + 1);
    Ok(Verified { choices, emitted })
}

/// A sequence's result: what it emits, and without drafts fed whatever else its one row
/// returned (logits asked for).
fn result(s: &SeqStep, first_row: &SeqResult, v: Verified) -> SeqResult {
    let logits = if s.drafts_fed() == 0 { first_row.logits.clone() } else { vec![] };
    let mut emitted = v.into_emitted().into_iter();
    SeqResult { seq_id: s.seq_id, logits, sampled: emitted.next(), extra_tokens: emitted.collect(), drafts: vec![] }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::step::plan::MtpStep;

    fn seq(id: u64, tokens: Vec<u32>, context_len: usize, drafts_fed: usize) -> SeqStep {
        SeqStep {
            seq_id: id,
            tokens,
            context_len,
            block_table: vec![3, 1, 2],
            logits: LogitsRequest::None,
            sample: greedy(),
            mtp: Some(MtpStep { drafts_fed, next_token: None, draft: 2 }),
        }
    }

    #[test]
    fn a_verify_step_spreads_drafts_over_rows_of_their_own() {
        let chunk = SeqStep { sample: None, ..seq(1, vec![5, 6, 7], 0, 0) };
        let plan = StepPlan {
            kind: StepKind::Mixed { prefill: 1 },
            seqs: vec![chunk, seq(2, vec![9, 10, 11], 40, 2), seq(3, vec![12], 70, 0)],
        };
        let v = Verify::of(&plan);
        assert_eq!(v.groups, vec![0..1, 1..4, 4..5]);
        assert_eq!(v.row0, vec![0, 3, 4, 5, 6]);
        assert_eq!(v.plan.kind, StepKind::Mixed { prefill: 1 });
        let rows: Vec<(Vec<u32>, usize)> = v.plan.seqs.iter().map(|s| (s.tokens.clone(), s.context_len)).collect();
        assert_eq!(rows, vec![(vec![5, 6, 7], 0), (vec![9], 40), (vec![10], 41), (vec![11], 42), (vec![12], 70)]);
        assert!(v.plan.seqs.iter().all(|s| s.mtp.is_none() && s.block_table == vec![3, 1, 2]));
        v.plan.validate(64, 4, 100, 1000).unwrap();
    }

    #[test]
    fn drafts_stand_up_to_the_first_the_target_did_not_choose() {
        let s = seq(2, vec![9, 10, 11], 40, 2);
        let row = |t: u32| SeqResult {
            seq_id: 2,
            logits: vec![],
            sampled: Some(SampledToken { token: t, logprob: 0.0, top_logprobs: vec![] }),
            extra_tokens: vec![],
            drafts: vec![],
        };
        let emitted = |v: Verified| -> Vec<u32> { v.into_emitted().iter().map(|t| t.token).collect() };
        // Both drafts stand: the target's three choices are emitted.
        assert_eq!(emitted(accept(&s, &[row(10), row(11), row(4)], None).unwrap()), vec![10, 11, 4]);
        // The second draft misses: its replacement ends the step.
        assert_eq!(emitted(accept(&s, &[row(10), row(8), row(4)], None).unwrap()), vec![10, 8]);
        // The first misses.
        assert_eq!(emitted(accept(&s, &[row(7), row(11), row(4)], None).unwrap()), vec![7]);
    }
}
