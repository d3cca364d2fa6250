//! Per-step metadata: everything a step's kernels read besides weights, cache and activations,
//! built on the host from a `StepPlan` into one array of 32-bit words (typed `Section`s, see
//! `meta_words`) and uploaded with one copy. Decode steps use a layout whose offsets
//! depend only on the batch size, so a CUDA graph captured for that size stays valid: what changes
//! between steps (tokens, lengths, block tables, sampling parameters) is data the kernels read,
//! never a launch argument. The penalty and logit-bias entries, whose counts vary without bound,
//! live in buffers of their own whose addresses are themselves words. Structured-output masks are
//! not known yet when the words are built (the engine fills them during the forward pass): a
//! step lists the rows that have one (`MaskRow`), and the model uploads them just before it
//! queues the sampler.
//!
//! A mixed step has both attention layouts: the prefill sections describe its prompt chunks
//! (rows `0 .. Tp`), the decode sections its decode rows (`Tp ..`, one per sequence); tokens,
//! positions, slots and the output rows cover every row in plan order, as in any step.

use super::meta_words::{Arena, Section};
use crate::ops::{SampleParamsRaw, MAX_TOP_LOGPROBS, PAGE_SIZE, PREFILL_TILE_Q, SCORE_ROW_WORDS};
use mla_core::step::plan::{slot_of, LogitsRequest, SampleRequest, SeqStep, StepKind, StepPlan};
use mla_core::step::token_mask::TokenMask;

/// A sampled row whose draw a structured-output mask restricts: row `mask_row` of the step's
/// mask table (the rows' order in `StepMeta::masks`).
#[derive(Debug, Clone)]
pub struct MaskRow {
    pub seq_id: u64,
    pub mask: TokenMask,
}

/// What the host needs to turn device results into a `StepOutput`.
#[derive(Debug, Clone)]
pub struct SeqOut {
    pub seq_id: u64,
    /// Row of the sampler outputs (= logits row) when the sequence samples.
    pub sample_row: Option<usize>,
    pub top_logprobs: Option<usize>,
    /// Logits rows to return, in order.
    pub logit_rows: Vec<usize>,
    /// Its entries among the step's scored rows (`LogitsRequest::Scored`), in order.
    pub scores: std::ops::Range<usize>,
}

/// The sections of the decode rows (the absorbed path over the paged cache).
#[derive(Debug, Clone)]
pub struct DecodeLayout {
    /// The first decode row of the step: 0, or the prompt chunks' tokens in a mixed step.
    pub row0: usize,
    /// Decode rows (= their sequences: one token each).
    pub batch: usize,
    /// Keys per sequence, the fed token included.
    pub seq_lens: Section<i32>,
    /// One word: the row stride of `block_tables` (the longest table of the step).
    pub bt_stride: Section<i32>,
    /// Room for `max_blocks_per_seq` entries per row; the first `max_pages` of each row's worth
    /// (at stride `max_pages`) are written and uploaded.
    pub block_tables: Section<i32>,
    pub max_pages: usize,
}

impl DecodeLayout {
    /// The step's rows these sections describe.
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.row0..self.row0 + self.batch
    }
}

/// One prefill pass over a window of cached keys per sequence.
#[derive(Debug, Clone)]
pub struct PassMeta {
    pub keys: usize,
    /// Cache slot of each key of the pass, sequence by sequence.
    pub slots: Section<i32>,
    /// Per sequence: the window's first row in the pass, its first position and its length.
    pub k_row0: Section<i32>,
    pub k_pos0: Section<i32>,
    pub k_len: Section<i32>,
    /// Continue from the (o, m, l) state the previous pass left.
    pub load_state: bool,
    pub last: bool,
}

/// The sections of the prompt chunks (the normal path, chunked over cached keys), which are the
/// step's first rows.
#[derive(Debug, Clone)]
pub struct PrefillLayout {
    /// Query rows and sequences of the chunks.
    pub tokens: usize,
    pub seqs: usize,
    /// Query row offsets per sequence (`seqs + 1` words) and each first query's position.
    pub cu_q: Section<i32>,
    pub q_pos0: Section<i32>,
    /// The attention tile map, heaviest tiles first: sequence and first query of each tile.
    pub tile_seq: Section<i32>,
    pub tile_q0: Section<i32>,
    pub passes: Vec<PassMeta>,
}

#[derive(Debug, Clone)]
pub enum StepLayout {
    Decode(DecodeLayout),
    Prefill(PrefillLayout),
    /// Prompt chunks first, then decode rows (`StepKind::Mixed`); a mixed plan with no rows of
    /// one kind gets the other kind's layout.
    Mixed {
        prefill: PrefillLayout,
        decode: DecodeLayout,
    },
}

