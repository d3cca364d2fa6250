#!/usr/bin/env python3
"""Build the HF-transformers oracle fixtures for mla-serve (tests/fixtures/<variant>/).

Why: every end-to-end correctness test of mla-serve compares against HF transformers
(DeepseekV2ForCausalLM / DeepseekV3ForCausalLM), never against numbers our own code produced.
This script builds tiny random DeepSeek models with deterministic seeds, writes them in the
*published* checkpoint format (per-expert tensor names, `rope_scaling` with "type": "yarn",
FP8 block-quantised weights for v3_fp8) and records HF's logits and greedy continuations.

Format (CONTRIBUTING.md): config.json, model.safetensors, oracle.json,
oracle_f32.safetensors (HF float32 on CPU), oracle_bf16_cuda.safetensors (HF bfloat16 on CUDA);
v3_fp8_real_dims also oracle_w8a8_f32.safetensors (HF float32 with W8A8 activation quantisation
emulated, see act_quant).

Needs torch and transformers (5.17 was used); the bf16 oracle needs a CUDA GPU.
    python3 scripts/make_fixtures.py --out tests/fixtures
"""

import argparse
import json
import math
import os
import sys
import types
from collections import OrderedDict

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
)

VOCAB = 512  # the demo tokenizer's size
CONTINUATION_LEN = 32
PROMPT_LENGTHS = OrderedDict([("short", 5), ("medium", 20), ("long", 48)])
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BOS, EOS = 0, 1
# Both models run the plain reference paths: eager attention and the per-expert loop.
IMPL = dict(attn_implementation="eager", experts_implementation="eager")

# YaRN as published (type yarn, beta 32/1, mscale == mscale_all_dim), but with a short original
# context so that the prompts (48 + 32 tokens) run past original_max_position_embeddings.
def yarn(mscale):
    return {
        "type": "yarn",
        "factor": 4,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale,
        "original_max_position_embeddings": 32,
    }


# Each variant: the config keys that differ from COMMON, the weight seed, and whether the linear
# weights are stored block-FP8 (v3_fp8 is v3's exact weights, quantised).
COMMON = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,  # factor * original, as published (163840 = 40 * 4096)
    "rope_theta": 10000,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "moe_layer_freq": 1,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 16,
    "v_head_dim": 20,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "rope_scaling": yarn(0.707),
}

V2 = {
    **V2_LITE,
    "q_lora_rank": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 3,
    "topk_method": "group_limited_greedy",
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 1.5,
    "rope_scaling": yarn(1.0),
}

# hidden 144, q_b out 160, kv_b out 176 and intermediate 160 are > 128 and not multiples of 128,
# so the FP8 copy has partial 128x128 scale blocks in both directions.
V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 144,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 16,
    "v_head_dim": 20,
    "intermediate_size": 160,
    "moe_intermediate_size": 16,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 0,  # no MTP weights are shipped
    "ep_size": 1,
    "rope_scaling": yarn(1.0),
}

V3_FP8 = {
    **V3,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    },
}

# The attention dims of every published model (latent 512 + rope 64, nope 128, v 128), V2-Lite
# style (no q LoRA, greedy softmax routing, two shared experts), with few heads and a small hidden
# size so the file stays small.
REAL_DIMS = {
    **V2_LITE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
}

# Issue 12's model: V3 (noaux_tc, groups, bias, q LoRA) stored block-FP8 with the dims the CUDA
# backend is built for. Every input dim is a multiple of 128 (hidden 256, q_lora 256, latent 512,
# heads x v 512, I 384, moe I 128), so each activation row splits into whole 128-column groups as in
# the published V3; kv_a_proj_with_mqa's 576 rows end in a half block (4.5 blocks of 128).
V3_FP8_REAL_DIMS = {
    **V3_FP8,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
}

