//! The padding rows of graph replays: a captured step has a fixed number of rows, and a step
//! with fewer fills the rest with rows that read and write only the model's private padding
//! block and whose outputs are dropped.

use mla_core::step::plan::{LogitsRequest, SampleRequest, SeqStep};
use mla_core::SamplingParams;

/// Padding rows `0 .. batch`: row `i` is what a graph replay pads position `i` of its batch with.
pub fn pad_rows(batch: usize, pad_block: usize) -> Vec<SeqStep> {
    (0..batch).map(|i| pad_row(i, pad_block)).collect()
}

/// One padding row: token 0 at position 0 of the padding block, greedy, nothing returned.
pub(super) fn pad_row(i: usize, pad_block: usize) -> SeqStep {
    SeqStep {
        fork: None,
        seq_id: u64::MAX - i as u64,
        tokens: vec![0],
        context_len: 0,
        block_table: vec![pad_block as u32],
        logits: LogitsRequest::None,
        sample: Some(SampleRequest {
            params: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
            seed: 0,
            top_logprobs: None,
            penalty: None,
            logit_bias: Vec::new(),
            allowed: None,
        }),
        mtp: None,
    }
}