#[derive(Debug, Clone)]
pub struct StepMeta {
    pub tokens: usize,
    pub seqs: usize,
    /// Uploaded whole: a decode step's words end at its used block tables, so the unused rest
    /// of the region is neither written nor copied.
    pub words: Vec<i32>,
    pub token_ids: Section<i32>,
    pub positions: Section<i32>,
    pub slots: Section<i32>,
    /// Rows of the final hidden states the output head reads: the sampled rows first (row b = the
    /// b-th sampling sequence), then the asked-for logits.
    pub logit_src: Section<i32>,
    pub sample_rows: usize,
    /// The scored rows (`LogitsRequest::Scored`), `SCORE_ROW_WORDS` words each: (logits row,
    /// token scored, alternatives).
    pub scored: Section<i32>,
    pub sampling: Section<SampleParamsRaw>,
    /// One word the model fills with the device address of `penalties` when it uploads.
    pub penalty_table: Section<u64>,
    /// Penalty entries, three words each (token, output count, seen flag); `sampling` rows index
    /// them by entry.
    pub penalties: Vec<i32>,
    /// One word the model fills with the device address of `biases` when it uploads.
    pub bias_table: Section<u64>,
    /// Logit-bias entries, two words each (token, bias as `f32` bits); rows index them by entry.
    pub biases: Vec<i32>,
    /// The masked rows, in mask-table order (`SampleParamsRaw::mask_row`).
    pub masks: Vec<MaskRow>,
    pub layout: StepLayout,
    pub outputs: Vec<SeqOut>,
}

impl StepMeta {
    pub fn kind(&self) -> StepKind {
        match &self.layout {
            StepLayout::Decode(_) => StepKind::Decode,
            StepLayout::Prefill(_) => StepKind::Prefill,
            StepLayout::Mixed { prefill, .. } => StepKind::Mixed { prefill: prefill.seqs },
        }
    }

    /// Rows of logits the output head computes.
    pub fn logit_rows(&self) -> usize {
        self.logit_src.len
    }

    /// Rows the step scores (`LogitsRequest::Scored`).
    pub fn scored_rows(&self) -> usize {
        self.scored.len / SCORE_ROW_WORDS
    }

    /// The decode rows' sections (a decode or mixed step).
    pub fn decode(&self) -> Option<&DecodeLayout> {
        match &self.layout {
            StepLayout::Decode(d) | StepLayout::Mixed { decode: d, .. } => Some(d),
            StepLayout::Prefill(_) => None,
        }
    }

    /// The prompt chunks' sections (a prefill or mixed step).
    pub fn prefill(&self) -> Option<&PrefillLayout> {
        match &self.layout {
            StepLayout::Prefill(p) | StepLayout::Mixed { prefill: p, .. } => Some(p),
            StepLayout::Decode(_) => None,
        }
    }
}

/// Size limits the metadata is checked against (from the workspace and the cache).
#[derive(Debug, Clone, Copy)]
pub struct MetaLimits {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_logit_rows: usize,
    pub max_kv_chunk: usize,
    pub max_blocks_per_seq: usize,
    pub vocab: usize,
}

impl MetaLimits {
    /// Words any decode step's metadata takes at most (its sections are bounded by the limits),
    /// plus room for the common prefill and mixed steps (one pass over cached keys). A step with
    /// prompt chunks over more cached keys than that uploads into a buffer of its own
    /// (`MetaBuffers`).
    pub fn words(&self) -> usize {
        let (t, s) = (self.max_tokens, self.max_seqs);
        // tokens/positions/slots, output rows, sampling params (16 words each), the penalty and
        // bias addresses, decode lengths and block tables, prefill offsets, tiles and key windows;
        // a few words of alignment between sections.
        3 * t
            + (1 + SCORE_ROW_WORDS) * self.max_logit_rows
            + 16 * s
            + 4
            + s
            + 1
            + s * self.max_blocks_per_seq
            + 2 * (s + 1)
            + 2 * (t / PREFILL_TILE_Q + s)
            + self.max_kv_chunk
            + 3 * s
            + 64
    }
}

/// The rows of a step: the plan's sequences, then the padding rows of a graph replay.
#[derive(Clone, Copy)]
struct Rows<'a> {
    seqs: &'a [SeqStep],
    pads: &'a [SeqStep],
}

impl<'a> Rows<'a> {
    fn len(&self) -> usize {
        self.seqs.len() + self.pads.len()
    }

    fn iter(&self) -> impl Iterator<Item = &'a SeqStep> + 'a {
        self.seqs.iter().chain(self.pads.iter())
    }
}

/// The sections every step has, before the kind's own.
struct Common {
    token_ids: Section<i32>,
    positions: Section<i32>,
    slots: Section<i32>,
    logit_src: Section<i32>,
    sample_rows: usize,
    scored: Section<i32>,
    outputs: Vec<SeqOut>,
    sampling: Section<SampleParamsRaw>,
    side: SideTables,
}

/// What `push_sampling` builds besides the parameters: the entry tables the rows index, their
/// address words, and the masked rows.
struct SideTables {
    penalty_table: Section<u64>,
    penalties: Vec<i32>,
    bias_table: Section<u64>,
    biases: Vec<i32>,
    masks: Vec<MaskRow>,
}

impl StepMeta {
    pub fn build(plan: &StepPlan, lim: &MetaLimits) -> anyhow::Result<StepMeta> {
        Self::build_rows(plan.kind, &plan.seqs, &[], lim, Vec::new())
    }

