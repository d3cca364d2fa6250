//! How one model is spread over several ranks (GPUs, or threads of the CPU reference backend).
//!
//! - Tensor parallelism (`--tp N`): each rank holds 1/N of the attention heads and of every FFN
//!   width (dense MLP, routed and shared experts) and computes a partial sum of each attention
//!   and FFN output, which the ranks all-reduce. One scheduler feeds every rank the same plan, and
//!   every rank keeps the whole latent cache: MLA caches per token, not per head.
//! - Attention data parallelism (`--tp N --enable-dp-attention`): each rank holds the whole
//!   attention and serves its own requests with its own plan and KV cache. Before each FFN the
//!   ranks all-gather their normed rows; each computes its 1/N of the FFN over all of them, and a
//!   reduce-scatter hands every rank the sums for its own rows.
//! - Replicas (`--dp D` without DP attention): D independent copies of the above behind one
//!   router. That is the engine's concern; a rank never sees it.

use crate::model::config::ModelConfig;
use crate::model::weights::{ModelSpec, Split, TensorSpec};
use std::ops::Range;

/// The parallel layout of one server, as the flags give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    /// Ranks that hold one copy of the model together (`--tp`).
    pub tp: usize,
    /// Attention data parallelism across those ranks (`--enable-dp-attention`).
    pub dp_attention: bool,
    /// Independent copies of the model (`--dp` without DP attention).
    pub replicas: usize,
}

/// A layout the model or the flags cannot support, with the constraint that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParallelError(pub String);

impl Parallel {
    pub const SINGLE: Parallel = Parallel { tp: 1, dp_attention: false, replicas: 1 };

    /// From the flags: `--tp`, `--dp` (None when not given) and `--enable-dp-attention`.
    pub fn from_flags(tp: usize, dp: Option<usize>, dp_attention: bool) -> Result<Self, ParallelError> {
        let err = |m: String| Err(ParallelError(m));
        if tp == 0 {
            return err("--tp must be at least 1".into());
        }
        if dp == Some(0) {
            return err("--dp must be at least 1".into());
        }
        if dp_attention {
            if tp < 2 {
                return err("--enable-dp-attention spreads attention over the --tp ranks: give --tp 2 or more".into());
            }
            // SGLang's meaning: --dp defaults to --tp; a smaller --dp would make attention-TP
            // groups inside the DP ranks, which this server does not implement.
            if let Some(d) = dp.filter(|&d| d != tp) {
                return err(format!(
                    "--dp {d} with --enable-dp-attention --tp {tp}: attention-TP groups inside DP ranks are not \
                     implemented; leave --dp out or give --dp {tp} (one attention rank per GPU)"
                ));
            }
            return Ok(Parallel { tp, dp_attention: true, replicas: 1 });
        }
        Ok(Parallel { tp, dp_attention: false, replicas: dp.unwrap_or(1) })
    }

    /// Ranks of one copy of the model.
    pub fn ranks(&self) -> usize {
        self.tp
    }

    /// Devices the whole layout needs.
    pub fn devices(&self) -> usize {
        self.tp * self.replicas
    }

    /// Schedulers (and KV caches) of one copy: one per rank under DP attention, else one.
    pub fn attention_ranks(&self) -> usize {
        if self.dp_attention {
            self.tp
        } else {
            1
        }
    }

    pub fn is_single(&self) -> bool {
        *self == Parallel::SINGLE
    }

    pub fn rank(&self, rank: usize) -> RankLayout {
        assert!(rank < self.tp, "rank {rank} of {}", self.tp);
        RankLayout { rank, world: self.tp, dp_attention: self.dp_attention }
    }

    /// Checks that `cfg` splits evenly over the ranks: heads (tensor parallel attention) and
    /// every FFN width; errors name the field and the numbers.
    pub fn check(&self, cfg: &ModelConfig) -> Result<(), ParallelError> {
        let n = self.tp;
        if n == 1 {
            return Ok(());
        }
        let mode = if self.dp_attention { format!("--tp {n} --enable-dp-attention") } else { format!("--tp {n}") };
        let mut widths = vec![("moe_intermediate_size", cfg.moe_intermediate_size, cfg.n_routed_experts > 0)];
        let dense = (0..cfg.num_hidden_layers).any(|l| !cfg.is_moe_layer(l));
        widths.push(("intermediate_size", cfg.intermediate_size, dense));
        if !self.dp_attention {
            widths.push(("num_attention_heads", cfg.num_attention_heads, true));
        }
        for (field, v, used) in widths {
            if used && !v.is_multiple_of(n) {
                return Err(ParallelError(format!(
                    "{mode}: the model's {field} ({v}) does not split over {n} ranks; choose a --tp that divides it"
                )));
            }
        }
        Ok(())
    }
}

/// One rank's place in its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankLayout {
    pub rank: usize,
    pub world: usize,
    pub dp_attention: bool,
}