# block_factor_log2: the range of the per-128x128-block weight factors (default [-1, 1], i.e. 0.5-2);
# w8a8: also write oracle_w8a8_f32 (activation quantisation emulated).
VARIANTS = OrderedDict(
    [
        ("v2_lite", dict(config=V2_LITE, seed=1001, fp8=False)),
        ("v2", dict(config=V2, seed=1002, fp8=False)),
        ("v3", dict(config=V3, seed=1003, fp8=False)),
        ("v3_fp8", dict(config=V3_FP8, seed=1003, fp8=True)),  # same seed: v3's weights
        ("real_dims", dict(config=REAL_DIMS, seed=1005, fp8=False)),
        (
            "v3_fp8_real_dims",
            dict(config=V3_FP8_REAL_DIMS, seed=1006, fp8=True, block_factor_log2=(-4.0, 1.0), w8a8=True),
        ),
    ]
)


def published_config(cfg_keys):
    """config.json as DeepSeek publishes it: sorted keys, rope_theta + rope_scaling."""
    cfg = {**COMMON, **cfg_keys}
    cfg["transformers_version"] = transformers.__version__
    return OrderedDict(sorted(cfg.items()))


# ----------------------------------------------------------------------------------------------
# Weights, in the published layout: name -> float32 tensor holding bf16-representable values.
# ----------------------------------------------------------------------------------------------

LINEAR, NORM, EMBED, HEAD, ROUTER, BIAS = "linear", "norm", "embed", "head", "router", "bias"