    /// `build` for a step whose rows are `seqs` followed by `pads` (decode only), written into
    /// `words`, whose contents are dropped and whose allocation is reused. Padding rows are
    /// borrowed rather than appended to a plan, so a graph replay needs no copy of the batch.
    pub fn build_rows(
        kind: StepKind,
        seqs: &[SeqStep],
        pads: &[SeqStep],
        lim: &MetaLimits,
        mut words: Vec<i32>,
    ) -> anyhow::Result<StepMeta> {
        anyhow::ensure!(pads.is_empty() || kind == StepKind::Decode, "only decode steps are padded");
        let rows = Rows { seqs, pads };
        let t: usize = rows.iter().map(|sq| sq.tokens.len()).sum();
        let s = rows.len();
        anyhow::ensure!(
            t <= lim.max_tokens,
            "step feeds {t} tokens; this backend was sized for {} (max_num_batched_tokens)",
            lim.max_tokens
        );
        anyhow::ensure!(
            s <= lim.max_seqs,
            "step has {s} sequences; this backend was sized for {} (max_num_seqs)",
            lim.max_seqs
        );
        words.clear();
        words.reserve(8 * t + 64);
        let mut a = Arena { words };
        let (token_ids, positions, slots) = push_tokens(&mut a, rows, t, lim)?;
        let OutputRows { logit_src, sample_rows, scored, outputs } = push_outputs(&mut a, rows, lim)?;
        let (sampling, side) = push_sampling(&mut a, rows, sample_rows, lim)?;
        let common = Common { token_ids, positions, slots, logit_src, sample_rows, scored, outputs, sampling, side };
        let layout = push_layout(&mut a, kind, rows, t, lim)?;
        Ok(StepMeta {
            tokens: t,
            seqs: s,
            words: a.words,
            token_ids: common.token_ids,
            positions: common.positions,
            slots: common.slots,
            logit_src: common.logit_src,
            sample_rows: common.sample_rows,
            scored: common.scored,
            sampling: common.sampling,
            penalty_table: common.side.penalty_table,
            penalties: common.side.penalties,
            bias_table: common.side.bias_table,
            biases: common.side.biases,
            masks: common.side.masks,
            layout,
            outputs: common.outputs,
        })
    }
}

/// Token ids, positions and cache slots: three sections of `t` words.
fn push_tokens(
    a: &mut Arena,
    rows: Rows,
    t: usize,
    lim: &MetaLimits,
) -> anyhow::Result<(Section<i32>, Section<i32>, Section<i32>)> {
    let (ids, pos, slot) = (a.section::<i32>(t), a.section::<i32>(t), a.section::<i32>(t));
    let mut k = 0;
    for sq in rows.iter() {
        anyhow::ensure!(
            sq.block_table.len() <= lim.max_blocks_per_seq,
            "sequence {}: {} blocks exceed max_model_len",
            sq.seq_id,
            sq.block_table.len()
        );
        for (i, &tk) in sq.tokens.iter().enumerate() {
            let p = sq.context_len + i;
            a.words[ids.off + k] = tk as i32;
            a.words[pos.off + k] = p as i32;
            a.words[slot.off + k] = slot_of(&sq.block_table, PAGE_SIZE, p) as i32;
            k += 1;
        }
    }
    Ok((ids, pos, slot))
}

/// What `push_outputs` lays out (`StepMeta`'s fields of the same names).
struct OutputRows {
    logit_src: Section<i32>,
    sample_rows: usize,
    scored: Section<i32>,
    outputs: Vec<SeqOut>,
}

/// The rows the output head reads: every sampling sequence's last row first, then the asked-for
/// logits rows (a sampled row that also wants its logits is not repeated; scored rows are
/// computed like `All` rows but scored on the device rather than returned); then the scored rows.
fn push_outputs(a: &mut Arena, rows: Rows, lim: &MetaLimits) -> anyhow::Result<OutputRows> {
    let mut src: Vec<i32> = Vec::new();
    let mut outputs: Vec<SeqOut> = Vec::with_capacity(rows.len());
    let mut first_row = 0;
    for sq in rows.iter() {
        let sample_row = sq.sample.as_ref().map(|_| {
            src.push((first_row + sq.tokens.len() - 1) as i32);
            src.len() - 1
        });
        let top_logprobs = sq.sample.as_ref().and_then(|r| r.top_logprobs);
        outputs.push(SeqOut { seq_id: sq.seq_id, sample_row, top_logprobs, logit_rows: vec![], scores: 0..0 });
        first_row += sq.tokens.len();
    }
    let sample_rows = src.len();
    let mut scored: Vec<i32> = Vec::new();
    first_row = 0;
    for (o, sq) in outputs.iter_mut().zip(rows.iter()) {
        let last = first_row + sq.tokens.len() - 1;
        let mut push = |r: usize| {
            src.push(r as i32);
            src.len() - 1
        };
        o.logit_rows = match sq.logits {
            LogitsRequest::None | LogitsRequest::Scored { .. } => vec![],
            LogitsRequest::Last => vec![o.sample_row.unwrap_or_else(|| push(last))],
            LogitsRequest::All => (first_row..=last).map(&mut push).collect(),
        };
        if let LogitsRequest::Scored { top, after } = sq.logits {
            let first = scored.len() / SCORE_ROW_WORDS;
            let next = sq.tokens.iter().skip(1).copied().chain(after);
            for (r, token) in (first_row..=last).zip(next) {
                scored.extend([push(r) as i32, token as i32, top as i32]);
            }
            o.scores = first..scored.len() / SCORE_ROW_WORDS;
        }
        first_row += sq.tokens.len();
    }
    anyhow::ensure!(
        src.len() <= lim.max_logit_rows,
        "step asks for {} rows of logits; this backend was sized for {}",
        src.len(),
        lim.max_logit_rows
    );
    let logit_src = a.push(&src);
    Ok(OutputRows { logit_src, sample_rows, scored: a.push(&scored), outputs })
}

