#!/usr/bin/env python3
"""Writes a tokenizer directory whose vocabulary covers a dummy model's full vocab_size, for
serving benchmarks of `--load-format dummy` models that have no tokenizer of their own.

The bundled demo tokenizer has 512 ids; a DeepSeek-V2-Lite-shaped model samples ids up to 102399,
which it decodes to empty text, and servers send no stream chunk for empty text, so inter-token
latency would be measured over runs of invisible tokens. This keeps the demo's 512 ids and special
tokens and gives every further id its own word (" w<id>", byte-level), so every token is text.

usage: wide_tokenizer.py assets/demo OUT_DIR VOCAB_SIZE
"""
import json
import shutil
import sys
from pathlib import Path

src, out, vocab_size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
tok = json.loads((src / "tokenizer.json").read_text())
vocab = tok["model"]["vocab"]
# Added tokens go into the model vocabulary too, so that it is contiguous and the library keeps
# their ids instead of renumbering them past the end.
for t in tok["added_tokens"]:
    vocab[t["content"]] = t["id"]
taken = set(vocab.values())
assert taken == set(range(len(taken))), "the demo vocabulary has holes"

start = max(taken) + 1
for i in range(start, vocab_size):
    vocab["\u0120w" + str(i)] = i  # \u0120 is the byte-level symbol of a space
out.mkdir(parents=True, exist_ok=True)
(out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
print(f"{out}: ids {start}..{vocab_size - 1} added to {src}'s tokenizer")
