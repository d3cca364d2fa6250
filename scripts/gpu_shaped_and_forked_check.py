#!/usr/bin/env python3
"""On a GPU machine, through the real server and the official `openai` SDK: MTP drafts of
penalised and biased requests, and n-way requests whose completions fork the block their prompt
ends in, on the `v3_mtp_fp8_real_dims` fixture (HF's layout, block FP8, an MTP layer; the demo
tokenizer, whose 512 ids it shares). Each check runs on a server without speculation and on one
with two MTP drafts:

- greedy requests with presence and frequency penalties and banned tokens (logit_bias -100) give
  the plain server's tokens up to the first near-tie, and never a banned token;
- n = 4 greedy completions of one prompt equal its n = 1 completion up to the first near-tie
  (each completion computes the prompt's last token in a copy of the block the prompt ends in);
- a sampled, penalised and biased request with a seed gives the same tokens twice;
- greedy structured-output requests (regex, choice, JSON schema), one prompt at a time, give the
  plain server's tokens up to where both runs' tokens are within the tie of each other (the
  masks hide which tokens the grammar allowed, so a divergence is judged by the two tokens chosen
  there: both allowed, and a tie if the plain run scored them within `--tie`), and a finished
  choice is one of them. One at a time, because steps of more than four tokens quantize their
  activations to FP8 (W8A8), whose rounding flips between batch shapes move this random-weight
  model's logprobs by up to 1.2 (run S62, where the batched form failed 4 of 48 such checks,
  every one at a choice among the grammar's allowed tokens, which sit closer together than the
  model's top two); at one sequence both servers' steps (1 row, or 3 verify rows) run the exact
  W8A16 GEMVs;
- with speculation, the shaped and the structured requests drafted (the server's spec-decode
  counters moved).

A near-tie is a position where the plain run's best two candidates, shaped as the request shapes
them, are within `--tie` nats: there a bf16 forward of another batch shape may choose either, and
everything after may differ. Each logit may round apart between two batch shapes by up to half of
`ROUNDING_BF16` (0.06, measured in run S27: mla_core::speculative::lossless_check), so a gap moves
by up to 0.06 on either run, 0.12 between them: the default. (Run S52 saw four n = 4 completions
with drafts take the other token at a gap of 0.06.) Repetition penalties scale logits, which logprobs do not show, so the
greedy checks use additive shaping only (the sampled one uses all three; the statistical checks
in crates/mla-cuda/tests/gpu_mtp.rs cover repetition). Writes JSON; exits 1 when a check fails.

    scripts/gpu_shaped_and_forked_check.py --bin target/release/mla-serve --out check.json
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from run_envelope import envelope  # noqa: E402  (beside this script)

FIXTURE = ROOT / "tests" / "fixtures" / "v3_mtp_fp8_real_dims"
# Every step drafts: the measured load rule (on by default) stops drafting where this fixture's
# untrained layer's drafts do not stand (run S67: 16 and 4 drafts), and the checks are about what
# drafting does to outputs.
MTP = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--speculative-load-rule", "off"]
NEW_TOKENS = 24
BANNED = [17, 201]
SHAPING = {"presence_penalty": 0.4, "frequency_penalty": 0.2}
CHOICES = ["alpha beta gamma delta", "alpha beta gamma epsilon", "zeta"]
STRUCTURED = {
    "regex": {"guided_regex": "[0-9]{2}(-[a-z]{2,5})+"},
    "choice": {"guided_choice": CHOICES},
    "json": {
        "guided_json": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}}},
            "required": ["name", "tags"],
        }
    },
}


def model_dir(path: Path) -> Path:
    for name in ("config.json", "model.safetensors"):
        (path / name).symlink_to(FIXTURE / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets" / "demo" / name, path / name)
    return path


def prompts() -> list:
    main = json.loads((ROOT / "tests" / "fixtures" / "v3_fp8_real_dims" / "oracle.json").read_text())
    rng = random.Random(5)
    extra = [[0] + [rng.randrange(2, 512) for _ in range(rng.randrange(20, 90))] for _ in range(5)]
    return [p["prompt"] for p in main["prompts"]] + extra


def ids(choice) -> list:
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens]


def shaped_gaps(choice, prompt: list, shaped: bool) -> list:
    """Per position, the gap between the best two of the top logprobs once shaped as the request
    shaped them (penalties by the output so far, banned tokens out)."""
    out, gaps = ids(choice), []
    for j, top in enumerate(choice.logprobs.top_logprobs):
        counts = {}
        for t in out[:j]:
            counts[t] = counts.get(t, 0) + 1
        vals = []
        for tok, lp in top.items():
            t = int(tok.split(":")[1])
            if shaped:
                if t in BANNED:
                    continue
                c = counts.get(t, 0)
                lp -= (SHAPING["presence_penalty"] + SHAPING["frequency_penalty"] * c) if c else 0.0
            vals.append(lp)
        vals.sort(reverse=True)
        gaps.append(vals[0] - vals[1] if len(vals) > 1 else 0.0)
    return gaps


def agreed(ours: list, plain: list, gaps: list, tie: float) -> tuple:
    """(positions compared, whether they agree): up to and including the first near-tie of the
    plain run, the first position where either may choose differently."""
    n = min(len(ours), len(plain))
    stop = next((j for j in range(n) if gaps[j] < tie), n)
    upto = min(stop + 1, n)
    first_diff = next((j for j in range(n) if ours[j] != plain[j]), n)
    return upto, first_diff >= stop


def diverged_at_a_tie(ours: list, plain: list, plain_top: list, tie: float) -> tuple:
    """(positions equal, whether any divergence is at a tie): at the first position where the
    runs differ, both chose an allowed token after the same prefix; it is a tie when the plain
    run scored the two within `tie` (the other token among its top logprobs)."""
    n = min(len(ours), len(plain))
    j = next((j for j in range(n) if ours[j] != plain[j]), None)
    if j is None:
        return n, len(ours) == len(plain)
    top = plain_top[j]
    return j, ours[j] in top and top[plain[j]] - top[ours[j]] < tie


def structured(c, ps: list) -> dict:
    """Each structured kind's greedy completion of each of `ps`, one request at a time: tokens,
    top logprobs by id, text and finish reason."""
    out = {}
    for kind, body in STRUCTURED.items():
        out[kind] = []
        for p in ps:
            r = c.completions.create(
                model="m", prompt=p, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=20,
                extra_body={"return_tokens_as_token_ids": True, **body},
            )
            x = r.choices[0]
            out[kind].append({
                "ids": ids(x),
                "top": [{int(t.split(":")[1]): lp for t, lp in top.items()} for top in x.logprobs.top_logprobs],
                "text": x.text,
                "finish": x.finish_reason,
            })
    return out


def logprob_spread(ours: list, plain: list) -> float:
    """The largest difference of one token's logprob between the runs at positions where their
    prefixes are equal (how far the two servers' numerics are apart)."""
    worst = 0.0
    for a, b in zip(ours, plain):
        n = next((j for j in range(min(len(a["ids"]), len(b["ids"]))) if a["ids"][j] != b["ids"][j]), len(a["ids"]))
        for ta, tb in zip(a["top"][: n + 1], b["top"][: n + 1]):
            worst = max([worst] + [abs(v - ta[t]) for t, v in tb.items() if t in ta])
    return worst


def run(device: str, flags: list, ps: list) -> dict:
    from server import Server  # noqa: E402  (reads MLA_SERVE_BIN)

    with tempfile.TemporaryDirectory() as d:
        server = Server("--model", str(model_dir(Path(d))), "--served-model-name", "m", "--device", device, *flags)
        try:
            c = server.client()
            common = dict(model="m", max_tokens=NEW_TOKENS, logprobs=20)
            extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
            before = server.metrics().get("mla:spec_decode_num_draft_tokens_total", 0.0)
            shaped = c.completions.create(
                prompt=ps, temperature=0.0, logit_bias={str(t): -100 for t in BANNED}, extra_body={**extra, **SHAPING}, **common
            )
            drafted = server.metrics().get("mla:spec_decode_num_draft_tokens_total", 0.0) - before
            forked = c.completions.create(prompt=ps[2], temperature=0.0, n=4, extra_body=extra, **common)
            single = c.completions.create(prompt=ps[2], temperature=0.0, extra_body=extra, **common)

            def sampled():
                r = c.completions.create(
                    prompt=ps[1], temperature=0.9, seed=11, logit_bias={str(t): -100 for t in BANNED},
                    extra_body={**extra, **SHAPING, "repetition_penalty": 1.2}, **common,
                )
                return ids(r.choices[0])

            choices = sorted(shaped.choices, key=lambda x: x.index)
            before = server.metrics().get("mla:spec_decode_num_draft_tokens_total", 0.0)
            constrained = structured(c, ps)
            drafted_structured = server.metrics().get("mla:spec_decode_num_draft_tokens_total", 0.0) - before
            return {
                "structured": constrained,
                "drafted_by_structured": drafted_structured,
                "shaped": [ids(x) for x in choices],
                "shaped_gaps": [shaped_gaps(x, p, True) for x, p in zip(choices, ps)],
                "forked": [ids(x) for x in sorted(forked.choices, key=lambda x: x.index)],
                "single": ids(single.choices[0]),
                "single_gaps": shaped_gaps(single.choices[0], ps[2], False),
                "sampled_twice": [sampled(), sampled()],
                "drafted_by_shaped": drafted,
            }
        finally:
            if server.stop() != 0:
                raise RuntimeError("the server did not exit cleanly:\n" + server.log_text()[-3000:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tie", type=float, default=0.12)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the CPU reference")
    args = ap.parse_args()
    os.environ["MLA_SERVE_BIN"] = str(Path(args.bin).resolve())
    ps = prompts()
    runs = {"plain": run(args.device, [], ps), "mtp": run(args.device, MTP, ps)}
    plain = runs["plain"]
    failures, checks = [], []

    def check(name: str, ok: bool, detail: str):
        checks.append({"check": name, "ok": ok, "detail": detail})
        print(("ok   " if ok else "FAIL ") + f"{name}: {detail}")
        if not ok:
            failures.append(name)

    for mode, r in runs.items():
        compared = 0
        for i, (ours, ref, gaps) in enumerate(zip(r["shaped"], plain["shaped"], plain["shaped_gaps"])):
            n, ok = agreed(ours, ref, gaps, args.tie)
            compared += n
            check(f"{mode}: shaped greedy prompt {i} as plain", ok, f"{n} positions compared")
            banned = [t for t in ours if t in BANNED]
            check(f"{mode}: shaped greedy prompt {i} bans", not banned, f"banned tokens emitted: {banned}")
        check(f"{mode}: shaped greedy, enough compared", compared >= 60, f"{compared} positions in all")
        for k, ours in enumerate(r["forked"]):
            n, ok = agreed(ours, plain["single"], plain["single_gaps"], args.tie)
            check(f"{mode}: n=4 completion {k} as n=1 plain", ok, f"{n} positions compared")
        a, b = r["sampled_twice"]
        check(f"{mode}: sampled shaped request reproduces", a == b and len(a) == NEW_TOKENS, f"{len(a)} tokens")
        for kind, outs in r["structured"].items():
            for i, (ours, ref) in enumerate(zip(outs, plain["structured"][kind])):
                n, ok = diverged_at_a_tie(ours["ids"], ref["ids"], ref["top"], args.tie)
                check(f"{mode}: {kind} prompt {i} as plain", ok, f"{n} positions equal of {len(ref['ids'])}")
                if kind == "choice" and ours["finish"] == "stop":
                    check(f"{mode}: choice prompt {i} is a choice", ours["text"] in CHOICES, repr(ours["text"]))
            print(f"{mode}: {kind}: largest logprob difference from plain at equal prefixes {logprob_spread(outs, plain['structured'][kind]):.3f}")
    check("mtp: shaped requests drafted", runs["mtp"]["drafted_by_shaped"] > 0, f"{runs['mtp']['drafted_by_shaped']:.0f} drafts")
    drafted = runs["mtp"]["drafted_by_structured"]
    check("mtp: structured requests drafted", drafted > 0, f"{drafted:.0f} drafts")
    out = envelope(binary=args.bin, device=args.device, tie=args.tie, checks=checks, runs=runs)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(checks) - len(failures)} of {len(checks)} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
