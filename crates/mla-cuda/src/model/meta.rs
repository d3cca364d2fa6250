//! Per-step metadata: everything a step's kernels read besides weights, cache and activations,
//! built on the host from a `StepPlan` into one array of 32-bit words and uploaded with at most
//! two copies. Decode steps use a layout whose offsets depend only on the batch size, so a CUDA
//! graph captured for that size stays valid: what changes between steps (tokens, lengths, block
//! tables, sampling parameters) is data the kernels read, never a launch argument.

use crate::ops::{SampleParamsRaw, MAX_TOP_LOGPROBS, PAGE_SIZE};
use mla_core::plan::{slot_of, LogitsRequest, SeqStep, StepKind, StepPlan};

/// One prefill pass over a window of cached keys per sequence.
#[derive(Debug, Clone)]
pub struct PassMeta {
    pub keys: usize,
    pub slots: usize,
    pub k_row0: usize,
    pub k_pos0: usize,
    pub k_len: usize,
    pub load_state: bool,
    pub last: bool,
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
}

#[derive(Debug, Clone)]
pub struct StepMeta {
    pub kind: StepKind,
    pub tokens: usize,
    pub seqs: usize,
    pub words: Vec<i32>,
    /// Word ranges of `words` to upload (decode skips the unused part of the block-table region).
    pub upload: Vec<(usize, usize)>,
    pub tok: usize,
    pub pos: usize,
    pub slot: usize,
    // Prefill.
    pub cu_q: usize,
    pub q_pos0: usize,
    pub tiles: usize,
    pub tile_seq: usize,
    pub tile_q0: usize,
    pub passes: Vec<PassMeta>,
    // Decode.
    pub seq_lens: usize,
    pub bt_stride: usize,
    pub block_tables: usize,
    pub max_pages: usize,
    // Output head and sampling.
    pub logit_rows: usize,
    pub logit_src: usize,
    pub sample_rows: usize,
    pub params: usize,
    /// Penalty entries, three words each (token, output count, seen flag).
    pub pen: usize,
    pub outputs: Vec<SeqOut>,
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

struct Arena {
    words: Vec<i32>,
}

impl Arena {
    fn push(&mut self, v: &[i32]) -> usize {
        let off = self.words.len();
        self.words.extend_from_slice(v);
        off
    }
    fn reserve(&mut self, n: usize) -> usize {
        let off = self.words.len();
        self.words.resize(off + n, 0);
        off
    }
    fn align2(&mut self) {
        if self.words.len() % 2 == 1 {
            self.words.push(0);
        }
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
        // Tokens, positions and slots: three sections of `t` words.
        let tok = a.reserve(3 * t);
        let (pos, slot) = (tok + t, tok + 2 * t);
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
                a.words[tok + k] = tk as i32;
                a.words[pos + k] = p as i32;
                a.words[slot + k] = slot_of(&sq.block_table, PAGE_SIZE, p) as i32;
                k += 1;
            }
        }

        let mut m = StepMeta {
            kind,
            tokens: t,
            seqs: s,
            words: vec![],
            upload: vec![],
            tok,
            pos,
            slot,
            cu_q: 0,
            q_pos0: 0,
            tiles: 0,
            tile_seq: 0,
            tile_q0: 0,
            passes: vec![],
            seq_lens: 0,
            bt_stride: 0,
            block_tables: 0,
            max_pages: 0,
            logit_rows: 0,
            logit_src: 0,
            sample_rows: 0,
            params: 0,
            pen: 0,
            outputs: vec![],
        };