def weight_specs(c):
    """(published name, shape, role) for every tensor of the checkpoint, in file order."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    specs = [("model.embed_tokens.weight", [VOCAB, H], EMBED)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", [H], NORM))
        if c["q_lora_rank"] is None:
            specs.append((f"{p}.self_attn.q_proj.weight", [heads * qk, H], LINEAR))
        else:
            r = c["q_lora_rank"]
            specs.append((f"{p}.self_attn.q_a_proj.weight", [r, H], LINEAR))
            specs.append((f"{p}.self_attn.q_a_layernorm.weight", [r], NORM))
            specs.append((f"{p}.self_attn.q_b_proj.weight", [heads * qk, r], LINEAR))
        kv = c["kv_lora_rank"]
        specs.append((f"{p}.self_attn.kv_a_proj_with_mqa.weight", [kv + c["qk_rope_head_dim"], H], LINEAR))
        specs.append((f"{p}.self_attn.kv_a_layernorm.weight", [kv], NORM))
        specs.append(
            (f"{p}.self_attn.kv_b_proj.weight", [heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv], LINEAR)
        )
        specs.append((f"{p}.self_attn.o_proj.weight", [H, heads * c["v_head_dim"]], LINEAR))
        specs.append((f"{p}.post_attention_layernorm.weight", [H], NORM))
        if i < c["first_k_dense_replace"]:
            specs += mlp_specs(f"{p}.mlp", H, c["intermediate_size"])
        else:
            E = c["n_routed_experts"]
            specs.append((f"{p}.mlp.gate.weight", [E, H], ROUTER))
            if c["model_type"] == "deepseek_v3":
                specs.append((f"{p}.mlp.gate.e_score_correction_bias", [E], BIAS))
            for e in range(E):
                specs += mlp_specs(f"{p}.mlp.experts.{e}", H, c["moe_intermediate_size"])
            specs += mlp_specs(f"{p}.mlp.shared_experts", H, c["moe_intermediate_size"] * c["n_shared_experts"])
    specs.append(("model.norm.weight", [H], NORM))
    specs.append(("lm_head.weight", [VOCAB, H], HEAD))
    return specs


def mlp_specs(prefix, hidden, inter):
    return [
        (f"{prefix}.gate_proj.weight", [inter, hidden], LINEAR),
        (f"{prefix}.up_proj.weight", [inter, hidden], LINEAR),
        (f"{prefix}.down_proj.weight", [hidden, inter], LINEAR),
    ]


def bf16_exact(t):
    return t.to(torch.bfloat16).to(torch.float32)


def make_weights(c, seed, block_factor_log2=None):
    """Random weights with a larger spread than HF's init so logits and routing are not degenerate.

    Linear weights: N(0, 1/fan_in) (0.08-0.18 for these sizes), each 128x128 block additionally
    scaled by its own factor in [0.5, 2] so FP8 block scales differ per block (with
    `block_factor_log2=(lo, hi)`: 2**U(lo, hi) instead). Norm gains N(1, 0.1).
    The router gets a wider spread so expert choice depends on the token. Everything is rounded to
    bf16 here, before any HF run.
    """
    g = torch.Generator().manual_seed(seed)
    out = OrderedDict()
    for name, shape, role in weight_specs(c):
        if role == EMBED:
            w = torch.randn(shape, generator=g)
        elif role == NORM:
            w = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif role == HEAD:
            w = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[1]))
        elif role == ROUTER:
            w = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[1]))
        elif role == BIAS:
            # Sigmoid scores sit in (0, 1) with neighbours ~0.05 apart; +-0.25 reorders them.
            w = (torch.rand(shape, generator=g) * 2.0 - 1.0) * 0.25
        elif role == LINEAR:
            w = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            rows, cols = math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK)
            if block_factor_log2 is None:
                factors = torch.exp((torch.rand(rows, cols, generator=g) * 2.0 - 1.0) * math.log(2.0))
            else:
                lo, hi = block_factor_log2
                factors = torch.exp2(lo + torch.rand(rows, cols, generator=g) * (hi - lo))
            w = w * expand_blocks(factors, shape)
        else:
            raise AssertionError(role)
        out[name] = bf16_exact(w)
    return out


def expand_blocks(per_block, shape):
    """[ceil(out/128), ceil(in/128)] -> [out, in], each value covering its (possibly partial) block."""
    return per_block.repeat_interleave(FP8_BLOCK, 0)[: shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : shape[1]]


def quantize_fp8_block(w):
    """DeepSeek-V3 block FP8: scale_inv = amax/448 per 128x128 block, weight = w / scale_inv."""
    rows, cols = math.ceil(w.shape[0] / FP8_BLOCK), math.ceil(w.shape[1] / FP8_BLOCK)
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    for r in range(rows):
        for k in range(cols):
            block = w[r * FP8_BLOCK : (r + 1) * FP8_BLOCK, k * FP8_BLOCK : (k + 1) * FP8_BLOCK]
            scale_inv[r, k] = block.abs().max().clamp(min=1e-12) / FP8_MAX
    q = (w / expand_blocks(scale_inv, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_fp8_block(q, scale_inv):
    """What a loader must compute: fp8 value (exact in f32) times its block's f32 scale_inv."""
    return q.to(torch.float32) * expand_blocks(scale_inv, q.shape)


def checkpoint_and_model_weights(c, weights, fp8):
    """(tensors to save under published names, f32 weights HF runs on, published name -> role)."""
    roles = {name: role for name, _, role in weight_specs(c)}
    saved, model_w = OrderedDict(), OrderedDict()
    for name, w in weights.items():
        role = roles[name]
        if role == BIAS:
            saved[name] = w.clone()  # published V3 ships the correction bias in F32
            model_w[name] = w
        elif fp8 and role == LINEAR:
            q, s = quantize_fp8_block(w)
            saved[name] = q
            saved[name + "_scale_inv"] = s
            model_w[name] = dequantize_fp8_block(q, s)
        else:
            saved[name] = w.to(torch.bfloat16)
            model_w[name] = w
    return saved, model_w, roles