/// The sampling parameters of every sampling row, the penalty and bias address words, the
/// penalty entries (unique tokens of each penalised history), the bias entries, and the rows
/// with a structured-output mask.
fn push_sampling(
    a: &mut Arena,
    rows: Rows,
    sample_rows: usize,
    lim: &MetaLimits,
) -> anyhow::Result<(Section<SampleParamsRaw>, SideTables)> {
    let params = a.section::<SampleParamsRaw>(sample_rows);
    let penalty_table = a.section::<u64>(1);
    let bias_table = a.section::<u64>(1);
    let mut pen: Vec<i32> = Vec::new();
    let mut biases: Vec<i32> = Vec::new();
    let mut masks: Vec<MaskRow> = Vec::new();
    let mut history: Vec<(u32, bool)> = Vec::new();
    let sampled = rows.iter().filter_map(|sq| sq.sample.as_ref().map(|r| (sq.seq_id, r)));
    for (row, (seq_id, req)) in sampled.enumerate() {
        let pen_begin = (pen.len() / 3) as i32;
        if req.params.has_penalties() {
            if let Some(h) = &req.penalty {
                penalty_entries(&h.prompt, &h.output, lim.vocab, &mut history, &mut pen);
            }
        }
        let bias_begin = (biases.len() / 2) as i32;
        bias_entries(&req.logit_bias, lim.vocab, &mut biases);
        let mask_row = match &req.allowed {
            Some(mask) => {
                masks.push(MaskRow { seq_id, mask: mask.clone() });
                masks.len() as i32 - 1
            }
            None => -1,
        };
        let ranges = EntryRanges {
            pen: (pen_begin, (pen.len() / 3) as i32),
            bias: (bias_begin, (biases.len() / 2) as i32),
            mask_row,
        };
        let raw = sample_params(seq_id, req, lim.vocab, ranges)?;
        a.set(params, row, &raw);
    }
    Ok((params, SideTables { penalty_table, penalties: pen, bias_table, biases, masks }))
}

/// Where one row's entries sit in the step's tables.
struct EntryRanges {
    pen: (i32, i32),
    bias: (i32, i32),
    mask_row: i32,
}

/// One row's parameters as the sampler kernel reads them.
fn sample_params(seq_id: u64, req: &SampleRequest, vocab: usize, at: EntryRanges) -> anyhow::Result<SampleParamsRaw> {
    let p = &req.params;
    let n_logprobs = match req.top_logprobs {
        Some(k) if k > MAX_TOP_LOGPROBS => {
            anyhow::bail!(
                "sequence {seq_id}: {k} top logprobs requested; the CUDA sampler returns at most {MAX_TOP_LOGPROBS}"
            )
        }
        Some(k) => k as i32,
        None => -1,
    };
    let top_k = match p.top_k {
        Some(k) if k.max(1) < vocab => k.max(1) as i32,
        _ => 0,
    };
    Ok(SampleParamsRaw {
        temperature: p.temperature,
        top_p: p.top_p,
        min_p: p.min_p,
        top_k,
        repetition_penalty: p.repetition_penalty,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        n_logprobs,
        seed: req.seed,
        pen_begin: at.pen.0,
        pen_end: at.pen.1,
        bias_begin: at.bias.0,
        bias_end: at.bias.1,
        mask_row: at.mask_row,
        forced_token: -1,
    })
}

/// Appends one request's logit-bias entries, two words each (token, bias as `f32` bits), in the
/// request's order (sorted, each token once); tokens outside the vocabulary are dropped, as the
/// host sampler ignores them.
/// A list that breaks that promise is sorted and its repeats summed here, since the kernel adds
/// a row's entries in parallel and two entries of one token would race.
fn bias_entries(bias: &[(u32, f32)], vocab: usize, out: &mut Vec<i32>) {
    let mut push = |tk: u32, b: f32| {
        if (tk as usize) < vocab {
            out.extend_from_slice(&[tk as i32, b.to_bits() as i32]);
        }
    };
    if bias.windows(2).all(|w| w[0].0 < w[1].0) {
        bias.iter().for_each(|&(tk, b)| push(tk, b));
        return;
    }
    let mut sorted = bias.to_vec();
    sorted.sort_by_key(|e| e.0);
    for run in sorted.chunk_by(|x, y| x.0 == y.0) {
        push(run[0].0, run.iter().map(|e| e.1).sum());
    }
}

