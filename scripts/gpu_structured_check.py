#!/usr/bin/env python3
"""Structured output, logit_bias and min_tokens through a running mla-serve on --device cuda, where
the device sampler applies the grammar masks the engine computes during the forward pass and
decode steps replay CUDA graphs. Whatever the (dummy) weights, the constrained outputs must parse
and validate; the checks are the e2e tests' properties, made against the GPU server.

usage: gpu_structured_check.py BASE_URL MODEL [CONCURRENCY]

Exit status 0 when every check passed. Used by scripts/gpu_run.sh's `structured` stage.
"""
import concurrent.futures
import re
import sys
from typing import Annotated

import openai
import pydantic

base, model = sys.argv[1], sys.argv[2]
concurrency = int(sys.argv[3]) if len(sys.argv) > 3 else 32
client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
failures = []


# Bounded strings and lists: random weights would otherwise ramble inside a string until
# max_tokens, which is valid behaviour (finish_reason "length") but not a finished object.
Short = Annotated[str, pydantic.StringConstraints(max_length=16)]


class Person(pydantic.BaseModel):
    # No extra properties (OpenAI's strict schemas have none): with them allowed, random weights
    # may add a property whose value is an unbounded string.
    model_config = pydantic.ConfigDict(extra="forbid")
    name: Short
    age: Annotated[int, pydantic.Field(ge=0, le=150)]
    tags: Annotated[list[Short], pydantic.Field(max_length=3)]


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}"[:300])
    if not ok:
        failures.append(name)


def person(i):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"person {i}"}],
        max_tokens=400,
        temperature=[0.0, 1.0][i % 2],
        seed=i,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
        },
    )
    c = r.choices[0]
    if c.finish_reason != "stop":
        return f"finish_reason {c.finish_reason} after {r.usage.completion_tokens} tokens"
    try:
        Person.model_validate_json(c.message.content)
    except pydantic.ValidationError as e:
        return f"does not validate: {e!s:.120} in {c.message.content[:120]!r}"
    return None


with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    errors = [e for e in pool.map(person, range(concurrency)) if e]
check(f"json_schema x{concurrency} concurrent (greedy and seeded)", not errors, errors[:2])

pattern = r"(yes|no|maybe)( [0-9]{1,3}){2,5}"
r = client.completions.create(
    model=model, prompt="answer:", max_tokens=64, n=4, temperature=1.0, seed=7, extra_body={"guided_regex": pattern}
)
texts = [c.text for c in r.choices]
check("guided_regex n=4", all(re.fullmatch(pattern, t) for t in texts), texts)

r = client.completions.create(model=model, prompt="pick:", max_tokens=16, extra_body={"guided_choice": ["red", "green"]})
check("guided_choice", r.choices[0].text in ("red", "green"), r.choices[0].text)

first = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=1, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
t0 = int(first.choices[0].logprobs.tokens[0].split(":")[1])
forced = 1000 if t0 != 1000 else 1001
r = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=8, temperature=0, logprobs=0,
                              logit_bias={str(forced): 100}, extra_body={"return_tokens_as_token_ids": True})
got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
check("logit_bias +100 forces a token", got == [forced] * 8, got)
r = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=20, temperature=0,
                              extra_body={"stop_token_ids": [t0], "min_tokens": 5})
check("min_tokens holds off a stop token", r.usage.completion_tokens >= 5, r.usage.completion_tokens)

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "json"}], max_tokens=300, stream=True,
    extra_body={"guided_json": Person.model_json_schema()},
)
text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
try:
    Person.model_validate_json(text)
    check("streamed guided_json validates", True, text[:80])
except pydantic.ValidationError as e:
    check("streamed guided_json validates", False, f"{e!s:.120}: {text[:120]!r}")

print(f"{len(failures)} failed" if failures else "all structured-output checks passed")
sys.exit(1 if failures else 0)
