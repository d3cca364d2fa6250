//! Per-step metadata: everything a step's kernels read besides weights, cache and activations,
//! built on the host from a `StepPlan` into one array of 32-bit words and uploaded with at most
//! two copies. Decode steps use a layout whose offsets depend only on the batch size, so a CUDA
//! graph captured for that size stays valid: what changes between steps (tokens, lengths, block
//! tables, sampling parameters) is data the kernels read, never a launch argument.

use crate::ops::{SampleParamsRaw, MAX_TOP_LOGPROBS, PAGE_SIZE};
use mla_core::plan::{slot_of, LogitsRequest, StepKind, StepPlan};
use std::collections::HashMap;

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

impl StepMeta {
    pub fn build(plan: &StepPlan, lim: &MetaLimits) -> anyhow::Result<StepMeta> {
        let t = plan.num_tokens();
        let s = plan.seqs.len();
        anyhow::ensure!(t <= lim.max_tokens, "step feeds {t} tokens; this backend was sized for {} (max_num_batched_tokens)", lim.max_tokens);
        anyhow::ensure!(s <= lim.max_seqs, "step has {s} sequences; this backend was sized for {} (max_num_seqs)", lim.max_seqs);
        let mut a = Arena { words: Vec::with_capacity(8 * t + 64) };
        let mut toks = Vec::with_capacity(t);
        let mut poss = Vec::with_capacity(t);
        let mut slots = Vec::with_capacity(t);
        for sq in &plan.seqs {
            anyhow::ensure!(sq.block_table.len() <= lim.max_blocks_per_seq, "sequence {}: {} blocks exceed max_model_len", sq.seq_id, sq.block_table.len());
            for (i, &tok) in sq.tokens.iter().enumerate() {
                let p = sq.context_len + i;
                toks.push(tok as i32);
                poss.push(p as i32);
                slots.push(slot_of(&sq.block_table, PAGE_SIZE, p) as i32);
            }
        }
        let tok = a.push(&toks);
        let pos = a.push(&poss);
        let slot = a.push(&slots);

        let mut m = StepMeta {
            kind: plan.kind,
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

        // Output rows: sampled rows first (row b = b-th sampling sequence), then asked-for logits.
        let mut first_row = Vec::with_capacity(s);
        let mut acc = 0;
        for sq in &plan.seqs {
            first_row.push(acc);
            acc += sq.tokens.len();
        }
        let mut src = Vec::new();
        let mut outputs: Vec<SeqOut> = plan
            .seqs
            .iter()
            .enumerate()
            .map(|(i, sq)| {
                let sample_row = sq.sample.as_ref().map(|_| {
                    src.push((first_row[i] + sq.tokens.len() - 1) as i32);
                    src.len() - 1
                });
                SeqOut { seq_id: sq.seq_id, sample_row, top_logprobs: sq.sample.as_ref().and_then(|r| r.top_logprobs), logit_rows: vec![] }
            })
            .collect();
        let sample_rows = src.len();
        for (i, sq) in plan.seqs.iter().enumerate() {
            let last = first_row[i] + sq.tokens.len() - 1;
            outputs[i].logit_rows = match sq.logits {
                LogitsRequest::None => vec![],
                LogitsRequest::Last => vec![outputs[i].sample_row.unwrap_or_else(|| {
                    src.push(last as i32);
                    src.len() - 1
                })],
                LogitsRequest::All => (first_row[i]..=last)
                    .map(|r| {
                        src.push(r as i32);
                        src.len() - 1
                    })
                    .collect(),
            };
        }
        anyhow::ensure!(src.len() <= lim.max_logit_rows, "step asks for {} rows of logits; this backend was sized for {}", src.len(), lim.max_logit_rows);
        m.logit_rows = src.len();
        m.sample_rows = sample_rows;
        m.logit_src = a.push(&src);

        // Sampling parameters and penalty entries (unique tokens of the history).
        a.align2();
        m.params = a.reserve(sample_rows * 12);
        let mut pen: Vec<i32> = Vec::new();
        let mut row = 0;
        for sq in &plan.seqs {
            let Some(req) = &sq.sample else { continue };
            let p = &req.params;
            let n_logprobs = match req.top_logprobs {
                Some(k) if k > MAX_TOP_LOGPROBS => anyhow::bail!("sequence {}: {k} top logprobs requested; the CUDA sampler returns at most {MAX_TOP_LOGPROBS}", sq.seq_id),
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
                    let mut entries: HashMap<u32, (i32, bool)> = HashMap::new();
                    for &tk in &h.prompt {
                        entries.entry(tk).or_insert((0, false)).1 = true;
                    }
                    for &tk in &h.output {
                        let e = entries.entry(tk).or_insert((0, false));
                        e.0 += 1;
                        e.1 = true;
                    }
                    let mut sorted: Vec<_> = entries.into_iter().filter(|(tk, _)| (*tk as usize) < lim.vocab).collect();
                    sorted.sort_by_key(|e| e.0);
                    for (tk, (c, seen)) in sorted {
                        pen.extend_from_slice(&[tk as i32, c, seen as i32]);
                    }
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

        match plan.kind {
            StepKind::Decode => {
                // Fixed offsets for a given batch size (see the module comment).
                let lens: Vec<i32> = plan.seqs.iter().map(|sq| sq.end_pos() as i32).collect();
                m.seq_lens = a.push(&lens);
                let stride = plan.seqs.iter().map(|sq| sq.end_pos().div_ceil(PAGE_SIZE)).max().unwrap_or(1).max(1);
                m.max_pages = stride;
                m.bt_stride = a.push(&[stride as i32]);
                m.block_tables = a.reserve(s * lim.max_blocks_per_seq);
                for (b, sq) in plan.seqs.iter().enumerate() {
                    let n = sq.end_pos().div_ceil(PAGE_SIZE);
                    for (j, &blk) in sq.block_table[..n].iter().enumerate() {
                        a.words[m.block_tables + b * stride + j] = blk as i32;
                    }
                }
                let used_end = m.block_tables + s * stride;
                let pen_start = a.words.len();
                m.pen = a.push(&pen);
                m.upload = vec![(0, used_end), (pen_start, a.words.len())];
            }
            StepKind::Prefill => {
                let mut cu = vec![0i32];
                let mut qp0 = Vec::with_capacity(s);
                // (keys the tile's last query sees, sequence, first row)
                let mut tiles = Vec::new();
                for (i, sq) in plan.seqs.iter().enumerate() {
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
                m.passes = build_passes(&mut a, plan, lim.max_kv_chunk);
                m.pen = a.push(&pen);
                m.upload = vec![(0, a.words.len())];
            }
        }
        m.outputs = outputs;
        m.words = a.words;
        Ok(m)
    }
}

/// Splits every sequence's keys `0 .. end_pos` into windows so that one pass decompresses at most
/// `cap` keys; a sequence has at most one window per pass, windows in position order.
fn build_passes(a: &mut Arena, plan: &StepPlan, cap: usize) -> Vec<PassMeta> {
    let s = plan.seqs.len();
    struct Window {
        row0: i32,
        pos0: i32,
        len: i32,
    }
    let mut passes: Vec<Vec<Option<Window>>> = vec![];
    let mut pass_slots: Vec<Vec<i32>> = vec![];
    let mut cur: Vec<Option<Window>> = (0..s).map(|_| None).collect();
    let mut cur_slots: Vec<i32> = vec![];
    for (i, sq) in plan.seqs.iter().enumerate() {
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
            PassMeta { keys, slots: slots_off, k_row0: a.push(&row0), k_pos0: a.push(&pos0), k_len: a.push(&len), load_state: j > 0, last: j + 1 == n }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::plan::SeqStep;

    fn seq(id: u64, ctx: usize, n: usize, table: Vec<u32>) -> SeqStep {
        SeqStep { seq_id: id, tokens: vec![3; n], context_len: ctx, block_table: table, logits: LogitsRequest::None, sample: None }
    }

    fn lim() -> MetaLimits {
        MetaLimits { max_tokens: 256, max_seqs: 8, max_logit_rows: 64, max_kv_chunk: 100, max_blocks_per_seq: 8, vocab: 512 }
    }

    #[test]
    fn passes_cover_every_key_once_in_position_order() {
        let plan = StepPlan { kind: StepKind::Prefill, seqs: vec![seq(1, 70, 10, vec![5, 2]), seq(2, 0, 90, vec![7, 1])] };
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
        let b = StepPlan { kind: StepKind::Decode, seqs: vec![seq(1, 300, 1, vec![0, 1, 2, 3, 4]), seq(2, 1, 1, vec![3])] };
        let (ma, mb) = (StepMeta::build(&a, &lim()).unwrap(), StepMeta::build(&b, &lim()).unwrap());
        assert_eq!((ma.block_tables, ma.pen, ma.params, ma.seq_lens), (mb.block_tables, mb.pen, mb.params, mb.seq_lens));
        assert_eq!(ma.words[ma.bt_stride], 3);
        assert_eq!(&ma.words[ma.block_tables + 3..ma.block_tables + 6], &[3, 4, 6]);
        assert_eq!(ma.words[ma.seq_lens + 1], 131);
    }
}
