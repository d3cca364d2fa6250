#!/usr/bin/env python3
"""Time to first token of short chats that arrive while one long prompt is being prefilled, and
the long prompt's own time, against a server this script starts with the demo model and the
given extra flags (e.g. --long-prefill-token-threshold 256; a GPU model's flags with its served
name in --model-name). Writes JSON (date, commit,
command) and prints a line per round.

    scripts/ttft_beside_long_prompt.py --bin target/debug/mla-serve --out ttft.json -- [SERVER FLAGS]
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from probe_server import add_server_args, start_server  # noqa: E402  (beside this script)
from run_envelope import envelope  # noqa: E402  (beside this script)


async def first_token_s(client: httpx.AsyncClient, body: dict) -> float:
    t = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
            # The first chunk names the role with empty content; the first token comes after,
            # with its id (`return_token_ids`), so a token whose text is empty (a dummy model's
            # ids beyond the demo tokenizer's) counts too.
            if choices[0].get("token_ids") or choices[0].get("delta", {}).get("content"):
                return time.perf_counter() - t
    raise RuntimeError("no token came")


async def one_round(base: str, model: str, long_len: int, shorts: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        # Distinct ids each round, so the prefix cache holds none of the long prompt.
        salt = int(time.time() * 1000) % 400
        long_body = {"model": model, "prompt": [(salt + i * 7) % 400 + 20 for i in range(long_len)], "max_tokens": 1}
        t = time.perf_counter()
        long_task = asyncio.create_task(c.post("/v1/completions", json=long_body))
        await asyncio.sleep(0.05)
        short = {"model": model, "messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 8,
                 "return_token_ids": True}
        ttfts = await asyncio.gather(*(first_token_s(c, short) for _ in range(shorts)))
        r = await long_task
        r.raise_for_status()
        return {"long_s": round(time.perf_counter() - t, 3), "short_ttft_ms": [round(x * 1e3, 1) for x in ttfts]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--long-len", type=int, default=3000)
    ap.add_argument("--shorts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    add_server_args(ap)
    args = ap.parse_args()
    server = start_server(args)
    out = envelope(binary=args.bin, server_flags=args.flags, long_len=args.long_len, rounds=[])
    try:
        for _ in range(args.rounds):
            r = asyncio.run(one_round(server.base, args.model_name, args.long_len, args.shorts))
            out["rounds"].append(r)
            print(f"flags {args.flags}: long prompt {r['long_s']} s, short TTFT ms {r['short_ttft_ms']}")
    finally:
        server.stop()
    ttfts = [x for r in out["rounds"] for x in r["short_ttft_ms"]]
    out["short_ttft_ms_median"] = statistics.median(ttfts)
    out["long_s_median"] = statistics.median(r["long_s"] for r in out["rounds"])
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"median short TTFT {out['short_ttft_ms_median']} ms, long prompt {out['long_s_median']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