def to_hf_state_dict(c, published):
    """transformers 5 fuses routed experts: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I]."""
    sd = OrderedDict()
    expert_re = ".mlp.experts."
    for name, w in published.items():
        if expert_re not in name:
            sd[name] = w
    for i in range(c["first_k_dense_replace"], c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        E = c["n_routed_experts"]
        gate = [published[f"{p}.{e}.gate_proj.weight"] for e in range(E)]
        up = [published[f"{p}.{e}.up_proj.weight"] for e in range(E)]
        down = [published[f"{p}.{e}.down_proj.weight"] for e in range(E)]
        sd[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g_, u_], 0) for g_, u_ in zip(gate, up)])
        sd[f"{p}.down_proj"] = torch.stack(down)
    return sd


def model_class(c):
    return {"deepseek_v2": DeepseekV2ForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}[c["model_type"]]


def build_model(variant_dir, c, published_f32, dtype):
    """HF model from the written config.json, holding exactly `published_f32` (cast to `dtype`)."""
    hf_cfg = AutoConfig.from_pretrained(variant_dir)
    if getattr(hf_cfg, "quantization_config", None) is not None:
        del hf_cfg.quantization_config  # HF runs on the dequantised weights
    model = model_class(c)._from_config(hf_cfg, dtype=dtype, **IMPL)
    sd = to_hf_state_dict(c, published_f32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # inv_freq buffers are non-persistent; everything persistent must come from us.
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    keep_router_bias_f32(model, published_f32)
    model.eval()
    return model


def keep_router_bias_f32(model, published_f32):
    """HF keeps e_score_correction_bias in f32 in every dtype (_keep_in_fp32_modules_strict)."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            owner.e_score_correction_bias = published_f32[name].clone().to(buf.device)


def check_dtypes(model, dtype):
    for name, p in model.named_parameters():
        if p.dtype != dtype:
            raise SystemExit(f"{name} is {p.dtype}, expected {dtype}")
    for name, b in model.named_buffers():
        want = torch.float32 if ("inv_freq" in name or "e_score_correction_bias" in name) else dtype
        if b.dtype != want:
            raise SystemExit(f"buffer {name} is {b.dtype}, expected {want}")


# ----------------------------------------------------------------------------------------------
# Running HF
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def logits_of(model, ids):
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=dev), use_cache=False)
    return out.logits[0].to(torch.float32).cpu()


@torch.no_grad()
def greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(torch.argmax(logits_of(model, seq)[-1])))
    return seq[len(prompt) :]


def make_prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return OrderedDict(
        (name, [BOS] + torch.randint(2, VOCAB, (n - 1,), generator=g).tolist()) for name, n in PROMPT_LENGTHS.items()
    )


def top2_gap(row):
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


# ----------------------------------------------------------------------------------------------
# Routing: prove the fixture exercises what the variant claims (group limits, bias).
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def routing_report(model, c, sequences):
    captured = []

    def hook(module, inputs, outputs):
        captured.append((module, outputs[0].detach().float(), outputs[2].detach()))

    handles = [
        layer.mlp.gate.register_forward_hook(hook)
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    for seq in sequences:
        logits_of(model, seq)
    for h in handles:
        h.remove()

    k, E, G, TG = c["num_experts_per_tok"], c["n_routed_experts"], c["n_group"], c["topk_group"]
    tokens = 0
    differs_from_plain_topk = 0  # group limit and/or bias changed the chosen set
    differs_without_bias = 0
    differs_without_groups = 0
    used = set()
    for gate, logits, chosen in captured:
        chosen_sets = [frozenset(r.tolist()) for r in chosen]
        used.update(e for s in chosen_sets for e in s)
        tokens += len(chosen_sets)
        if c["model_type"] == "deepseek_v3":
            scores = logits.sigmoid()
            bias = gate.e_score_correction_bias.float()
            plain = topk_sets(scores, k)
            no_bias = topk_sets(group_limit(scores, G, TG, v3=True), k)
            no_groups = topk_sets(scores + bias, k)
            differs_without_bias += sum(a != b for a, b in zip(chosen_sets, no_bias))
            differs_without_groups += sum(a != b for a, b in zip(chosen_sets, no_groups))
        else:
            scores = logits.softmax(-1)
            plain = topk_sets(scores, k)
        differs_from_plain_topk += sum(a != b for a, b in zip(chosen_sets, plain))
    report = {
        "routed_tokens": tokens,
        "experts_used": f"{len(used)}/{E}",
        "differs_from_plain_topk": differs_from_plain_topk,
    }
    if c["model_type"] == "deepseek_v3":
        report["differs_without_bias"] = differs_without_bias
        report["differs_without_group_limit"] = differs_without_groups
        if differs_without_bias == 0 or differs_without_groups == 0:
            raise SystemExit(f"v3 routing does not exercise both the bias and the group limit: {report}")
    elif c["topk_method"] == "group_limited_greedy" and differs_from_plain_topk == 0:
        raise SystemExit(f"group_limited_greedy never changed a choice: {report}")
    if len(used) < E:
        raise SystemExit(f"some experts are never routed to: {report}")
    return report


def topk_sets(scores, k):
    return [frozenset(r.tolist()) for r in torch.topk(scores, k, dim=-1).indices]


def group_limit(scores, G, TG, v3):
    T, E = scores.shape
    grouped = scores.view(T, G, E // G)
    gs = grouped.topk(2, dim=-1).values.sum(-1) if v3 else grouped.max(-1).values
    keep = torch.zeros(T, G, dtype=torch.bool)
    keep.scatter_(1, gs.topk(TG, dim=-1).indices, True)
    return scores.masked_fill(~keep.repeat_interleave(E // G, 1), float("-inf"))


# ----------------------------------------------------------------------------------------------
# W8A8: the activations entering the FP8 linears quantised as DeepSeek-V3 does at run time.
# ----------------------------------------------------------------------------------------------


def act_quant(x):
    """DeepSeek-V3's dynamic activation quantisation ("activation_scheme": "dynamic"), emulated in f32.

    Per token and per group of 128 columns: scale = amax / 448, x_q = e4m3(x / scale) (clamped to
    +-448), returned dequantised as x_q * scale. A last partial group (none in these models) is
    padded with zeros; an all-zero group gets a tiny scale instead of 0/0.
    """
    k = x.shape[-1]
    pad = -k % FP8_BLOCK
    groups = (k + pad) // FP8_BLOCK
    g = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], groups, FP8_BLOCK)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(*x.shape[:-1], k + pad)[..., :k].to(x.dtype)


def quantised_experts_forward(quant):
    """transformers 5.17's eager DeepseekV3Experts.forward, op for op, with `quant` applied to the
    input of gate_up_proj and of down_proj (the fused experts call F.linear, so no hook can reach)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = quant(hidden_states[token_idx])
            gate, up = torch.nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = quant(self.act_fn(gate) * up)
            current_hidden_states = torch.nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states

    return forward


def quantise_fp8_linear_inputs(model, roles, quant):
    """Apply `quant` to the input of every linear whose weight is stored FP8 (the LINEAR role: q_a,
    q_b, kv_a, kv_b, o_proj, dense/shared/routed gate, up, down; not lm_head or the router).
    Returns a function that undoes it."""
    handles, patched = [], []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and roles.get(name + ".weight") == LINEAR:
            handles.append(m.register_forward_pre_hook(lambda _m, args: (quant(args[0]), *args[1:])))
        elif name.endswith(".mlp.experts") and hasattr(m, "gate_up_proj"):
            m.forward = types.MethodType(quantised_experts_forward(quant), m)
            patched.append(m)
    covered = len(handles) + sum(3 * m.num_experts for m in patched)
    want = sum(r == LINEAR for r in roles.values())
    if covered != want:
        raise SystemExit(f"W8A8 emulation covers {covered} FP8 linears of {want}")

    def undo():
        for h in handles:
            h.remove()
        for m in patched:
            del m.forward  # back to the class's (HF's) forward

    return undo


@torch.no_grad()
def record_w8a8(model, roles, sequences, f32_logits, records):
    """oracle_w8a8_f32: the f32 model on the same token sequences with W8A8 activations, and how far
    it is from oracle_f32 (what FP8 activation quantisation alone costs)."""
    # With an identity quantiser the patched model must be HF's model: nothing but the inputs changes.
    undo = quantise_fp8_linear_inputs(model, roles, lambda x: x)
    same = max((logits_of(model, s) - f32_logits[n]).abs().max().item() for n, s in sequences.items())
    undo()
    if same > 1e-6:
        raise SystemExit(f"the W8A8 emulation with an identity quantiser changes the logits by {same}")

    undo = quantise_fp8_linear_inputs(model, roles, act_quant)
    logits = OrderedDict((n, logits_of(model, s).contiguous()) for n, s in sequences.items())
    agree, divergence_gaps = [], []
    for r in records:
        cont = greedy(model, r["prompt"], CONTINUATION_LEN)
        j = next((j for j, (a, b) in enumerate(zip(cont, r["continuation"])) if a != b), CONTINUATION_LEN)
        agree.append(j)
        if j < CONTINUATION_LEN:
            divergence_gaps.append(r["gaps"][j])
    undo()

    row_diff = torch.cat([(logits[n] - f32_logits[n]).abs().max(-1).values for n in logits])
    flips = 0
    for r in records:
        p = len(r["prompt"])
        rows = logits[r["name"]][p - 1 : p - 1 + CONTINUATION_LEN]
        flips += sum(int(a) != b for a, b in zip(rows.argmax(-1), r["continuation"]))
    out = {
        "identity_quantiser_max_diff": same,
        "max_abs_diff": row_diff.max().item(),
        "row_max_diff_median": row_diff.median().item(),
        "rows_over_0.5": f"{int((row_diff > 0.5).sum())}/{len(row_diff)}",
        # Teacher-forced: argmax of the W8A8 rows vs HF f32's continuation.
        "argmax_flips": f"{flips}/{CONTINUATION_LEN * len(records)}",
        # Free-running W8A8 greedy: leading tokens equal to HF f32's continuation, per prompt, and
        # HF f32's top1-top2 gap at each first divergence.
        "greedy_agreement": agree,
        "greedy_divergence_f32_gaps": divergence_gaps,
    }
    return logits, out


# ----------------------------------------------------------------------------------------------
# Checks that the written files are what HF itself would load.
# ----------------------------------------------------------------------------------------------


def check_reload(variant_dir, c, sequences, reference):
    """from_pretrained(dir) must reproduce the in-memory model's logits: names and config are right."""
    model, info = model_class(c).from_pretrained(
        variant_dir, dtype=torch.float32, output_loading_info=True, **IMPL
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"{variant_dir}: from_pretrained loading info not clean: {bad}")
    model.eval()
    worst = 0.0
    for name, seq in sequences.items():
        diff = (logits_of(model, seq) - reference[name]).abs().max().item()
        worst = max(worst, diff)
    if worst > 1e-6:
        raise SystemExit(f"{variant_dir}: reloaded logits differ by {worst}")
    return worst


def check_fp8_file(variant_dir, model_w, roles):
    """Read model.safetensors back, dequantise it independently of memory, compare bit for bit."""
    saved = load_file(os.path.join(variant_dir, "model.safetensors"))
    expected_names = set(model_w) | {n + "_scale_inv" for n, r in roles.items() if r == LINEAR}
    if set(saved) != expected_names:
        raise SystemExit(f"fp8 file names differ: {sorted(set(saved) ^ expected_names)}")
    for name, w in model_w.items():
        t = saved[name]
        if roles[name] == LINEAR:
            s = saved[name + "_scale_inv"]
            want_s = [math.ceil(w.shape[0] / FP8_BLOCK), math.ceil(w.shape[1] / FP8_BLOCK)]
            if t.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 or list(s.shape) != want_s:
                raise SystemExit(f"{name}: {t.dtype} {s.dtype} {list(s.shape)}")
            back = t.float() * s.repeat_interleave(FP8_BLOCK, 0)[: w.shape[0]].repeat_interleave(FP8_BLOCK, 1)[
                :, : w.shape[1]
            ]
        else:
            back = t.float()
        if not torch.equal(back, w):
            raise SystemExit(f"{name}: saved fp8 tensor does not dequantise to the weights HF ran on")


def try_hf_fp8_dequantize(variant_dir, c, sequences, reference):
    """Informational: HF's own FP8 loader in dequantize mode, compared with our f32 oracle."""
    try:
        from transformers import FineGrainedFP8Config

        model = model_class(c).from_pretrained(
            variant_dir,
            dtype=torch.float32,
            quantization_config=FineGrainedFP8Config(dequantize=True),
            device_map="cpu",
            **IMPL,
        )
        model.eval()
        worst = max((logits_of(model, s) - reference[n]).abs().max().item() for n, s in sequences.items())
        return f"loaded; max |logit diff| vs oracle_f32 = {worst:.3g}"
    except Exception as e:  # noqa: BLE001 - we only report what HF did
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"


# ----------------------------------------------------------------------------------------------


def write_variant(out_root, name, spec, skip_bf16):
    c = spec["config"]
    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(published_config(c), f, indent=2)
        f.write("\n")

    weights = make_weights(c, spec["seed"], spec.get("block_factor_log2"))
    saved, model_w, roles = checkpoint_and_model_weights(c, weights, spec["fp8"])
    save_file(saved, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})

    torch.manual_seed(0)
    model = build_model(d, c, model_w, torch.float32)
    check_dtypes(model, torch.float32)

    prompts = make_prompts(spec["seed"] + 77)
    records, f32_logits, sequences = [], OrderedDict(), OrderedDict()
    stats = {"variant": name}
    for pname, prompt in prompts.items():
        cont = greedy(model, prompt, CONTINUATION_LEN)
        seq = prompt + cont
        full = logits_of(model, seq)
        assert full.shape == (len(seq), VOCAB)
        rows = full[len(prompt) - 1 : len(prompt) - 1 + CONTINUATION_LEN]
        if rows.argmax(-1).tolist() != cont:
            raise SystemExit(f"{name}/{pname}: one-pass argmax disagrees with step-by-step greedy")
        records.append(
            {"name": pname, "prompt": prompt, "continuation": cont, "gaps": [top2_gap(r) for r in rows]}
        )
        f32_logits[pname] = full.contiguous()
        sequences[pname] = seq
    stats["min_gap"] = min(min(r["gaps"]) for r in records)
    stats["distinct_continuation_tokens"] = [len(set(r["continuation"])) for r in records]
    stats["eos_in_continuation"] = any(EOS in r["continuation"] for r in records)
    stats["logit_std"] = float(torch.cat(list(f32_logits.values())).std())
    stats["routing"] = routing_report(model, c, sequences.values())
    oracle_extra = {}
    if spec.get("w8a8"):
        w8a8_logits, oracle_extra["w8a8"] = record_w8a8(model, roles, sequences, f32_logits, records)
        save_file(w8a8_logits, os.path.join(d, "oracle_w8a8_f32.safetensors"), metadata={"format": "pt"})
        stats["w8a8"] = oracle_extra["w8a8"]

    if spec["fp8"]:
        check_fp8_file(d, model_w, roles)
        stats["reload"] = "model.safetensors re-read and dequantised: bit-identical to the weights HF ran on"
        stats["hf_fp8_dequantize_loader"] = try_hf_fp8_dequantize(d, c, sequences, f32_logits)
    else:
        stats["reload_max_diff"] = check_reload(d, c, sequences, f32_logits)

    save_file(f32_logits, os.path.join(d, "oracle_f32.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "oracle.json"), "w") as f:
        json.dump(
            {
                "variant": name,
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
                "prompts": records,
                **oracle_extra,
            },
            f,
        )
        f.write("\n")

    if not skip_bf16:
        stats.update(record_bf16(d, c, model_w, sequences, f32_logits, records, spec["fp8"]))
    return stats


def record_bf16(d, c, model_w, sequences, f32_logits, records, fp8, dev=torch.device("cuda")):
    model = build_model(d, c, model_w, torch.bfloat16).to(dev)
    check_dtypes(model, torch.bfloat16)
    logits = OrderedDict((n, logits_of(model, s).contiguous()) for n, s in sequences.items())
    save_file(logits, os.path.join(d, "oracle_bf16_cuda.safetensors"), metadata={"format": "pt"})
    row_diff = torch.cat([(logits[n] - f32_logits[n]).abs().max(-1).values for n in logits])
    out = {
        "bf16_max_abs_diff": row_diff.max().item(),
        # Most rows differ by bf16 rounding; a few by a routing choice that flipped in bf16.
        "bf16_row_max_diff_median": row_diff.median().item(),
        "bf16_rows_over_0.5": f"{int((row_diff > 0.5).sum())}/{len(row_diff)}",
    }
    flips = 0
    for r in records:
        p = len(r["prompt"])
        rows = logits[r["name"]][p - 1 : p - 1 + CONTINUATION_LEN]
        flips += sum(int(a) != b for a, b in zip(rows.argmax(-1), r["continuation"]))
    out["bf16_argmax_flips"] = f"{flips}/{CONTINUATION_LEN * len(records)}"
    if not fp8:
        # The canonical HF path must give the same numbers as our construction.
        ref, _ = model_class(c).from_pretrained(d, dtype=torch.bfloat16, output_loading_info=True, **IMPL)
        ref = ref.to(dev).eval()
        out["bf16_vs_from_pretrained_max_diff"] = max(
            (logits_of(ref, s) - logits[n]).abs().max().item() for n, s in sequences.items()
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures", help="root directory; one subdirectory per variant")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument(
        "--skip-bf16",
        action="store_true",
        help="do not write oracle_bf16_cuda.safetensors (for trying the script on a machine without CUDA)",
    )
    args = ap.parse_args()
    if not args.skip_bf16 and not torch.cuda.is_available():
        sys.exit("oracle_bf16_cuda needs a CUDA GPU (or pass --skip-bf16)")
    # f32 oracle runs on the CPU; keep any GPU f32 math honest too.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    if torch.cuda.is_available():
        print(f"cuda device: {torch.cuda.get_device_name(0)}", flush=True)
    all_stats = []
    for name in args.variants:
        stats = write_variant(args.out, name, VARIANTS[name], args.skip_bf16)
        print(json.dumps(stats), flush=True)
        all_stats.append(stats)
    run = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    log_path = os.path.join(args.out, "generation_log.json")
    if set(args.variants) != set(VARIANTS) and os.path.exists(log_path):
        all_stats, run = merged_log(log_path, all_stats, run)
    with open(log_path, "w") as f:
        json.dump({**run, "variants": all_stats}, f, indent=2)
        f.write("\n")


def merged_log(log_path, new_stats, run):
    """A --variants subset updates its entries of an existing generation_log.json and keeps the
    others; where this run's versions or GPU differ from the log's, its entries say so under "run"."""
    with open(log_path) as f:
        old = json.load(f)
    old_run = {k: old.get(k) for k in run}
    if old_run != run:
        new_stats = [{**s, "run": run} for s in new_stats]
    entries = OrderedDict((s["variant"], s) for s in old.get("variants", []))
    entries.update((s["variant"], s) for s in new_stats)
    order = [n for n in VARIANTS if n in entries] + [n for n in entries if n not in VARIANTS]
    return [entries[n] for n in order], old_run


if __name__ == "__main__":
    main()
