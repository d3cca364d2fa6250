//! Router semantics against hand-computed cases (HF transformers 5.17 behaviour).

use mla_core::ModelConfig;
use mla_cpu::route;

fn cfg(extra: &str) -> ModelConfig {
    let text = format!(
        r#"{{"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 1, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
            "v_head_dim": 2, "max_position_embeddings": 16, "moe_intermediate_size": 4, {extra}}}"#
    );
    ModelConfig::from_json_str(&text, "routing test").unwrap()
}

fn logit(p: f64) -> f32 {
    (p / (1.0 - p)).ln() as f32
}

fn assert_routes(got: &[(usize, f32)], want: &[(usize, f64)]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.0, w.0, "{got:?} vs {want:?}");
        assert!((g.1 as f64 - w.1).abs() < 1e-6, "{got:?} vs {want:?}");
    }
}

#[test]
fn greedy_takes_top_softmax_scores_unnormalised_and_scaled() {
    let c = cfg(r#""model_type": "deepseek_v2", "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "topk_method": "greedy", "routed_scaling_factor": 2.0"#);
    // softmax(ln 1, ln 2, ln 3, ln 4) = (0.1, 0.2, 0.3, 0.4).
    let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
    assert_routes(&route(&c, &logits, None), &[(3, 0.8), (2, 0.6)]);
}

#[test]
fn group_limited_greedy_keeps_groups_by_their_best_expert() {
    let c = cfg(r#""model_type": "deepseek_v2", "n_routed_experts": 8, "num_experts_per_tok": 3,
                   "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                   "routed_scaling_factor": 1.0"#);
    // Probabilities proportional to 9,1 | 2,8 | 6,6 | 1,1 (sum 34). Group maxima 9, 8, 6, 1 keep
    // groups 0 and 1, so the third pick is expert 2 (2/34), not expert 4 or 5 (6/34).
    let weights = [9.0f32, 1.0, 2.0, 8.0, 6.0, 6.0, 1.0, 1.0];
    let logits: Vec<f32> = weights.iter().map(|x| x.ln()).collect();
    assert_routes(&route(&c, &logits, None), &[(0, 9.0 / 34.0), (3, 8.0 / 34.0), (2, 2.0 / 34.0)]);
}

fn noaux(norm: bool) -> ModelConfig {
    cfg(&format!(
        r#""model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 3,
            "n_group": 4, "topk_group": 2, "norm_topk_prob": {norm}, "routed_scaling_factor": 2.5"#
    ))
}

/// Sigmoid scores .9,.1 | .75,.7 | .5,.4 | .25,.25 with bias 0.6 on group 2 only: biased
/// group top-2 sums are 1.0, 1.45, 2.1, 0.5, so groups 2 and 1 survive although group 0 holds the
/// best single expert; the picks are 4 (1.1), 5 (1.0), 2 (0.75) by biased score, weighted by the
/// unbiased scores .5, .4, .75.
fn noaux_case() -> (Vec<f32>, Vec<f32>) {
    let scores = [0.9, 0.1, 0.75, 0.7, 0.5, 0.4, 0.25, 0.25];
    let bias = vec![0.0, 0.0, 0.0, 0.0, 0.6, 0.6, 0.0, 0.0];
    (scores.iter().map(|&p| logit(p)).collect(), bias)
}

#[test]
fn noaux_tc_chooses_with_bias_and_weights_without_it() {
    let (logits, bias) = noaux_case();
    assert_routes(&route(&noaux(false), &logits, Some(&bias)), &[(4, 0.5 * 2.5), (5, 0.4 * 2.5), (2, 0.75 * 2.5)]);
}

#[test]
fn noaux_tc_normalises_top_k_weights_when_asked() {
    let (logits, bias) = noaux_case();
    let s = 0.5 + 0.4 + 0.75;
    assert_routes(
        &route(&noaux(true), &logits, Some(&bias)),
        &[(4, 0.5 / s * 2.5), (5, 0.4 / s * 2.5), (2, 0.75 / s * 2.5)],
    );
}
