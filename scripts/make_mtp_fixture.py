#!/usr/bin/env python3
"""Build the MTP (multi-token prediction) oracle fixtures: tests/fixtures/v3_mtp, v3_mtp_fp8 and
v3_mtp_fp8_real_dims.

Why: HF transformers loads DeepSeek-V3 but ignores its MTP module (layer `num_hidden_layers` of
the checkpoint), so it offers no draft logits to test against. This script writes the module's
oracle from its published definition, in f32 on the CPU:

    x_i    = eh_proj( [ enorm(embed(t_{i+1})) ; hnorm(h_i) ] )    embedding half first
    y      = decoder layer (MLA with its own cache, MoE) over x_0..x_i at positions 0..i
    draft  = lm_head( shared_head.norm(y_i) )                     logits for t_{i+2}

where h_i is HF's `last_hidden_state` of the main model at position i (after `model.norm`, the
rows `lm_head` sees). The decoder layer, its RoPE (YaRN) and routing are HF's own
`DeepseekV3DecoderLayer`: a one-layer `DeepseekV3ForCausalLM` holding the MTP layer's weights,
`shared_head.norm` as its final norm and the main `lm_head`, run on `inputs_embeds = x`. Only the
two norms, the concatenation and `eh_proj` are written here. The concatenation order and the
choice of h_i follow vLLM (`deepseek_mtp.py`) and SGLang (`deepseek_nextn.py`); SGLang does not
zero the embedding at position 0 (vLLM does), and neither does this oracle.

The main model is `v3`'s exactly (same seed): its logits must equal v3's committed oracle, which
the script checks. The MTP layer has its own seed. `v3_mtp_fp8` stores the same weights block-FP8
as the published checkpoints do (every linear of the main model and of the MTP layer; `eh_proj`
stays bf16, as published) and its oracle runs on the dequantised weights.

    /tmp/tv/bin/python scripts/make_mtp_fixture.py --out tests/fixtures
"""

import argparse
import copy
import json
import os
import sys
from collections import OrderedDict

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

MTP_SEED = 1007


# name -> (the fixture whose main model it carries exactly, FP8 or not). The real-dims one has the
# MLA dims the CUDA kernels are built for, so the GPU runs it (crates/mla-cuda/tests/gpu_mtp.rs).
BUILDS = {
    "v3_mtp": ("v3", False),
    "v3_mtp_fp8": ("v3", True),
    "v3_mtp_fp8_real_dims": ("v3_fp8_real_dims", True),
}


def mtp_config(main_variant, fp8):
    base = mf.VARIANTS[main_variant]["config"]
    if fp8 and "quantization_config" not in base:
        base = {**base, "quantization_config": mf.V3_FP8["quantization_config"]}
    return {**base, "num_nextn_predict_layers": 1}


def mtp_specs(c):
    """The MTP module's tensors in the published layout: layer `num_hidden_layers` (2 here)."""
    L, H = c["num_hidden_layers"], c["hidden_size"]
    p = f"model.layers.{L}"
    # The decoder layer as main layer L would be (MoE: L >= first_k_dense_replace).
    deeper = {**c, "num_hidden_layers": L + 1}
    layer = [s for s in mf.weight_specs(deeper) if s[0].startswith(p + ".")]
    return (
        [(f"{p}.enorm.weight", [H], mf.NORM), (f"{p}.hnorm.weight", [H], mf.NORM)]
        + [(f"{p}.eh_proj.weight", [H, 2 * H], "eh_proj")]
        + layer
        + [(f"{p}.shared_head.norm.weight", [H], mf.NORM)]
    )