        // Output rows, written straight into their section: sampled rows first (row b = b-th
        // sampling sequence), then asked-for logits.
        let src = a.words.len();
        let mut outputs: Vec<SeqOut> = Vec::with_capacity(s);
        let mut first_row = 0;
        for sq in rows.iter() {
            let sample_row = sq.sample.as_ref().map(|_| {
                a.words.push((first_row + sq.tokens.len() - 1) as i32);
                a.words.len() - 1 - src
            });
            outputs.push(SeqOut {
                seq_id: sq.seq_id,
                sample_row,
                top_logprobs: sq.sample.as_ref().and_then(|r| r.top_logprobs),
                logit_rows: vec![],
            });
            first_row += sq.tokens.len();
        }
        let sample_rows = a.words.len() - src;
        first_row = 0;
        for (o, sq) in outputs.iter_mut().zip(rows.iter()) {
            let last = first_row + sq.tokens.len() - 1;
            let mut push = |r: usize| {
                a.words.push(r as i32);
                a.words.len() - 1 - src
            };
            o.logit_rows = match sq.logits {
                LogitsRequest::None => vec![],
                LogitsRequest::Last => vec![o.sample_row.unwrap_or_else(|| push(last))],
                LogitsRequest::All => (first_row..=last).map(push).collect(),
            };
            first_row += sq.tokens.len();
        }
        let logit_rows = a.words.len() - src;
        anyhow::ensure!(
            logit_rows <= lim.max_logit_rows,
            "step asks for {logit_rows} rows of logits; this backend was sized for {}",
            lim.max_logit_rows
        );
        m.logit_rows = logit_rows;
        m.sample_rows = sample_rows;
        m.logit_src = src;

        // Sampling parameters and penalty entries (unique tokens of the history).
        a.align2();
        m.params = a.reserve(sample_rows * 12);
        let mut pen: Vec<i32> = Vec::new();
        let mut history: Vec<(u32, bool)> = Vec::new();
        let mut row = 0;
        for sq in rows.iter() {
            let Some(req) = &sq.sample else { continue };
            let p = &req.params;
            let n_logprobs = match req.top_logprobs {
                Some(k) if k > MAX_TOP_LOGPROBS => anyhow::bail!(
                    "sequence {}: {k} top logprobs requested; the CUDA sampler returns at most {MAX_TOP_LOGPROBS}",
                    sq.seq_id
                ),
                Some(k) => k as i32,
                None => -1,
            };
            let top_k = match p.top_k {
                Some(k) if k.max(1) < lim.vocab => k.max(1) as i32,
                _ => 0,
            };
            let begin = (pen.len() / 3) as i32;
            if p.has_penalties() {
                if let Some(h) = &req.penalty {
                    penalty_entries(&h.prompt, &h.output, lim.vocab, &mut history, &mut pen);
                }
            }
            let raw = SampleParamsRaw {
                temperature: p.temperature,
                top_p: p.top_p,
                min_p: p.min_p,
                top_k,
                repetition_penalty: p.repetition_penalty,
                frequency_penalty: p.frequency_penalty,
                presence_penalty: p.presence_penalty,
                n_logprobs,
                seed: req.seed,
                pen_begin: begin,
                pen_end: (pen.len() / 3) as i32,
            };
            // SAFETY: SampleParamsRaw is repr(C), 48 bytes of plain 4/8-byte fields.
            let w: [i32; 12] = unsafe { std::mem::transmute(raw) };
            a.words[m.params + 12 * row..m.params + 12 * row + 12].copy_from_slice(&w);
            row += 1;
        }