/// The part of a tensor one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shard {
    Whole,
    /// Rows (dimension 0) of a matrix, or elements of a vector.
    Rows(Range<usize>),
    /// Columns (dimension 1) of a matrix.
    Cols(Range<usize>),
}

impl RankLayout {
    pub const SINGLE: RankLayout = RankLayout { rank: 0, world: 1, dp_attention: false };

    /// Ranks the attention heads are split over: all of them under TP, none under DP attention.
    fn head_ranks(&self) -> usize {
        if self.dp_attention {
            1
        } else {
            self.world
        }
    }

    /// The heads this rank attends with.
    pub fn heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let per = cfg.num_attention_heads / self.head_ranks();
        let r = if self.dp_attention { 0 } else { self.rank };
        r * per..(r + 1) * per
    }

    /// The config this rank computes with: its share of the heads and of every FFN width. Every
    /// other field (the MLA dims, routing, vocabulary) is the model's.
    pub fn local_config(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut local = cfg.clone();
        local.num_attention_heads /= self.head_ranks();
        local.intermediate_size /= self.world;
        local.moe_intermediate_size /= self.world;
        local
    }

    /// Parameters this rank holds of `spec`'s model: its shards plus everything replicated.
    pub fn params(&self, spec: &ModelSpec) -> usize {
        spec.tensors().iter().map(|t| self.shard(t).shape(&t.shape).iter().product::<usize>()).sum()
    }

    /// This rank's part of `spec` (of its full, published shape).
    pub fn shard(&self, spec: &TensorSpec) -> Shard {
        let even = |n: usize, parts: usize, idx: usize| {
            let per = n / parts;
            idx * per..(idx + 1) * per
        };
        match spec.split {
            _ if self.world == 1 => Shard::Whole,
            Split::Replicated => Shard::Whole,
            Split::HeadRows { .. } | Split::HeadCols { .. } if self.dp_attention => Shard::Whole,
            Split::HeadRows { per_head } => {
                let heads = spec.shape[0] / per_head;
                let h = even(heads, self.world, self.rank);
                Shard::Rows(h.start * per_head..h.end * per_head)
            }
            Split::HeadCols { per_head } => {
                let heads = spec.shape[1] / per_head;
                let h = even(heads, self.world, self.rank);
                Shard::Cols(h.start * per_head..h.end * per_head)
            }
            Split::FfnRows => Shard::Rows(even(spec.shape[0], self.world, self.rank)),
            Split::FfnCols => Shard::Cols(even(spec.shape[1], self.world, self.rank)),
        }
    }
}

impl Shard {
    /// The shape of this part of a tensor of shape `full`.
    pub fn shape(&self, full: &[usize]) -> Vec<usize> {
        let mut s = full.to_vec();
        match self {
            Shard::Whole => {}
            Shard::Rows(r) => s[0] = r.len(),
            Shard::Cols(c) => s[1] = c.len(),
        }
        s
    }

    /// This part of `data`, a row-major tensor of shape `full`.
    /// Whether the cut falls on `block`-sized blocks of a tensor of shape `full` (its ends at
    /// multiples of `block` or at the tensor's edge), so that block-wise quantization of the part
    /// equals the part of the quantized tensor.
    pub fn on_blocks(&self, full: &[usize], block: usize) -> bool {
        let on = |r: &Range<usize>, len: usize| {
            r.start.is_multiple_of(block) && (r.end.is_multiple_of(block) || r.end == len)
        };
        match self {
            Shard::Whole => true,
            Shard::Rows(r) => on(r, full[0]),
            Shard::Cols(c) => on(c, full[1]),
        }
    }

