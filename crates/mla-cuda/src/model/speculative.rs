//! Speculative decoding with the MTP module on the device (docs/speculative-decoding.md; the CPU
//! reference is mla-cpu's `speculative`, which this follows row for row). A step that asks for it
//! runs in three parts:
//!
//! 1. Verify. A sequence that feeds drafts becomes `1 + drafts` plain decode rows, row `j` at
//!    position `context_len + j` over the same block table. Every layer queues the cache writes
//!    of all its rows before any row's attention (`attention_layer`), and row `j` attends to
//!    positions `0 ..= context_len + j` by its length alone, so the drafts are scored causally
//!    by the ordinary decode path, from a captured graph when one fits: no kernel of its own.
//! 2. Accept. Every verify row samples on the device, row `j` with the seed
//!    `mla_core::speculative::row_seed` gives it. A greedy sequence's drafts stand while each is
//!    the argmax after the one before. A sampled sequence's are verified by rejection sampling
//!    before the sampler runs (kernels/speculative.cu, the rule of `mla_core::speculative`):
//!    each draft against the MTP distribution it was drawn from, whose logits rows the rank
//!    kept (`DraftStore`), and each decided row's token forced into the sampler, which reports
//!    its log-probabilities and draws the bonus row. Either way the host reads tokens alone and
//!    counts the emitted ones by the greedy rule (a replacement never equals its draft).
//! 3. Draft. The MTP module runs over the rows `mla_core::speculative::first_pass_rows` names
//!    (every verify row of a decode sequence, paired with the target's choice there; one per
//!    prompt position with its successor), which also fills its cache layer, and the row of each
//!    drafting sequence's last emitted token proposes the first draft; each further draft is one
//!    more pass of one row per sequence, fed the module's own output. A greedy draft is the
//!    device's argmax; a sampled one the device sampler's draw under the request's parameters
//!    with the draft's own seed (`mla_core::speculative::draft_seed`), its logits row copied
//!    into the rank's `DraftStore` for the next verify. The rows of every pass
//!    follow from the plan alone, so the ranks of a DP-attention group, each with its own plan,
//!    size every pass's FFN collectives alike (`DpaStep`), an idle rank taking part with none.
//!
//! The MTP pass's input is `eh_proj · [enorm(embed(token)); hnorm(prev)]`, computed as two
//! projections summed in f32 into the residual (`weights::MtpLayerWeights`); the decoder layer, norms,
//! head and sampler are the main model's code on the module's weights and cache layer.

