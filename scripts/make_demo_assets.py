#!/usr/bin/env python3
"""Build the bundled demo model's text assets in assets/demo/.

The demo model and every test fixture model have vocab_size 512, so the tokenizer has exactly 512
ids: a byte-level BPE trained here on the English text below (plus a few lines of CJK, accents and
emoji so that some learned tokens hold *partial* UTF-8 characters, the case incremental
detokenization must get right), with DeepSeek-V3's special tokens added the way DeepSeek ships
them: begin/end of sentence and pad at ids 0..2, chat markers and tool markers at the end.

Outputs: tokenizer.json, tokenizer_config.json (chat_template = the published V3 template),
generation_config.json and config.json (a tiny DeepSeek-V3-shaped model the server runs with
deterministic random weights).

Usage: python3 scripts/make_demo_assets.py [--out assets/demo]
Needs only the `tokenizers` package. Training is deterministic, so re-running reproduces the files.
"""

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
REPO = Path(__file__).resolve().parent.parent
# The published DeepSeek-V3 chat template (kept byte-identical to the reference copy).
V3_TEMPLATE = REPO / "tests/fixtures/templates/deepseek-v3.jinja"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
# Special (skipped by skip_special_tokens): the sentence markers and the chat role markers.
HEAD_SPECIALS = [BOS, EOS, PAD]
TAIL_SPECIALS = ["<｜User｜>", "<｜Assistant｜>"]
# Tool-call markers stay visible in decoded text (special=false, as in DeepSeek-V3's tokenizer.json)
# because tool-call parsers read them from the generated text.
TOOL_MARKERS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]

CORPUS = """\
The little lighthouse stood at the end of a long stone pier, and every evening the keeper climbed
its spiral stairs to light the lamp. Ships that passed in the night saw the beam sweep across the
water and knew that the harbour was near. In the morning the keeper wrote in his log book: the
weather, the wind, the number of boats that had come home, and anything strange he had seen.
One winter the storms came early. Rain hammered the windows and the sea rose higher than anyone
could remember. The keeper did not sleep for three days; he trimmed the wick, polished the glass
and kept the light turning. When the weather finally cleared, the fishermen walked out along the
pier with bread, cheese and a warm blanket, and they thanked him for keeping them safe.
A server answers questions. It reads a request, checks that every field makes sense, turns the
text into tokens, and asks the model for the next token again and again until it is told to stop.
Each new token is turned back into text and sent to the user as soon as it is ready, so that the
answer appears word by word instead of all at once. If the user asks for a stop string, the server
must hold back any text that might be the beginning of that string, because it cannot know yet
whether the next token will complete it.
Good software is written for people to read. Names should say what things are, comments should
say why something is done, and tests should compare the program against an independent answer.
When a feature is missing, the program should say so clearly instead of pretending to work.
Small files with one concern are easier to understand than one enormous file that does everything.
Numbers appear in text all the time: 1, 2, 3, 10, 42, 100, 256, 512, 1024, 2048 and 65536 are all
common. Dates like 2024-05-17 and times like 12:30 are split into short groups of digits.
Questions and answers: What is the capital of France? Paris. How many legs does a spider have?
Eight. Which planet is closest to the sun? Mercury. Who wrote the play about the prince of Denmark?
Shakespeare. What colour do you get when you mix blue and yellow? Green.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly
quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
User: Please write a short poem about the sea.
Assistant: The sea is wide, the sea is deep, it sings the sailors off to sleep; it keeps its
secrets, old and grey, and gives them back another day.
User: Thank you! Can you explain what a tokenizer does?
Assistant: A tokenizer splits text into pieces called tokens and maps each piece to a number. The
model only ever sees those numbers; the tokenizer turns the model's numbers back into text.
{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}
def add(a, b):
    return a + b
Café, naïve, façade, résumé, déjà vu, jalapeño, über, smörgåsbord.
你好，世界。我们今天学习中文。日本語のテキストも少しあります。こんにちは。
Emoji travel well: 😀 😂 🚀 🌍 ❤️ 👍 🎉 — and so do arrows → ← and symbols ©, €, ±, ∞.
"""


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Same shape as DeepSeek-V3's pre-tokenizer (digits in groups of up to three, CJK runs kept
    # apart, then a word/punctuation/space split, then bytes mapped to printable characters), with
    # our own, simpler word pattern.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[\u4E00-\u9FFF\u3040-\u30FF]+"), behavior="isolated"),
            pre_tokenizers.Split(
                Regex(r"\s?[\p{L}\p{M}]+|\s?\p{P}+|\s?[^\s\p{L}\p{M}\p{P}\p{N}]+|\s+(?!\S)|\s+"),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_added_later = len(TAIL_SPECIALS) + len(TOOL_MARKERS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added_later,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in HEAD_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TAIL_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_MARKERS])
    # What transformers writes for add_bos_token=True: BOS before every sequence.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
    )
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {size} tokens, expected {VOCAB_SIZE}: enlarge the corpus")
    for want_id, token in enumerate(HEAD_SPECIALS):
        if tok.token_to_id(token) != want_id:
            raise SystemExit(f"{token} got id {tok.token_to_id(token)}, expected {want_id}")
    return tok


def added_token_entry(content: str) -> dict:
    # DeepSeek's tokenizer_config.json spells its named tokens this way.
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


def tokenizer_config(template: str) -> dict:
    # Field for field what DeepSeek-V3 / R1 ship, with the demo's chat template and length.
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": added_token_entry(BOS),
        "clean_up_tokenization_spaces": False,
        "eos_token": added_token_entry(EOS),
        "legacy": True,
        "model_max_length": 4096,
        "pad_token": added_token_entry(EOS),
        "sp_model_kwargs": {},
        "unk_token": None,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": template,
    }


def model_config() -> dict:
    # DeepSeek-V3's config.json with every dimension shrunk; kept field for field so the demo
    # exercises the same parsing and routing paths (q_lora, noaux_tc, groups, YaRN).
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "kv_lora_rank": 64,
        "max_position_embeddings": 4096,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 64,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": 96,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 1024,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 32,
        "vocab_size": VOCAB_SIZE,
    }


def generation_config() -> dict:
    # Same fields as DeepSeek-R1's generation_config.json (its recommended temperature and top_p);
    # the server uses them as defaults for requests that leave sampling unset.
    return {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
            "temperature": 0.6, "top_p": 0.95}


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "assets/demo")
    args = parser.parse_args()
    # The published template, byte for byte as in DeepSeek-V3's tokenizer_config.json; the .jinja
    # file only adds the customary final newline, which is not part of the template.
    template = V3_TEMPLATE.read_text(encoding="utf-8").removesuffix("\n")

    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(args.out / "tokenizer.json"), pretty=True)
    write_json(args.out / "tokenizer_config.json", tokenizer_config(template))
    write_json(args.out / "config.json", model_config())
    write_json(args.out / "generation_config.json", generation_config())
    print(f"wrote {args.out}: {tok.get_vocab_size(with_added_tokens=True)} tokens")


if __name__ == "__main__":
    main()