    pub fn take<T: Copy>(&self, data: &[T], full: &[usize]) -> Vec<T> {
        match self {
            Shard::Whole => data.to_vec(),
            Shard::Rows(r) => {
                let row: usize = full[1..].iter().product();
                data[r.start * row..r.end * row].to_vec()
            }
            Shard::Cols(c) => {
                let cols = full[1];
                data.chunks(cols).flat_map(|row| row[c.clone()].iter().copied()).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::weights::ModelSpec;

    fn preset(text: &str) -> ModelConfig {
        ModelConfig::from_json_str(text, "preset").unwrap()
    }

    #[test]
    fn flags_give_the_layouts_of_vllm_and_sglang() {
        assert_eq!(Parallel::from_flags(1, None, false).unwrap(), Parallel::SINGLE);
        assert_eq!(
            Parallel::from_flags(4, Some(2), false).unwrap(),
            Parallel { tp: 4, dp_attention: false, replicas: 2 }
        );
        let dpa = Parallel::from_flags(8, None, true).unwrap();
        assert_eq!((dpa.attention_ranks(), dpa.devices(), dpa.replicas), (8, 8, 1));
        assert_eq!(Parallel::from_flags(8, Some(8), true).unwrap(), dpa);
        for (tp, dp, dpa, needle) in [
            (0, None, false, "--tp must be"),
            (2, Some(0), false, "--dp must be"),
            (1, None, true, "--tp 2 or more"),
            (8, Some(2), true, "attention-TP groups"),
        ] {
            let e = Parallel::from_flags(tp, dp, dpa).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn a_tp_that_does_not_divide_the_model_is_refused_naming_the_field() {
        let lite = preset(include_str!("../../../../configs/deepseek-v2-lite.json"));
        for tp in [2, 4, 8] {
            Parallel::from_flags(tp, None, false).unwrap().check(&lite).unwrap();
            Parallel::from_flags(tp, None, true).unwrap().check(&lite).unwrap();
        }
        let e = Parallel::from_flags(3, None, false).unwrap().check(&lite).unwrap_err().to_string();
        assert!(e.contains("moe_intermediate_size (1408)") && e.contains("--tp 3"), "{e}");
        // 1408 / 16 = 88, but 16 heads / 32 ranks do not split.
        let e = Parallel::from_flags(32, None, false).unwrap().check(&lite).unwrap_err().to_string();
        assert!(e.contains("1408") || e.contains("num_attention_heads"), "{e}");
    }

    #[test]
    fn per_rank_dims_follow_the_design_table() {
        // (model, tp) -> heads / moe_intermediate / intermediate per rank (design study, 1.7).
        for (text, tp, want) in [
            (include_str!("../../../../configs/deepseek-v2-lite.json"), 8, (2, 176, 1368)),
            (include_str!("../../../../configs/deepseek-v2.json"), 8, (16, 192, 1536)),
            (include_str!("../../../../configs/deepseek-v3.json"), 4, (32, 512, 4608)),
        ] {
            let cfg = preset(text);
            let l = Parallel::from_flags(tp, None, false).unwrap().rank(tp - 1).local_config(&cfg);
            assert_eq!((l.num_attention_heads, l.moe_intermediate_size, l.intermediate_size), want);
            let d = Parallel::from_flags(tp, None, true).unwrap().rank(0).local_config(&cfg);
            assert_eq!(d.num_attention_heads, cfg.num_attention_heads, "DP attention keeps every head");
        }
    }

    #[test]
    fn the_shards_of_every_tensor_tile_it_exactly() {
        let cfg = preset(include_str!("../../../../configs/deepseek-v3.json"));
        let full = ModelSpec::new(&cfg);
        for dpa in [false, true] {
            let par = Parallel::from_flags(4, None, dpa).unwrap();
            let local = ModelSpec::new(&par.rank(0).local_config(&cfg));
            for (f, l) in full.tensors().iter().zip(local.tensors()) {
                assert_eq!(f.name, l.name);
                // Rank 0's part has the shape the rank's own config gives.
                assert_eq!(par.rank(0).shard(f).shape(&f.shape), l.shape, "{} (dp attention {dpa})", f.name);
                // The parts of all ranks cover the tensor once: rows or columns in rank order.
                let parts: Vec<Shard> = (0..4).map(|r| par.rank(r).shard(f)).collect();
                match &parts[0] {
                    Shard::Whole => assert!(parts.iter().all(|p| *p == Shard::Whole)),
                    Shard::Rows(_) | Shard::Cols(_) => {
                        let dim = usize::from(matches!(parts[0], Shard::Cols(_)));
                        let mut at = 0;
                        for p in &parts {
                            let (Shard::Rows(r) | Shard::Cols(r)) = p else { panic!("mixed shards") };
                            assert_eq!(r.start, at, "{}", f.name);
                            at = r.end;
                        }
                        assert_eq!(at, f.shape[dim], "{}", f.name);
                    }
                }
            }
        }
    }

    #[test]
    fn rank_params_split_the_sharded_part_and_repeat_the_rest() {
        let cfg = preset(include_str!("../../../../configs/deepseek-v2-lite.json"));
        let spec = ModelSpec::new(&cfg);
        let total = spec.num_params();
        let tp = Parallel::from_flags(4, None, false).unwrap();
        let per: Vec<usize> = (0..4).map(|r| tp.rank(r).params(&spec)).collect();
        assert!(per.iter().all(|&p| p == per[0]), "even shards");
        // Embedding, norms, routers, q_a/kv_a and the head are replicated, so four ranks hold
        // more than one copy, and each far less than the whole.
        assert!(4 * per[0] > total && per[0] < total / 3, "{per:?} of {total}");
        let dpa = Parallel::from_flags(4, None, true).unwrap();
        assert!(dpa.rank(0).params(&spec) > per[0], "DP attention replicates attention");
        assert_eq!(RankLayout::SINGLE.params(&spec), total);
    }

    #[test]
    fn take_cuts_rows_and_columns() {
        let m: Vec<u32> = (0..12).collect(); // [3, 4]
        assert_eq!(Shard::Rows(1..3).take(&m, &[3, 4]), (4..12).collect::<Vec<_>>());
        assert_eq!(Shard::Cols(1..3).take(&m, &[3, 4]), vec![1, 2, 5, 6, 9, 10]);
        assert_eq!(Shard::Cols(2..4).shape(&[3, 4]), vec![3, 2]);
    }
}