        match kind {
            StepKind::Decode => {
                // Fixed offsets for a given batch size (see the module comment).
                m.seq_lens = a.words.len();
                a.words.extend(rows.iter().map(|sq| sq.end_pos() as i32));
                let stride = rows.iter().map(|sq| sq.end_pos().div_ceil(PAGE_SIZE)).max().unwrap_or(1).max(1);
                m.max_pages = stride;
                m.bt_stride = a.push(&[stride as i32]);
                // The block-table region holds `max_blocks_per_seq` entries per row; only the
                // first `stride` of each row's worth are written and uploaded.
                m.block_tables = a.reserve(s * stride);
                for (b, sq) in rows.iter().enumerate() {
                    let n = sq.end_pos().div_ceil(PAGE_SIZE);
                    let row = &mut a.words[m.block_tables + b * stride..][..n];
                    for (w, &blk) in row.iter_mut().zip(&sq.block_table[..n]) {
                        *w = blk as i32;
                    }
                }
                let used_end = m.block_tables + s * stride;
                let pen_start = m.block_tables + s * lim.max_blocks_per_seq;
                m.pen = pen_start;
                m.upload = vec![(0, used_end)];
                // Without penalties the words end with the used tables: the unused rest of the
                // region is neither zeroed nor copied.
                if !pen.is_empty() {
                    a.words.resize(pen_start, 0);
                    a.push(&pen);
                    m.upload.push((pen_start, a.words.len()));
                }
            }
            StepKind::Prefill => {
                let mut cu = vec![0i32];
                let mut qp0 = Vec::with_capacity(s);
                // (keys the tile's last query sees, sequence, first row)
                let mut tiles = Vec::new();
                for (i, sq) in seqs.iter().enumerate() {
                    cu.push(cu[i] + sq.tokens.len() as i32);
                    qp0.push(sq.context_len as i32);
                    for q0 in (0..sq.tokens.len()).step_by(crate::ops::PREFILL_TILE_Q) {
                        let last = (q0 + crate::ops::PREFILL_TILE_Q).min(sq.tokens.len());
                        tiles.push((sq.context_len + last, i as i32, q0 as i32));
                    }
                }
                // Heaviest tiles first: the attention grid starts the longest causal rows first and
                // the short ones fill the last wave, instead of a long tile starting last.
                tiles.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
                let tile_seq: Vec<i32> = tiles.iter().map(|t| t.1).collect();
                let tile_q0: Vec<i32> = tiles.iter().map(|t| t.2).collect();
                m.cu_q = a.push(&cu);
                m.q_pos0 = a.push(&qp0);
                m.tiles = tile_seq.len();
                m.tile_seq = a.push(&tile_seq);
                m.tile_q0 = a.push(&tile_q0);
                m.passes = build_passes(&mut a, seqs, lim.max_kv_chunk);
                m.pen = a.push(&pen);
                m.upload = vec![(0, a.words.len())];
            }
        }
        m.outputs = outputs;
        m.words = a.words;
        Ok(m)
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

/// Splits every sequence's keys `0 .. end_pos` into windows so that one pass decompresses at most
/// `cap` keys; a sequence has at most one window per pass, windows in position order.
fn build_passes(a: &mut Arena, seqs: &[SeqStep], cap: usize) -> Vec<PassMeta> {
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
            let keys = slots.len();
            let slots_off = a.push(&slots);
            let row0: Vec<i32> = wins.iter().map(|w| w.as_ref().map_or(0, |w| w.row0)).collect();
            let pos0: Vec<i32> = wins.iter().map(|w| w.as_ref().map_or(0, |w| w.pos0)).collect();
            let len: Vec<i32> = wins.iter().map(|w| w.as_ref().map_or(0, |w| w.len)).collect();
            PassMeta {
                keys,
                slots: slots_off,
                k_row0: a.push(&row0),
                k_pos0: a.push(&pos0),
                k_len: a.push(&len),
                load_state: j > 0,
                last: j + 1 == n,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::plan::{PenaltyTokens, SampleRequest};
    use mla_core::SamplingParams;

    fn seq(id: u64, ctx: usize, n: usize, table: Vec<u32>) -> SeqStep {
        SeqStep {
            seq_id: id,
            tokens: vec![3; n],
            context_len: ctx,
            block_table: table,
            logits: LogitsRequest::None,
            sample: None,
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

    #[test]
    fn passes_cover_every_key_once_in_position_order() {
        let plan =
            StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, 70, 10, vec![5, 2]), seq(2, 0, 90, vec![7, 1])] };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        // 80 + 90 keys with a cap of 100: [s1 0..80, s2 0..20], [s2 20..90].
        assert_eq!(m.passes.len(), 2);
        let w = &m.words;
        let p0 = &m.passes[0];
        assert_eq!((p0.keys, w[p0.k_len], w[p0.k_len + 1], w[p0.k_pos0 + 1], w[p0.k_row0 + 1]), (100, 80, 20, 0, 80));
        let p1 = &m.passes[1];
        assert_eq!((p1.keys, w[p1.k_len], w[p1.k_len + 1], w[p1.k_pos0 + 1], w[p1.k_row0 + 1]), (70, 0, 70, 20, 0));
        assert!(p1.load_state && p1.last && !p0.load_state && !p0.last);
        // Position 64 of sequence 1 lives in its second block (2), offset 0.
        assert_eq!(w[p0.slots + 64], 2 * 64);
        // Tiles of 128 queries: one per sequence, the one whose last query sees more keys first
        // (sequence 2: 90 keys; sequence 1: 70 + 10 = 80).
        assert_eq!(m.tiles, 2);
        assert_eq!((w[m.tile_seq], w[m.tile_seq + 1], w[m.tile_q0], w[m.tile_q0 + 1]), (1, 0, 0, 0));
    }

    #[test]
    fn decode_offsets_depend_only_on_the_batch_size() {
        let a = StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 5, 1, vec![0]), seq(2, 130, 1, vec![3, 4, 6])] };
        let b =
            StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 300, 1, vec![0, 1, 2, 3, 4]), seq(2, 1, 1, vec![3])] };
        let (ma, mb) = (StepMeta::build(&a, &lim()).unwrap(), StepMeta::build(&b, &lim()).unwrap());
        assert_eq!(
            (ma.block_tables, ma.pen, ma.params, ma.seq_lens),
            (mb.block_tables, mb.pen, mb.params, mb.seq_lens)
        );
        assert_eq!(ma.words[ma.bt_stride], 3);
        assert_eq!(&ma.words[ma.block_tables + 3..ma.block_tables + 6], &[3, 4, 6]);
        assert_eq!(ma.words[ma.seq_lens + 1], 131);
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
        assert_eq!(&m.words[m.pen..], &[3, 2, 1, 5, 0, 1, 9, 1, 1]);
        // pen_begin / pen_end of each row (words 10 and 11 of its 12).
        let row = |r: usize| (m.words[m.params + 12 * r + 10], m.words[m.params + 12 * r + 11]);
        assert_eq!((row(0), row(1)), ((0, 3), (3, 3)));
        // The penalty region sits after the whole block-table region and is uploaded.
        assert_eq!(m.pen, m.block_tables + 2 * lim().max_blocks_per_seq);
        assert_eq!(m.upload, vec![(0, m.block_tables + 2), (m.pen, m.pen + 9)]);
    }

    #[test]
    fn decode_without_penalties_stops_at_the_used_block_tables() {
        let plan = StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 70, 1, vec![4, 2]), seq(2, 3, 1, vec![6])] };
        let m = StepMeta::build(&plan, &lim()).unwrap();
        // Two rows of stride 2 (71 positions need two blocks); the second row's unused entry is 0.
        assert_eq!(&m.words[m.block_tables..], &[4, 2, 6, 0]);
        assert_eq!(m.upload, vec![(0, m.block_tables + 4)]);
        assert_eq!(m.pen, m.block_tables + 2 * lim().max_blocks_per_seq);
    }

    #[test]
    fn borrowed_padding_rows_equal_appended_ones() {
        let seqs = vec![sampled(seq(1, 70, 1, vec![4, 2]), None), sampled(seq(2, 3, 1, vec![6]), None)];
        let pads: Vec<SeqStep> = (0..3).map(|i| sampled(seq(100 + i, 0, 1, vec![7]), None)).collect();
        let appended = StepPlan { kind: StepKind::Decode, seqs: seqs.iter().chain(&pads).cloned().collect() };
        let want = StepMeta::build(&appended, &lim()).unwrap();
        // A dirty, too short buffer to reuse: its contents must not leak into the result.
        let got = StepMeta::build_rows(StepKind::Decode, &seqs, &pads, &lim(), vec![-1; 7]).unwrap();
        assert_eq!((got.seqs, got.sample_rows, got.upload.clone()), (5, 5, want.upload.clone()));
        assert_eq!(got.words, want.words);
        let ids = |m: &StepMeta| m.outputs.iter().map(|o| (o.seq_id, o.sample_row)).collect::<Vec<_>>();
        assert_eq!(ids(&got), ids(&want));
        assert!(StepMeta::build_rows(StepKind::Prefill, &seqs, &pads, &lim(), vec![]).is_err());
    }
}
