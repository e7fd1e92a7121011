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

# Batched prompts: choice i * n + j answers prompt i; usage sums the prompts.
batch = client.completions.create(model=model, prompt=["One", "Two", [1, 2, 3]], max_tokens=3, n=2, seed=1)
assert [c.index for c in batch.choices] == list(range(6)), batch
assert batch.usage.completion_tokens == sum(1 for _ in batch.choices) * 3 or batch.usage.completion_tokens <= 18
solo = client.completions.create(model=model, prompt="Two", max_tokens=3, temperature=0)
again = client.completions.create(model=model, prompt=["One", "Two"], max_tokens=3, temperature=0)
assert again.choices[1].text == solo.choices[0].text, (again, solo)
streamed = {}
for ch in client.completions.create(model=model, prompt=["One", "Two"], max_tokens=3, temperature=0, stream=True):
    for c in ch.choices:
        streamed[c.index] = streamed.get(c.index, "") + c.text
assert streamed == {0: again.choices[0].text, 1: again.choices[1].text}, streamed

# echo: the prompt, then the completion (streamed too).
e = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0, echo=True)
plain = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0)
assert e.choices[0].text == "The sky is" + plain.choices[0].text, (e, plain)
es = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="The sky is", max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
assert es == e.choices[0].text, es
try:
    client.completions.create(model=model, prompt="x", max_tokens=2, echo=True, logprobs=1)
    raise AssertionError("echo with logprobs accepted")
except openai.BadRequestError as err:
    assert "echo" in str(err)

# suffix: a fill-in-the-middle prompt (Qwen3's tokenizer has the FIM tokens).
fim = client.completions.create(model=model, prompt="def f(x):", suffix="    return y", max_tokens=3, temperature=0)
assert fim.usage.prompt_tokens > 6, fim.usage
print("basic surface: all checks passed")