def make_mtp_weights(c):
    g = torch.Generator().manual_seed(MTP_SEED)
    out = OrderedDict()
    for name, shape, role in mtp_specs(c):
        if role == mf.NORM:
            w = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif role == mf.ROUTER:
            w = torch.randn(shape, generator=g) * (2.0 / shape[1] ** 0.5)
        elif role == mf.BIAS:
            w = (torch.rand(shape, generator=g) * 2.0 - 1.0) * 0.25
        elif role in (mf.LINEAR, "eh_proj"):
            w = torch.randn(shape, generator=g) / shape[1] ** 0.5
        else:
            raise AssertionError(role)
        out[name] = mf.bf16_exact(w)
    return out


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mtp_model(variant_dir, c, mtp_f32, lm_head):
    """A one-layer HF DeepseekV3ForCausalLM: the MTP decoder layer, shared_head.norm, lm_head."""
    L = c["num_hidden_layers"]
    hf_cfg = mf.AutoConfig.from_pretrained(variant_dir)
    if getattr(hf_cfg, "quantization_config", None) is not None:
        del hf_cfg.quantization_config
    hf_cfg = copy.deepcopy(hf_cfg)
    hf_cfg.num_hidden_layers = 1
    hf_cfg.first_k_dense_replace = 0  # the MTP layer is a MoE layer
    hf_cfg.num_nextn_predict_layers = 0
    model = mf.DeepseekV3ForCausalLM._from_config(hf_cfg, dtype=torch.float32, **mf.IMPL)
    one = {"num_hidden_layers": 1, "first_k_dense_replace": 0}
    published = OrderedDict()
    prefix = f"model.layers.{L}."
    for name, w in mtp_f32.items():
        if name.startswith(prefix + "self_attn") or name.startswith(prefix + "mlp") or "layernorm" in name:
            published["model.layers.0." + name[len(prefix) :]] = w
    published["model.norm.weight"] = mtp_f32[prefix + "shared_head.norm.weight"]
    published["lm_head.weight"] = lm_head
    published["model.embed_tokens.weight"] = torch.zeros(mf.VOCAB, c["hidden_size"])  # unused: inputs_embeds
    sd = mf.to_hf_state_dict({**c, **one}, published)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise SystemExit(f"MTP state dict mismatch: missing {missing}, unexpected {unexpected}")
    mf.keep_router_bias_f32(model, {k: v for k, v in sd.items() if k.endswith("e_score_correction_bias")})
    model.eval()
    return model


@torch.no_grad()
def draft_logits(main, mtp, mtp_f32, c, seq):
    """Rows i = 0..len-2 of the MTP module over `seq`, teacher-forced: (h, draft logits)."""
    L, eps = c["num_hidden_layers"], mf.COMMON["rms_norm_eps"]
    p = f"model.layers.{L}."
    ids = torch.tensor([seq])
    h = main.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # after model.norm
    e = main.model.embed_tokens(ids)[0]
    x = torch.cat([rms_norm(e[1:], mtp_f32[p + "enorm.weight"], eps), rms_norm(h[:-1], mtp_f32[p + "hnorm.weight"], eps)], -1)
    x = x @ mtp_f32[p + "eh_proj.weight"].T
    positions = torch.arange(len(seq) - 1)[None]
    out = mtp(inputs_embeds=x[None], position_ids=positions, use_cache=False)
    return h, out.logits[0]