/// Appends the penalty entries of one history, three words each (token, occurrences in the
/// output, seen flag), one per distinct token of prompt and output inside the vocabulary, in
/// token order. `scratch` is reused between rows.
fn penalty_entries(prompt: &[u32], output: &[u32], vocab: usize, scratch: &mut Vec<(u32, bool)>, pen: &mut Vec<i32>) {
    scratch.clear();
    scratch.extend(prompt.iter().map(|&tk| (tk, false)));
    scratch.extend(output.iter().map(|&tk| (tk, true)));
    scratch.retain(|&(tk, _)| (tk as usize) < vocab);
    scratch.sort_unstable();
    for run in scratch.chunk_by(|x, y| x.0 == y.0) {
        let in_output = run.iter().filter(|e| e.1).count() as i32;
        pen.extend_from_slice(&[run[0].0 as i32, in_output, 1]);
    }
}

/// The attention sections of a step of `t` tokens: the prompt chunks' (the leading sequences
/// `kind` names), then the decode rows' (the rest, and the padding rows).
fn push_layout(a: &mut Arena, kind: StepKind, rows: Rows, t: usize, lim: &MetaLimits) -> anyhow::Result<StepLayout> {
    let p = match kind {
        StepKind::Prefill => rows.seqs.len(),
        StepKind::Decode => 0,
        StepKind::Mixed { prefill } => prefill,
    };
    anyhow::ensure!(p <= rows.seqs.len(), "a mixed step names {p} prompt chunks but has {} sequences", rows.seqs.len());
    let (chunks, decode_seqs) = rows.seqs.split_at(p);
    let decode = Rows { seqs: decode_seqs, pads: rows.pads };
    let tp: usize = chunks.iter().map(|sq| sq.tokens.len()).sum();
    // The decode sections address row `tp + b` as decode row b: only right if each feeds one.
    anyhow::ensure!(t - tp == decode.len(), "the {} decode rows of a step feed {} tokens", decode.len(), t - tp);
    Ok(if kind == StepKind::Prefill || (p > 0 && decode.len() == 0) {
        StepLayout::Prefill(push_prefill_tiles(a, chunks, lim))
    } else if p == 0 {
        StepLayout::Decode(push_decode_tables(a, decode, 0, lim))
    } else {
        let prefill = push_prefill_tiles(a, chunks, lim);
        StepLayout::Mixed { prefill, decode: push_decode_tables(a, decode, tp, lim) }
    })
}

/// The decode sections of `rows`, the step's rows from `row0` on, at offsets that depend only on
/// the batch size in a decode step (see the module comment). The words end at the used
/// block-table rows: the rest of the region is neither zeroed nor copied.
fn push_decode_tables(a: &mut Arena, rows: Rows, row0: usize, lim: &MetaLimits) -> DecodeLayout {
    let s = rows.len();
    let lens: Vec<i32> = rows.iter().map(|sq| sq.end_pos() as i32).collect();
    let seq_lens = a.push(&lens);
    let stride = rows.iter().map(|sq| sq.end_pos().div_ceil(PAGE_SIZE)).max().unwrap_or(1).max(1);
    let bt_stride = a.push(&[stride as i32]);
    let block_tables = a.section::<i32>(s * lim.max_blocks_per_seq);
    for (b, sq) in rows.iter().enumerate() {
        let n = sq.end_pos().div_ceil(PAGE_SIZE);
        let row = &mut a.words[block_tables.off + b * stride..][..n];
        for (w, &blk) in row.iter_mut().zip(&sq.block_table[..n]) {
            *w = blk as i32;
        }
    }
    a.words.truncate(block_tables.off + s * stride);
    DecodeLayout { row0, batch: s, seq_lens, bt_stride, block_tables, max_pages: stride }
}

/// The prefill sections: query offsets and positions, the tile map (heaviest tiles first: the
/// attention grid starts the longest causal rows first and the short ones fill the last wave,
/// instead of a long tile starting last), and the passes over cached keys.
fn push_prefill_tiles(a: &mut Arena, seqs: &[SeqStep], lim: &MetaLimits) -> PrefillLayout {
    let mut cu = vec![0i32];
    let mut qp0 = Vec::with_capacity(seqs.len());
    // (keys the tile's last query sees, sequence, first row)
    let mut tiles = Vec::new();
    for (i, sq) in seqs.iter().enumerate() {
        cu.push(cu[i] + sq.tokens.len() as i32);
        qp0.push(sq.context_len as i32);
        for q0 in (0..sq.tokens.len()).step_by(PREFILL_TILE_Q) {
            let last = (q0 + PREFILL_TILE_Q).min(sq.tokens.len());
            tiles.push((sq.context_len + last, i as i32, q0 as i32));
        }
    }
    tiles.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let tile_seq: Vec<i32> = tiles.iter().map(|t| t.1).collect();
    let tile_q0: Vec<i32> = tiles.iter().map(|t| t.2).collect();
    PrefillLayout {
        tokens: cu[seqs.len()] as usize,
        seqs: seqs.len(),
        cu_q: a.push(&cu),
        q_pos0: a.push(&qp0),
        tile_seq: a.push(&tile_seq),
        tile_q0: a.push(&tile_q0),
        passes: push_passes(a, seqs, lim.max_kv_chunk),
    }
}

