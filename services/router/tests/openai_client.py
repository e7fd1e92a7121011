"""Drives a Tandem router with the official `openai` Python client.

Usage: python3 openai_client.py BASE_URL MODEL
Exits non-zero (with the failing check) when anything is off.
"""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

models = [m.id for m in client.models.list()]
assert model in models, models

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, temperature=0
)
assert chat.choices[0].message.role == "assistant"
assert chat.choices[0].finish_reason in ("length", "stop"), chat
assert chat.usage.completion_tokens <= 6 and chat.usage.prompt_tokens > 0, chat.usage

text = ""
usage = None
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Hello!"}],
    max_tokens=6,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, logprobs=2, seed=3)
assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens

streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(model=model, prompt="Once", max_tokens=4, stream=True, temperature=0)
    if c.choices
)
assert isinstance(streamed, str)

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("unknown model accepted")
except openai.NotFoundError:
    pass
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=9)
    raise AssertionError("bad temperature accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e)

print("openai client checks passed")