def build(out_root, name):
    main_variant, fp8 = BUILDS[name]
    c = mtp_config(main_variant, fp8)
    v = mf.VARIANTS[main_variant]
    main_c = v["config"]
    main_w = mf.make_weights(main_c, v["seed"], v.get("block_factor_log2"))
    mtp_w = make_mtp_weights(c)
    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(mf.published_config(c), f, indent=2)
        f.write("\n")

    saved_main, main_f32, _ = mf.checkpoint_and_model_weights(main_c, main_w, fp8)
    saved, mtp_f32 = OrderedDict(saved_main), OrderedDict()
    L = c["num_hidden_layers"]
    for n, w in mtp_w.items():
        if n.endswith("e_score_correction_bias"):
            saved[n], mtp_f32[n] = w.clone(), w
        elif fp8 and ".eh_proj." not in n and w.dim() == 2 and ".gate.weight" not in n:
            q, s = mf.quantize_fp8_block(w)
            saved[n], saved[n + "_scale_inv"] = q, s
            mtp_f32[n] = mf.dequantize_fp8_block(q, s)
        else:
            saved[n], mtp_f32[n] = w.to(torch.bfloat16), w
    # The published checkpoints also carry copies of the embedding and head in the MTP layer.
    saved[f"model.layers.{L}.embed_tokens.weight"] = main_w["model.embed_tokens.weight"].to(torch.bfloat16)
    saved[f"model.layers.{L}.shared_head.head.weight"] = main_w["lm_head.weight"].to(torch.bfloat16)
    save_file(saved, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})

    main_cfg_dir = os.path.join(d, ".main")
    os.makedirs(main_cfg_dir, exist_ok=True)
    main_keys = {**c, "num_nextn_predict_layers": 0}
    with open(os.path.join(main_cfg_dir, "config.json"), "w") as f:
        json.dump(mf.published_config(main_keys), f)
    main = mf.build_model(main_cfg_dir, main_c, main_f32, torch.float32)
    mtp = mtp_model(main_cfg_dir, c, mtp_f32, main_f32["lm_head.weight"])
    os.remove(os.path.join(main_cfg_dir, "config.json"))
    os.rmdir(main_cfg_dir)

    # The prompts and continuations are the main fixture's (the same model, or its FP8 copy).
    oracle = json.load(open(os.path.join(out_root, main_variant, "oracle.json")))
    same_main = fp8 == ("quantization_config" in main_c)
    tensors, record = OrderedDict(), OrderedDict()
    main_vs_v3 = 0.0
    v3_f32 = load_file(os.path.join(out_root, main_variant, "oracle_f32.safetensors"))
    for entry in oracle["prompts"]:
        pname = entry["name"]
        seq = entry["prompt"] + entry["continuation"]
        h, draft = draft_logits(main, mtp, mtp_f32, c, seq)
        if same_main:
            # The main model is the main fixture's: its logits are that fixture's oracle, up to
            # the rounding of another torch build (those oracles were made with an earlier one).
            logits = main.lm_head(h)
            diff = (logits - v3_f32[pname]).abs().max().item()
            if diff > 1e-4:
                raise SystemExit(f"{pname}: the main model is not {main_variant}'s (max logit difference {diff})")
            main_vs_v3 = max(main_vs_v3, diff)
        tensors[f"{pname}.hidden"] = h.contiguous()
        tensors[f"{pname}.draft_logits"] = draft.contiguous()
        top2 = draft.topk(2, -1).values
        agree = (draft[:-1].argmax(-1) == torch.tensor(seq[2:])).float().mean().item()
        record[pname] = {
            "tokens": seq,
            "rows": len(seq) - 1,
            "min_top2_gap": float((top2[:, 0] - top2[:, 1]).min()),
            "draft_agrees_with_sequence": round(agree, 4),
        }
    save_file(tensors, os.path.join(d, "oracle_mtp_f32.safetensors"))
    with open(os.path.join(d, "oracle_mtp.json"), "w") as f:
        json.dump(
            {
                "what": "MTP draft logits, teacher-forced over v3's prompt + continuation; "
                "row i drafts the token at i + 2 from h_i and token i + 1",
                "torch": torch.__version__,
                "transformers": mf.transformers.__version__,
                "mtp_seed": MTP_SEED,
                "main_fixture": main_variant,
                "main_logits_vs_its_oracle": main_vs_v3 if same_main else None,
                "prompts": record,
            },
            f,
            indent=2,
        )
        f.write("\n")
    print(name, json.dumps(record))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", choices=sorted(BUILDS), action="append", help="build only these (default: all)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    for name in args.only or BUILDS:
        build(args.out, name)


if __name__ == "__main__":
    main()