/// Splits every sequence's keys `0 .. end_pos` into windows so that one pass decompresses at most
/// `cap` keys; a sequence has at most one window per pass, windows in position order.
fn push_passes(a: &mut Arena, seqs: &[SeqStep], cap: usize) -> Vec<PassMeta> {
    let s = seqs.len();
    struct Window {
        row0: i32,
        pos0: i32,
        len: i32,
    }
    let mut passes: Vec<Vec<Option<Window>>> = vec![];
    let mut pass_slots: Vec<Vec<i32>> = vec![];
    let mut cur: Vec<Option<Window>> = (0..s).map(|_| None).collect();
    let mut cur_slots: Vec<i32> = vec![];
    for (i, sq) in seqs.iter().enumerate() {
        let end = sq.end_pos();
        let mut p = 0;
        while p < end {
            if cur_slots.len() == cap || cur[i].is_some() {
                passes.push(std::mem::replace(&mut cur, (0..s).map(|_| None).collect()));
                pass_slots.push(std::mem::take(&mut cur_slots));
            }
            let take = (end - p).min(cap - cur_slots.len());
            cur[i] = Some(Window { row0: cur_slots.len() as i32, pos0: p as i32, len: take as i32 });
            for q in p..p + take {
                cur_slots.push(slot_of(&sq.block_table, PAGE_SIZE, q) as i32);
            }
            p += take;
        }
    }
    passes.push(cur);
    pass_slots.push(cur_slots);
    let n = passes.len();
    passes
        .into_iter()
        .zip(pass_slots)
        .enumerate()
        .map(|(j, (wins, slots))| {
            let field = |f: fn(&Window) -> i32| -> Vec<i32> { wins.iter().map(|w| w.as_ref().map_or(0, f)).collect() };
            PassMeta {
                keys: slots.len(),
                slots: a.push(&slots),
                k_row0: a.push(&field(|w| w.row0)),
                k_pos0: a.push(&field(|w| w.pos0)),
                k_len: a.push(&field(|w| w.len)),
                load_state: j > 0,
                last: j + 1 == n,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::step::plan::{PenaltyTokens, SampleRequest};
    use mla_core::SamplingParams;

    fn seq(id: u64, ctx: usize, n: usize, table: Vec<u32>) -> SeqStep {
        SeqStep {
            fork: None,
            seq_id: id,
            tokens: vec![3; n],
            context_len: ctx,
            block_table: table,
            logits: LogitsRequest::None,
            sample: None,
            mtp: None,
        }
    }

    fn lim() -> MetaLimits {
        MetaLimits {
            max_tokens: 256,
            max_seqs: 8,
            max_logit_rows: 64,
            max_kv_chunk: 100,
            max_blocks_per_seq: 8,
            vocab: 512,
        }
    }

    /// One value of an i32 section.
    fn at(m: &StepMeta, s: Section<i32>, i: usize) -> i32 {
        s.read(&m.words)[i]
    }

    #[test]
    fn passes_cover_every_key_once_in_position_order() {
        let plan =
            StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, 70, 10, vec![5, 2]), seq(2, 0, 90, vec![7, 1])] };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        let p = m.prefill().unwrap();
        // 80 + 90 keys with a cap of 100: [s1 0..80, s2 0..20], [s2 20..90].
        assert_eq!(p.passes.len(), 2);
        let p0 = &p.passes[0];
        assert_eq!(
            (p0.keys, at(&m, p0.k_len, 0), at(&m, p0.k_len, 1), at(&m, p0.k_pos0, 1), at(&m, p0.k_row0, 1)),
            (100, 80, 20, 0, 80)
        );
        let p1 = &p.passes[1];
        assert_eq!(
            (p1.keys, at(&m, p1.k_len, 0), at(&m, p1.k_len, 1), at(&m, p1.k_pos0, 1), at(&m, p1.k_row0, 1)),
            (70, 0, 70, 20, 0)
        );
        assert!(p1.load_state && p1.last && !p0.load_state && !p0.last);
        // Position 64 of sequence 1 lives in its second block (2), offset 0.
        assert_eq!(at(&m, p0.slots, 64), 2 * 64);
        // Tiles of 128 queries: one per sequence, the one whose last query sees more keys first
        // (sequence 2: 90 keys; sequence 1: 70 + 10 = 80).
        assert_eq!(p.tile_seq.len, 2);
        assert_eq!(
            (at(&m, p.tile_seq, 0), at(&m, p.tile_seq, 1), at(&m, p.tile_q0, 0), at(&m, p.tile_q0, 1)),
            (1, 0, 0, 0)
        );
    }

    #[test]
    fn decode_offsets_depend_only_on_the_batch_size() {
        let a = StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 5, 1, vec![0]), seq(2, 130, 1, vec![3, 4, 6])] };
        let b =
            StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 300, 1, vec![0, 1, 2, 3, 4]), seq(2, 1, 1, vec![3])] };
        let (ma, mb) = (StepMeta::build(&a, &lim()).unwrap(), StepMeta::build(&b, &lim()).unwrap());
        let (da, db) = (ma.decode().unwrap(), mb.decode().unwrap());
        assert_eq!(
            (da.block_tables.off, ma.penalty_table, ma.sampling.off, da.seq_lens.off),
            (db.block_tables.off, mb.penalty_table, mb.sampling.off, db.seq_lens.off)
        );
        assert_eq!(at(&ma, da.bt_stride, 0), 3);
        assert_eq!(&ma.words[da.block_tables.off + 3..da.block_tables.off + 6], &[3, 4, 6]);
        assert_eq!(at(&ma, da.seq_lens, 1), 131);
    }

    #[test]
    fn mixed_steps_give_the_chunks_their_rows_and_the_decode_rows_theirs() {
        // Chunks of 10 (after 70 cached) and 3 tokens on rows 0..13, then two decode rows.
        let seqs = vec![
            seq(1, 70, 10, vec![5, 2]),
            seq(2, 0, 3, vec![7]),
            sampled(seq(3, 130, 1, vec![3, 4, 6]), None),
            sampled(seq(4, 5, 1, vec![0]), None),
        ];
        let plan = StepPlan { kind: StepKind::Mixed { prefill: 2 }, seqs };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        assert_eq!((m.kind(), m.tokens, m.seqs), (StepKind::Mixed { prefill: 2 }, 15, 4));
        let (p, d) = (m.prefill().unwrap(), m.decode().unwrap());
        assert_eq!((p.tokens, p.seqs), (13, 2));
        assert_eq!((p.cu_q.read(&m.words), p.q_pos0.read(&m.words)), (vec![0, 10, 13], vec![70, 0]));
        // The tiles and key windows are the chunks' alone: 80 + 3 keys in one pass.
        assert_eq!((p.tile_seq.len, p.passes.len(), p.passes[0].keys, p.passes[0].k_len.len), (2, 1, 83, 2));
        assert_eq!((d.row0, d.batch, d.rows()), (13, 2, 13..15));
        assert_eq!((d.seq_lens.read(&m.words), at(&m, d.bt_stride, 0)), (vec![131, 6], 3));
        assert_eq!(&m.words[d.block_tables.off..], &[3, 4, 6, 0, 0, 0]);
        // Positions and slots cover every row; the decode rows' part is what their rope reads
        // (position 130 is offset 2 of the third block, 6).
        assert_eq!(m.positions.read(&m.words)[..3], [70, 71, 72]);
        assert_eq!(m.positions.sub(10, 3).read(&m.words), vec![0, 1, 2]);
        assert_eq!(m.positions.sub(d.row0, d.batch).read(&m.words), vec![130, 5]);
        assert_eq!(m.slots.sub(d.row0, d.batch).read(&m.words), vec![6 * 64 + 2, 5]);
        // The sampled rows are the decode rows, by their place among all rows.
        assert_eq!((m.sample_rows, m.logit_src.read(&m.words)), (2, vec![13, 14]));
        assert!(m.words.len() <= lim().words());
    }

    #[test]
    fn a_mixed_plan_of_one_kind_gets_that_kinds_layout() {
        let rows = || vec![seq(1, 4, 3, vec![0]), seq(2, 9, 1, vec![1])];
        let build = |prefill, seqs| StepMeta::build(&StepPlan { kind: StepKind::Mixed { prefill }, seqs }, &lim());
        assert_eq!(build(2, rows()).unwrap().kind(), StepKind::Prefill);
        assert_eq!(build(0, vec![seq(1, 4, 1, vec![0]), seq(2, 9, 1, vec![1])]).unwrap().kind(), StepKind::Decode);
        // Decode rows feeding more than one token would shift every later row's sections.
        assert!(build(0, rows()).is_err());
        assert!(build(3, rows()).is_err());
    }

    fn sampled(mut s: SeqStep, penalty: Option<PenaltyTokens>) -> SeqStep {
        s.sample = Some(SampleRequest {
            params: SamplingParams {
                repetition_penalty: if penalty.is_some() { 1.2 } else { 1.0 },
                ..SamplingParams::default()
            },
            seed: 9,
            top_logprobs: None,
            penalty,
            logit_bias: Vec::new(),
            allowed: None,
        });
        s
    }

    #[test]
    fn penalty_entries_are_the_distinct_tokens_with_output_counts() {
        // Vocabulary 512: token 700 is dropped. Distinct tokens 3, 5, 9; in the output 3 twice
        // and 9 once; every entry is "seen".
        let history = PenaltyTokens { prompt: vec![5, 3, 5, 700], output: vec![3, 9, 3] };
        let plan = StepPlan {
            kind: StepKind::Decode,
            seqs: vec![sampled(seq(1, 7, 1, vec![0]), Some(history)), sampled(seq(2, 7, 1, vec![1]), None)],
        };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        assert_eq!(&m.penalties, &[3, 2, 1, 5, 0, 1, 9, 1, 1]);
        // pen_begin / pen_end of each row.
        let params = m.sampling.read(&m.words);
        let row = |r: usize| (params[r].pen_begin, params[r].pen_end);
        assert_eq!((row(0), row(1)), ((0, 3), (3, 3)));
        // The entries live in their own buffer: the words end at the used block tables.
        let d = m.decode().unwrap();
        assert_eq!(m.words.len(), d.block_tables.off + 2);
    }

    #[test]
    fn bias_entries_and_mask_rows_are_packed_per_row() {
        use mla_core::step::token_mask::TokenMask;
        // Row 0: bias on 2 tokens plus one outside the vocabulary (dropped) and a mask; row 1:
        // nothing; row 2: a -inf bias (min_tokens) and a mask still being computed.
        let mut a = sampled(seq(1, 7, 1, vec![0]), None);
        let r = a.sample.as_mut().unwrap();
        r.logit_bias = vec![(4, 2.5), (9, -100.0), (900, 1.0)];
        r.allowed = Some(TokenMask::ready(vec![u32::MAX; 16]));
        let b = sampled(seq(2, 7, 1, vec![1]), None);
        let mut c = sampled(seq(3, 7, 1, vec![2]), None);
        let (pending, _writer) = TokenMask::pending();
        let r = c.sample.as_mut().unwrap();
        r.logit_bias = vec![(1, f32::NEG_INFINITY)];
        r.allowed = Some(pending);
        let plan = StepPlan { kind: StepKind::Decode, seqs: vec![a, b, c] };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        let bits = |x: f32| x.to_bits() as i32;
        assert_eq!(m.biases, vec![4, bits(2.5), 9, bits(-100.0), 1, bits(f32::NEG_INFINITY)]);
        let params = m.sampling.read(&m.words);
        let row = |r: usize| (params[r].bias_begin, params[r].bias_end, params[r].mask_row);
        assert_eq!((row(0), row(1), row(2)), ((0, 2, 0), (2, 2, -1), (2, 3, 1)));
        assert_eq!(m.masks.iter().map(|x| x.seq_id).collect::<Vec<_>>(), vec![1, 3]);
        assert!(params.iter().all(|p| p.forced_token == -1 && p.pen_begin == p.pen_end));
        // The bias address word sits next to the penalty one, at offsets that depend only on
        // the batch size (a captured graph reads both).
        assert_eq!(m.bias_table.off, m.penalty_table.off + 2);
        let plain =
            StepPlan { kind: StepKind::Decode, seqs: (1..4).map(|i| sampled(seq(i, 7, 1, vec![0]), None)).collect() };
        let mp = StepMeta::build(&plain, &lim()).unwrap();
        assert_eq!((mp.bias_table, mp.sampling.off), (m.bias_table, m.sampling.off));
        assert!(mp.biases.is_empty() && mp.masks.is_empty());
        assert!(mp.sampling.read(&mp.words).iter().all(|p| p.mask_row == -1 && p.bias_begin == p.bias_end));
    }

    #[test]
    fn unsorted_or_repeated_bias_entries_are_merged() {
        let mut out = Vec::new();
        bias_entries(&[(7, 1.0), (3, 2.0), (7, 0.5)], 512, &mut out);
        assert_eq!(out, vec![3, 2f32.to_bits() as i32, 7, 1.5f32.to_bits() as i32]);
    }

    #[test]
    fn decode_without_penalties_stops_at_the_used_block_tables() {
        let plan = StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 70, 1, vec![4, 2]), seq(2, 3, 1, vec![6])] };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        let d = m.decode().unwrap();
        // Two rows of stride 2 (71 positions need two blocks); the second row's unused entry is 0.
        assert_eq!(&m.words[d.block_tables.off..], &[4, 2, 6, 0]);
        assert_eq!(m.words.len(), d.block_tables.off + 4);
        assert!(m.penalties.is_empty());
        // The region has room for every row at the longest table the limits allow.
        assert_eq!(d.block_tables.len, 2 * lim().max_blocks_per_seq);
    }

    #[test]
    fn borrowed_padding_rows_equal_appended_ones() {
        let seqs = vec![sampled(seq(1, 70, 1, vec![4, 2]), None), sampled(seq(2, 3, 1, vec![6]), None)];
        let pads: Vec<SeqStep> = (0..3).map(|i| sampled(seq(100 + i, 0, 1, vec![7]), None)).collect();
        let appended = StepPlan { kind: StepKind::Decode, seqs: seqs.iter().chain(&pads).cloned().collect() };
        let want = StepMeta::build(&appended, &lim()).unwrap();
        // A dirty, too short buffer to reuse: its contents must not leak into the result.
        let got = StepMeta::build_rows(StepKind::Decode, &seqs, &pads, &lim(), vec![-1; 7]).unwrap();
        assert_eq!((got.seqs, got.sample_rows), (5, 5));
        assert_eq!(got.words, want.words);
        let ids = |m: &StepMeta| m.outputs.iter().map(|o| (o.seq_id, o.sample_row)).collect::<Vec<_>>();
        assert_eq!(ids(&got), ids(&want));
        assert!(StepMeta::build_rows(StepKind::Prefill, &seqs, &pads, &lim(), vec![]).is_err());
    }

    #[test]
    fn decode_metadata_fits_the_words_the_limits_promise() {
        // The fullest decode step: every sequence at the longest context, sampling with logits.
        let l = lim();
        let full = |i: u64| {
            let mut s = sampled(seq(i, 8 * 64 - 1, 1, (0..8).collect()), None);
            s.logits = LogitsRequest::Last;
            s
        };
        let plan = StepPlan { kind: StepKind::Decode, seqs: (0..8).map(full).collect() };
        let m = StepMeta::build(&plan, &l).unwrap();
        let d = m.decode().unwrap();
        assert!(d.block_tables.words().end <= l.words(), "{} > {}", d.block_tables.words().end, l.words());
    }
}
