"""The agent-facing API through the official `openai` Python client: structured outputs,
tool calls (forced by tool_choice, and parsed from the output with the hermes parser),
reasoning split by the qwen3 parser, logit_bias. The model is the built-in tiny random model,
so every output the checks read is shaped by a grammar.

Usage: python3 openai_agents.py BASE_URL MODEL
Exits non-zero (with the failing check) when anything is off.
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
user = [{"role": "user", "content": "Describe a cat."}]

# 1. json_schema (strict), seeded sampling at temperature 1: valid under the schema, 100/100.
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "color": {"enum": ["black", "white", "tabby"]},
    },
    "required": ["name", "legs", "color"],
    "additionalProperties": False,
}
rf = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}
valid = 0
for seed in range(100):
    r = client.chat.completions.create(
        model=model, messages=user, response_format=rf, temperature=1, seed=seed, max_tokens=120
    )
    c = r.choices[0]
    obj = json.loads(c.message.content)
    assert set(obj) == {"name", "legs", "color"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8, obj
    assert isinstance(obj["legs"], int) and 0 <= obj["legs"] <= 8, obj
    assert obj["color"] in ("black", "white", "tabby"), obj
    assert c.finish_reason == "stop", c
    valid += 1
assert valid == 100
print("json_schema: 100/100 valid")

# json_object, streamed.
text = "".join(
    ch.choices[0].delta.content or ""
    for ch in client.chat.completions.create(
        model=model, messages=user, response_format={"type": "json_object"}, seed=1,
        max_tokens=400, stream=True,
    )
    if ch.choices
)
# A random model may run out of budget inside a free-form object; when it ends, it is valid.
try:
    assert isinstance(json.loads(text), dict)
except json.JSONDecodeError:
    assert len(text) > 0 and text.startswith("{"), text

# vLLM's guided fields and Dynamo's nvext.
r = client.completions.create(
    model=model, prompt="Pick:", max_tokens=10, seed=3, extra_body={"guided_choice": ["left", "right"]}
)
assert r.choices[0].text in ("left", "right"), r
r = client.chat.completions.create(
    model=model, messages=user, max_tokens=20, seed=4,
    extra_body={"nvext": {"guided_regex": "[0-9]{4}-[0-9]{2}"}},
)
c = r.choices[0].message.content
assert len(c) == 7 and c[4] == "-" and c.replace("-", "").isdigit(), c
try:
    client.chat.completions.create(
        model=model, messages=user, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    )
    raise AssertionError("a schema that does not compile was accepted")
except openai.BadRequestError as e:
    assert "json_schema" in str(e), e

# 2. Tools. A named tool choice: the arguments follow the function's schema; streamed too.
tools = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
named = {"type": "function", "function": {"name": "get_weather"}}
r = client.chat.completions.create(model=model, messages=user, tools=tools, tool_choice=named, seed=5, max_tokens=60)
calls = r.choices[0].message.tool_calls
assert len(calls) == 1 and calls[0].function.name == "get_weather", r
args = json.loads(calls[0].function.arguments)
assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7, args

names, arguments, ids = {}, {}, {}
finish = None
for ch in client.chat.completions.create(
    model=model, messages=user, tools=tools, tool_choice="required", seed=6, max_tokens=200, stream=True
):
    for c in ch.choices:
        for tc in c.delta.tool_calls or []:
            if tc.id:
                ids[tc.index] = tc.id
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            if tc.function and tc.function.arguments:
                arguments[tc.index] = arguments.get(tc.index, "") + tc.function.arguments
        finish = c.finish_reason or finish
assert names and set(names.values()) <= {"get_weather", "get_time"}, names
assert finish == "tool_calls", finish
for i, n in names.items():
    a = json.loads(arguments[i])
    assert (n == "get_time") == ("zone" in a), (n, a)
assert len(set(ids.values())) == len(ids)

# The hermes parser on free output (here shaped by a grammar, as a trained model would write
# it): content before the call, the call in tool_calls, streamed and not.
hermes = 'start: "Let me check." "<tool_call>" call "</tool_call>"\ncall: %json {"x-guidance": {"whitespace_flexible": false}, "type": "object", "properties": {"name": {"const": "get_time"}, "arguments": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": false}}, "required": ["name", "arguments"], "additionalProperties": false}'
r = client.chat.completions.create(
    model=model, messages=user, tools=tools, seed=7, max_tokens=80, extra_body={"guided_grammar": hermes}
)
m = r.choices[0].message
assert m.content == "Let me check.", m
assert [c.function.name for c in m.tool_calls] == ["get_time"], m
assert json.loads(m.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
assert r.choices[0].finish_reason == "tool_calls", r
content, streamed_calls = "", []
for ch in client.chat.completions.create(
    model=model, messages=user, tools=tools, seed=7, max_tokens=80, stream=True,
    extra_body={"guided_grammar": hermes},
):
    for c in ch.choices:
        content += c.delta.content or ""
        streamed_calls += c.delta.tool_calls or []
assert content == "Let me check." and len(streamed_calls) == 1, (content, streamed_calls)
assert streamed_calls[0].function.arguments == m.tool_calls[0].function.arguments

# Tool results go back through the chat template.
history = user + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
    {"role": "tool", "tool_call_id": calls[0].id, "content": "{\"temp\": 21}"},
]
r = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=5, seed=8)
assert r.choices[0].message.role == "assistant"

# 3. Reasoning (the qwen3 parser): split from content, streamed and not, counted in usage.
think = {"guided_regex": "<think>[a-z ]{5,20}</think>[a-z]{3,10}"}
r = client.chat.completions.create(model=model, messages=user, seed=9, max_tokens=80, extra_body=think)
m = r.choices[0].message
reasoning = m.model_extra.get("reasoning_content")
assert reasoning and 5 <= len(reasoning) <= 20 and "<think>" not in m.content, m
assert m.content.isalpha(), m
assert r.usage.completion_tokens_details.reasoning_tokens > 0, r.usage
streamed_reasoning, streamed_content = "", ""
for ch in client.chat.completions.create(
    model=model, messages=user, seed=9, max_tokens=80, stream=True, extra_body=think
):
    for c in ch.choices:
        streamed_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += c.delta.content or ""
assert (streamed_reasoning, streamed_content) == (reasoning, m.content)

# 4. logit_bias: +100 on one token makes it the whole greedy output.
tok = 1234
r2 = client.completions.create(model=model, prompt="x", max_tokens=3, temperature=0, logit_bias={str(tok): 100}, logprobs=0)
assert len(r2.choices[0].logprobs.tokens) == 3 and len(set(r2.choices[0].logprobs.tokens)) == 1, r2
try:
    client.completions.create(model=model, prompt="x", max_tokens=3, logit_bias={"abc": 1})
    raise AssertionError("a bad logit_bias key was accepted")
except openai.BadRequestError as e:
    assert "logit_bias" in str(e)
print("agent API: all checks passed")
