#!/usr/bin/env python3
"""Golden chat-template renderings of the Qwen3 template by transformers.

    python3 scripts/goldens/make_chat_goldens.py MODEL_DIR OUT_FILE

MODEL_DIR holds tokenizer.json and tokenizer_config.json (e.g. what `tandem model tiny`
writes). transformers' `apply_chat_template` works without torch. For each conversation the
output keeps the inputs, the rendered text and its token ids (to check the Rust tokenizer too).
"""
import json
import sys

from transformers import AutoTokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city — in °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Current time", "parameters": {"type": "object", "properties": {}}},
}

CASES = [
    ("plain", [{"role": "user", "content": "Hello!"}], None, True, {}),
    ("plain_no_generation_prompt", [{"role": "user", "content": "Hello!"}], None, False, {}),
    ("system_thinking_off", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ], None, True, {"enable_thinking": False}),
    ("thinking_on", [{"role": "user", "content": "Why is the sky blue?"}], None, True, {"enable_thinking": True}),
    ("multi_turn_reasoning_content", [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "7", "reasoning_content": "Any number works.\nSeven is fine."},
        {"role": "user", "content": "Another one, 中文 please 🙂"},
        {"role": "assistant", "content": "八", "reasoning_content": "Eight in Chinese."},
        {"role": "user", "content": "Thanks"},
    ], None, True, {}),
    ("inline_think_in_history", [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nreasoning here\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nmore\n</think>\n\nA2"},
    ], None, False, {}),
    ("tools", [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Zürich and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "It is 21 °C and noon."},
        {"role": "user", "content": "Thanks!"},
    ], [WEATHER_TOOL, TIME_TOOL], True, {"enable_thinking": False}),
    ("tools_no_system", [
        {"role": "user", "content": "Time?"},
    ], [TIME_TOOL], True, {}),
    ("tool_call_with_content_and_reasoning", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "cold"},
    ], [WEATHER_TOOL], True, {}),
]


def main():
    model_dir, out_file = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for name, messages, tools, agp, extra in CASES:
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=agp, **extra
        )
        out.append({
            "name": name, "messages": messages, "tools": tools,
            "add_generation_prompt": agp, "extra": extra, "rendered": text,
            "ids": tok.encode(text, add_special_tokens=False),
        })
    with open(out_file, "w") as f:
        json.dump({"generator": "scripts/goldens/make_chat_goldens.py",
                   "transformers": __import__("transformers").__version__, "cases": out},
                  f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