use super::draft_store::DraftStore;
use super::forward::{rows, settled, CudaModel};
use super::graph::DecodeGraphs;
use super::meta::StepMeta;
use super::mtp_graph::{MtpGraph, MtpGraphs, PrevRows};
use super::parallel::FfnRows;
use crate::device::Device;
use crate::gpu::DSlice;
use crate::ops::{Embedding, KeepRows, NormDelta, RmsNormF32, SpecRowRaw, SpecVerdictRaw, MAX_SPEC_DRAFTS};
use half::bf16;
use mla_core::speculative::{
    draft_seed, drafts_from, first_pass_rows, greedy_emitted, mtp_pass_counts, row_request, row_seed, Verified,
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
                // Row j draws with its own seed (a sampled draw's verdict takes its uniforms from
                // it too; the bonus row's draw is the sampler's), its penalties counting the
                // drafts before it as output and its grammar mask the one after them, as a draw
                // without drafts would see them.
                let drafts = &s.tokens[1..];
                for (j, &t) in s.tokens.iter().enumerate() {
                    let sample = s
                        .sample
                        .as_ref()
                        .map(|r| SampleRequest { seed: row_seed(r.seed, j), ..row_request(r, drafts, j).into_owned() });
                    seqs.push(SeqStep { tokens: vec![t], context_len: s.context_len + j, sample, ..plain.clone() });
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

/// One MTP pass: its rows as a plan, the source row of each of its token rows, and the
/// (sampler row, `DraftStore` row) pairs of the sampled drafts whose logits rows are kept.
struct MtpPass {
    plan: StepPlan,
    src: Vec<i32>,
    keep: Vec<i32>,
}

impl MtpPass {
    fn samplers(&self) -> usize {
        self.plan.seqs.iter().filter(|s| s.sample.is_some()).count()
    }
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

/// Whether `s` draws by sampling: its drafts are verified by rejection sampling.
fn sampled(s: &SeqStep) -> bool {
    s.sample.as_ref().is_some_and(|r| !r.params.is_greedy())
}

/// How the drafting row of `s`'s `j`-th draft draws it: the argmax for a greedy draw, else the
/// request's parameters with the draft's own seed; either way under the request's logit bias,
/// as the CPU reference's `propose`, so a banned token is not proposed (the sampler shapes the
/// row, and `keep_rows` keeps it as shaped). Penalties do not shape drafts: their history at
/// the row is not at hand, and any draft distribution is exact, it only decides how often
/// drafts stand. Nor does a grammar's mask: the mask after the step's emitted tokens is not known
/// when the step drafts, and a draft the grammar forbids is simply rejected (its row's masked
/// probability is 0).
fn draw(s: &SeqStep, j: usize) -> Option<SampleRequest> {
    let bias = s.sample.as_ref().map_or_else(Vec::new, |r| r.logit_bias.clone());
    let req = match &s.sample {
        Some(r) if sampled(s) => SampleRequest::new(r.params.clone(), draft_seed(r.seed, j)),
        _ => SampleRequest::new(SamplingParams::greedy(), 0),
    };
    Some(SampleRequest { logit_bias: bias, ..req })
}

/// The draft a drafting row's result holds.
fn proposal(s: &SeqStep, r: &SeqResult) -> anyhow::Result<u32> {
    r.sampled
        .as_ref()
        .map(|t| t.token)
        .ok_or_else(|| anyhow::anyhow!("sequence {}: a drafting row did not sample", s.seq_id))
}

/// The rank's draft store (the MTP buffers exist when the module is loaded).
fn store(ws: &mut super::workspace::Workspace) -> &mut DraftStore {
    &mut ws.mtp.as_mut().expect("the MTP buffers exist when the module is loaded").drafts
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
        self.validate(plan)?;
        anyhow::ensure!(
            self.weights.mtp.is_some(),
            "the step asks for speculative decoding but the MTP module is not loaded"
        );
        let r = self.speculate(dev, graphs, plan, dpa);
        self.pending_verdict = None;
        if r.is_err() {
            // What the store's rows hold now is unknown: verify the next drafts against their
            // point masses.
            store(&mut self.ws).slots.forget();
        }
        r
    }

    fn speculate(
        &mut self,
        dev: &Device,
        mut graphs: Option<&mut DecodeGraphs>,
        plan: &StepPlan,
        dpa: Option<DpaStep>,
    ) -> anyhow::Result<StepOutput> {
        let verify = Verify::of(plan);
        store(&mut self.ws).slots.keep_only(plan);
        self.pending_verdict = self.upload_verdicts(plan, &verify)?;
        let out = match dpa {
            Some(d) => self.run_eager(dev, &verify.plan, FfnRows::Packed(d.counts))?,
            None => match graphs.as_deref_mut().and_then(|set| self.step_with_graphs(dev, set, &verify.plan)) {
                Some(r) => r?.0,
                None => self.run_eager(dev, &verify.plan, FfnRows::Padded(verify.plan.num_tokens()))?,
            },
        };
        self.pending_verdict = None;
        let mut results = Vec::with_capacity(plan.seqs.len());
        let mut verified = Vec::with_capacity(plan.seqs.len());
        for (s, g) in plan.seqs.iter().zip(&verify.groups) {
            let forced = self.forced_acceptance.as_mut().map(|(p, rng)| stood_at_rate(*p, rng, s.drafts_fed()));
            let v = accept(s, &out.seqs[g.clone()], forced)?;
            results.push(result(s, &out.seqs[g.start], v.clone()));
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
        // DP-attention ranks size every pass by all ranks' rows: eager.
        let mtp_graphs = graphs.as_deref().map(|g| &g.mtp).filter(|_| dpa.is_none());
        let drafts = self.draft(dev, plan, &verify, &verified, passes, dpa.is_some(), mtp_graphs)?;
        let drafted: Vec<(u64, Vec<u32>)> = plan
            .seqs
            .iter()
            .zip(&drafts)
            .filter(|(s, d)| sampled(s) && !d.is_empty())
            .map(|(s, d)| (s.seq_id, d.clone()))
            .collect();
        store(&mut self.ws).slots.finish(plan, &drafted);
        for (r, d) in results.iter_mut().zip(drafts) {
            r.drafts = d;
        }
        Ok(StepOutput { seqs: results })
    }

    /// Uploads the verdict launch for the sampled sequences of `plan` that feed drafts: each
    /// one's target rows (its verify rows but the last, sampler rows in `verify.plan`'s order)
    /// and, where the store still holds them, the rows its drafts were drawn from. Returns what
    /// `CudaModel::pending_verdict` holds, `None` for a plan with no such sequence.
    fn upload_verdicts(&mut self, plan: &StepPlan, verify: &Verify) -> anyhow::Result<Option<(usize, usize)>> {
        let mut sampler_row = Vec::with_capacity(verify.plan.seqs.len());
        let mut n = 0;
        for s in &verify.plan.seqs {
            sampler_row.push(n);
            n += usize::from(s.sample.is_some());
        }
        let vocab = self.cfg.vocab_size;
        let logits_row = |row: usize| self.ws.logits.ptr() + (row * vocab * std::mem::size_of::<f32>()) as u64;
        let store = &self.ws.mtp.as_ref().expect("checked by the caller").drafts;
        let (mut rows, mut verdicts) = (Vec::new(), Vec::new());
        for (s, g) in plan.seqs.iter().zip(&verify.groups) {
            let fed = s.drafts_fed();
            if fed == 0 || !sampled(s) {
                continue;
            }
            anyhow::ensure!(fed <= MAX_SPEC_DRAFTS, "sequence {}: {fed} drafts fed", s.seq_id);
            let row0 = sampler_row[g.start];
            let fed_drafts = &s.tokens[1..];
            let q = store.rows_of(s.seq_id, fed_drafts);
            let dist0 = rows.len();
            // Target row j is shaped by its own parameters (its penalties count the drafts
            // before it); a draft's row by row 0's temperature and filters, kept as drawn.
            rows.extend((0..fed).map(|j| SpecRowRaw {
                logits: logits_row(row0 + j),
                params_row: (row0 + j) as i32,
                shape: 1,
            }));
            if let Some(q) = q {
                rows.extend((0..fed).map(|j| SpecRowRaw {
                    logits: q + (j * vocab * std::mem::size_of::<f32>()) as u64,
                    params_row: row0 as i32,
                    shape: 0,
                }));
            }
            let mut drafts = [0i32; MAX_SPEC_DRAFTS];
            for (d, &t) in drafts.iter_mut().zip(fed_drafts) {
                *d = t as i32;
            }
            verdicts.push(SpecVerdictRaw {
                q_logits: q.unwrap_or(0),
                row0: row0 as i32,
                fed: fed as i32,
                dist0: dist0 as i32,
                reserved: 0,
                drafts,
            });
        }
        if verdicts.is_empty() {
            return Ok(None);
        }
        anyhow::ensure!(
            rows.len() <= store.spec_rows.len() && verdicts.len() <= store.verdicts.len(),
            "a verdict over {} sequences and {} rows exceeds the room for {} and {}",
            verdicts.len(),
            rows.len(),
            store.verdicts.len(),
            store.spec_rows.len()
        );
        store.spec_rows.upload_at(0, &rows)?;
        store.verdicts.upload_at(0, &verdicts)?;
        Ok(Some((rows.len(), verdicts.len())))
    }

    /// The MTP passes after a verify step: per sequence of `plan`, its drafts for the next step
    /// (a sampled draft's logits row kept in the rank's `DraftStore`).
    /// `verified`: each sequence's verification (the target's choice at each of its rows);
    /// `passes[p][r]`: rank r's rows in pass p (this rank's alone outside DP attention, where
    /// `packed` is false); `graphs`: the captured passes, replayed where one fits.
    #[allow(clippy::too_many_arguments)]
    fn draft(
        &mut self,
        dev: &Device,
        plan: &StepPlan,
        verify: &Verify,
        verified: &[Verified],
        passes: &[Vec<usize>],
        packed: bool,
        graphs: Option<&MtpGraphs>,
    ) -> anyhow::Result<Vec<Vec<u32>>> {
        let first_decode = plan.num_prefill();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); plan.seqs.len()];
        let Some((first_counts, chain_counts)) = passes.split_first() else { return Ok(out) };
        let me = if packed { self.mode.comm().map_or(0, |c| c.rank()) } else { 0 };
        let ffn_rows = |counts: &[usize]| -> anyhow::Result<usize> {
            counts.get(me).copied().ok_or_else(|| anyhow::anyhow!("MTP pass counts {counts:?} name no rank {me}"))
        };
        // A first pass of decode rows alone replays a graph where one fits, which samples every
        // sequence's last emitted row (greedily where it does not draft; the token is dropped).
        let passing = plan.seqs.iter().filter(|s| first_pass_rows(s) > 0).count();
        let drafting_any = plan.seqs.iter().any(drafts_from);
        let first_rows = ffn_rows(first_counts)?;
        let first_graph = graphs
            .filter(|_| first_decode == 0 && drafting_any)
            .and_then(|g| g.pick(PrevRows::Target, passing, first_rows));
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
                let sample = if wants { draw(s, 0) } else { None };
                chunks.plan.seqs.push(SeqStep { tokens: next, sample, ..plain(s) });
                chunk_of.push((i, wants));
            } else {
                // Every verify row j, paired with the target's choice there: the next emitted
                // token up to the last one; the rows after it write past the sequence's end.
                anyhow::ensure!(v.choices.len() == group.len(), "sequence {}: a verify row did not sample", s.seq_id);
                for (j, t) in v.choices.iter().enumerate() {
                    rows.src.push((first_row + j) as i32);
                    let last = j + 1 == v.emitted;
                    let drafting = wants && last;
                    let sample = match (drafting, last && first_graph.is_some()) {
                        (true, _) => draw(s, 0),
                        (false, true) => greedy(),
                        (false, false) => None,
                    };
                    rows.plan.seqs.push(SeqStep {
                        tokens: vec![t.token],
                        context_len: s.context_len + j,
                        sample,
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
        let owners: Vec<(usize, bool)> = chunk_of.into_iter().chain(row_of).collect();
        let seqs: Vec<SeqStep> = chunks.plan.seqs.into_iter().chain(rows.plan.seqs).collect();
        // The drafting rows' sampler rows (rows sample in order) and sequences.
        let mut drafting = Vec::new();
        let mut sampler = 0;
        for (&(seq, d), ms) in owners.iter().zip(&seqs) {
            if d {
                drafting.push((sampler, seq));
            }
            sampler += usize::from(ms.sample.is_some());
        }
        let pass = MtpPass {
            plan: StepPlan { kind, seqs },
            src: chunks.src.into_iter().chain(rows.src).collect(),
            keep: self.keep_pairs(plan, &drafting, &out),
        };
        anyhow::ensure!(
            pass.src.len() == first_rows,
            "the first MTP pass has {} rows where the plan says {:?}",
            pass.src.len(),
            first_counts
        );
        let first = self.mtp_pass(dev, first_graph, &pass, PrevRows::Target, packed.then_some(first_counts))?;
        // Each drafting sequence's row of its last emitted token: its first draft, and where
        // the chain goes on.
        let mut chain = Vec::new();
        let mut at = 0;
        for ((seq, drafting), (ms, r)) in owners.iter().zip(pass.plan.seqs.iter().zip(&first.seqs)) {
            let row = at + ms.tokens.len() - 1;
            at += ms.tokens.len();
            if *drafting {
                out[*seq].push(proposal(&plan.seqs[*seq], r)?);
                chain.push(Chain { seq: *seq, pos: ms.context_len + ms.tokens.len() - 1, row });
            }
        }
        for counts in chain_counts {
            chain.retain(|c| out[c.seq].len() < plan.seqs[c.seq].mtp.map_or(0, |m| m.draft));
            anyhow::ensure!(
                chain.len() == ffn_rows(counts)?,
                "an MTP chain pass of {} rows, not {counts:?}",
                chain.len()
            );
            let seqs = chain
                .iter()
                .map(|c| {
                    let s = &plan.seqs[c.seq];
                    let token = *out[c.seq].last().expect("a chained sequence has drafted");
                    let sample = draw(s, out[c.seq].len());
                    SeqStep { tokens: vec![token], context_len: c.pos + 1, sample, ..plain(s) }
                })
                .collect();
            let drafting: Vec<(usize, usize)> = chain.iter().enumerate().map(|(k, c)| (k, c.seq)).collect();
            let pass = MtpPass {
                plan: StepPlan { kind: StepKind::Decode, seqs },
                src: chain.iter().map(|c| c.row as i32).collect(),
                keep: self.keep_pairs(plan, &drafting, &out),
            };
            let graph =
                graphs.filter(|_| !chain.is_empty()).and_then(|g| g.pick(PrevRows::Mtp, chain.len(), chain.len()));
            let res = self.mtp_pass(dev, graph, &pass, PrevRows::Mtp, packed.then_some(counts.as_slice()))?;
            for (k, (c, r)) in chain.iter_mut().zip(&res.seqs).enumerate() {
                out[c.seq].push(proposal(&plan.seqs[c.seq], r)?);
                c.pos += 1;
                c.row = k;
            }
        }
        Ok(out)
    }

    /// The (sampler row, store row) pairs of a pass whose drafting rows are `drafting` (each
    /// its sampler row and sequence of `plan`): a sampled sequence's draft number
    /// `out[seq].len()` keeps its logits row in the sequence's slot, where one is free.
    fn keep_pairs(&mut self, plan: &StepPlan, drafting: &[(usize, usize)], out: &[Vec<u32>]) -> Vec<i32> {
        let slots = &mut store(&mut self.ws).slots;
        let mut pairs = Vec::new();
        for &(k, i) in drafting {
            let s = &plan.seqs[i];
            if let Some(row) = sampled(s).then(|| slots.row_for(s.seq_id, out[i].len())).flatten() {
                pairs.extend([k as i32, row as i32]);
            }
        }
        pairs
    }

    /// One MTP pass over `pass`'s rows: uploads, queues (or replays `graph`, which the caller
    /// picked for these rows), samples, reads. `packed`: every DP-attention rank's rows in this
    /// pass, which its FFN collectives carry; a rank with none runs the module's FFN alone for
    /// them.
    fn mtp_pass(
        &mut self,
        dev: &Device,
        graph: Option<&MtpGraph>,
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
        let mut meta = match graph {
            Some(g) => self.mtp_graph_meta(g, &pass.plan, pass.samplers())?,
            None => StepMeta::build(&pass.plan, &self.lim)?,
        };
        let bufs = self.ws.mtp.as_ref().expect("the MTP buffers exist when the module is loaded");
        // A graph's padding rows read row 0.
        let mut src = pass.src.clone();
        src.resize(graph.map_or(src.len(), |g| g.rows), 0);
        anyhow::ensure!(src.len() <= bufs.src.len(), "MTP pass of {} rows", src.len());
        // The previous pass (or the verify step) was read back already: nothing reads `src` now.
        bufs.src.upload_at(0, &src)?;
        bufs.drafts.pairs.upload_at(0, &pass.keep)?;
        let run = |me: &mut Self, meta: &mut StepMeta| -> anyhow::Result<StepOutput> {
            me.upload_meta(dev, meta)?;
            match graph {
                Some(g) => g.launch(dev)?,
                None => {
                    let splits = me.default_decode_splits(dev, meta);
                    me.queue_mtp(dev, meta, splits, prev, ffn_rows)?;
                    me.queue_sampler(dev, meta)?;
                }
            }
            let (ws, vocab) = (&me.ws, me.cfg.vocab_size);
            let store = &ws.mtp.as_ref().expect("checked above").drafts;
            let keep = KeepRows {
                logits: ws.logits.slice(),
                work: ws.sample_work.slice(),
                params: meta.sampling.on(me.meta.words_for(meta.words.len())),
                pairs: store.pairs.slice(),
                n: pass.keep.len() / 2,
                dst: store.rows(),
                vocab,
            };
            dev.k.speculative.keep_rows(dev.stream(), &keep)?;
            me.read_outputs(dev, meta)
        };
        settled(dev, run(self, &mut meta))
    }

    /// Queues the MTP module over the rows of `m`, whose `prev` rows `ws.mtp.src` names, up to
    /// the logits. Its output before `shared_head.norm` stays in `ws.residual` for the next pass.
    pub(super) fn queue_mtp(
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
        MtpPass { plan: StepPlan { kind: StepKind::Decode, seqs: vec![] }, src: vec![], keep: vec![] }
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
/// returned (logits and scores asked for).
fn result(s: &SeqStep, first_row: &SeqResult, v: Verified) -> SeqResult {
    let (logits, scores) =
        if s.drafts_fed() == 0 { (first_row.logits.clone(), first_row.scores.clone()) } else { (vec![], vec![]) };
    let mut emitted = v.into_emitted().into_iter();
    SeqResult {
        seq_id: s.seq_id,
        logits,
        sampled: emitted.next(),
        extra_tokens: emitted.collect(),
        drafts: vec![],
        scores,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::step::plan::MtpStep;

    fn seq(id: u64, tokens: Vec<u32>, context_len: usize, drafts_fed: usize) -> SeqStep {
        SeqStep {
            fork: None,
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
    fn each_verify_row_draws_with_its_own_seed_and_drafts_with_theirs() {
        // Row j of a sequence feeding drafts draws with row_seed(seed, j): row 0 as without
        // speculation, the bonus row as the host reference draws it, and the device verdict
        // takes its uniforms from the same seeds.
        let sampled = SampleRequest::new(SamplingParams { temperature: 0.8, ..Default::default() }, 77);
        let s = SeqStep { sample: Some(sampled.clone()), ..seq(2, vec![9, 10, 11], 40, 2) };
        let v = Verify::of(&StepPlan { kind: StepKind::Decode, seqs: vec![s.clone()] });
        let seeds: Vec<u64> = v.plan.seqs.iter().map(|r| r.sample.as_ref().unwrap().seed).collect();
        assert_eq!(seeds, (0..3).map(|j| row_seed(77, j)).collect::<Vec<_>>());
        assert!(v.plan.seqs.iter().all(|r| r.sample.as_ref().unwrap().params == sampled.params));
        // A sampled draft is the device's draw under the request's parameters with the draft's
        // own seed; a greedy one the argmax.
        let d = draw(&s, 1).unwrap();
        assert_eq!((d.seed, d.params.temperature), (draft_seed(77, 1), 0.8));
        assert!(draw(&seq(3, vec![1], 5, 0), 0).unwrap().params.is_greedy());
    }

    #[test]
    fn drafts_stand_up_to_the_first_the_target_did_not_choose() {
        let s = seq(2, vec![9, 10, 11], 40, 2);
        let row = |t: u32| SeqResult {
            scores: vec![],
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
