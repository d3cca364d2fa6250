//! DeepSeekMoE: the router (exactly as HF transformers 5.17 selects and weights experts) and the
//! block that sums the chosen experts' outputs and the always-on shared experts.
//!
//! HF semantics reproduced here:
//! - DeepSeek-V2 (`greedy`, `group_limited_greedy`): softmax scores; group score = the group's
//!   best expert score; experts outside the kept groups are masked to 0 (not removed) before the
//!   top-k; weights are the chosen softmax scores, never renormalised, times
//!   `routed_scaling_factor`.
//! - DeepSeek-V3 (`noaux_tc`): sigmoid scores; `e_score_correction_bias` is added only to choose;
//!   group score = sum of the group's two best biased scores; masked experts get -inf; weights
//!   are the unbiased sigmoid scores, divided by `(sum + 1e-20)` when `norm_topk_prob`, times
//!   `routed_scaling_factor`.

use crate::linear::Matrix;
use crate::mlp::SiluMlp;
use crate::softmax::softmax_in_place;
use mla_core::model::config::TopkMethod;
use mla_core::sampling::top_k_entries;
use mla_core::ModelConfig;
use rayon::prelude::*;

/// Chooses experts for one token from its router logits (`gate.weight · x`, length
/// `n_routed_experts`). Returns `(expert, weight)` pairs, highest selection score first.
/// `correction_bias` is required for noaux_tc and ignored otherwise. Reference for GPU kernels.
pub fn route(cfg: &ModelConfig, router_logits: &[f32], correction_bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let n = cfg.n_routed_experts;
    assert_eq!(router_logits.len(), n, "router logits must have one entry per routed expert");
    let k = cfg.num_experts_per_tok;
    let per_group = n / cfg.n_group;
    let scale = cfg.routed_scaling_factor as f32;
    let chosen = match cfg.topk_method {
        TopkMethod::Greedy => {
            let mut scores = router_logits.to_vec();
            softmax_in_place(&mut scores);
            top_k_entries(&scores, k)
        }
        TopkMethod::GroupLimitedGreedy => {
            let mut scores = router_logits.to_vec();
            softmax_in_place(&mut scores);
            let group_scores: Vec<f32> =
                scores.chunks(per_group).map(|g| g.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
            let masked = mask_groups(&scores, &group_scores, cfg.topk_group, per_group, 0.0);
            top_k_entries(&masked, k)
        }
        TopkMethod::NoauxTc => {
            let bias = correction_bias.expect("noaux_tc routing needs e_score_correction_bias");
            let scores: Vec<f32> = router_logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
            let for_choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            let group_scores: Vec<f32> =
                for_choice.chunks(per_group).map(|g| top_k_entries(g, 2).iter().map(|e| e.1).sum()).collect();
            let masked = mask_groups(&for_choice, &group_scores, cfg.topk_group, per_group, f32::NEG_INFINITY);
            let mut picked: Vec<(u32, f32)> =
                top_k_entries(&masked, k).into_iter().map(|(e, _)| (e, scores[e as usize])).collect();
            if cfg.norm_topk_prob {
                let denominator = picked.iter().map(|e| e.1).sum::<f32>() + 1e-20;
                picked.iter_mut().for_each(|e| e.1 /= denominator);
            }
            picked
        }
    };
    chosen.into_iter().map(|(e, w)| (e as usize, w * scale)).collect()
}

/// Keeps the scores of the `keep` best groups and replaces all others with `fill`.
fn mask_groups(scores: &[f32], group_scores: &[f32], keep: usize, per_group: usize, fill: f32) -> Vec<f32> {
    let mut kept = vec![false; group_scores.len()];
    for (g, _) in top_k_entries(group_scores, keep) {
        kept[g as usize] = true;
    }
    scores.iter().enumerate().map(|(e, &s)| if kept[e / per_group] { s } else { fill }).collect()
}

#[derive(Debug, Clone)]
pub struct MoeBlock {
    pub gate: Matrix,
    pub correction_bias: Option<Vec<f32>>,
    pub experts: Vec<SiluMlp>,
    pub shared_experts: Option<SiluMlp>,
}

impl MoeBlock {
    /// `x [n, hidden]` -> `[n, hidden]`: routed experts (summed in ascending expert order, as
    /// HF's `index_add_` loop does) plus the shared experts.
    pub fn forward(&self, cfg: &ModelConfig, x: &[f32]) -> Vec<f32> {
        let hidden = cfg.hidden_size;
        let logits = self.gate.forward(x);
        let mut out = vec![0.0; x.len()];
        out.par_chunks_mut(hidden).zip(x.par_chunks(hidden)).zip(logits.par_chunks(cfg.n_routed_experts)).for_each(
            |((o, xt), lt)| {
                let mut chosen = route(cfg, lt, self.correction_bias.as_deref());
                chosen.sort_by_key(|c| c.0);
                let outputs: Vec<Vec<f32>> = chosen.par_iter().map(|&(e, _)| self.experts[e].forward(xt)).collect();
                for ((_, w), y) in chosen.iter().zip(outputs) {
                    crate::linear::axpy(*w, &y, o);
                }
            },
        );
        if let Some(shared) = &self.shared_experts {
            for (o, s) in out.iter_mut().zip(shared.forward(x)) {
                *o += s;
            }
        }
        out
    }
}
