"""One conversation through the three protocols (OpenAI chat completions, Anthropic
Messages, OpenAI Responses), with the official SDKs, on both transports: one internal
request, so the same tokens, the same prompt length, the same stop."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "smollm2-135m"
SYSTEM = "You answer in one short sentence."
TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And a fruit?"},
]


@pytest.mark.parametrize("max_tokens", [12, 40])
def test_one_conversation_gives_the_same_tokens_through_every_protocol(smol_server, max_tokens):
    oai = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=smol_server.url, api_key="x", max_retries=0, timeout=120)
    chat = oai.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *TURNS],
    )  # fmt: skip
    message = claude.messages.create(
        model=MODEL,
        max_tokens=max_tokens,
        system=SYSTEM,
        messages=TURNS,
        extra_body={"temperature": 0},  # (the SDK no longer names it)
    )
    response = oai.responses.create(
        model=MODEL, max_output_tokens=max_tokens, temperature=0, instructions=SYSTEM,
        input=TURNS,
    )  # fmt: skip
    text = chat.choices[0].message.content
    assert message.content[0].text == text and response.output_text == text
    prompt, out = chat.usage.prompt_tokens, chat.usage.completion_tokens
    assert (message.usage.input_tokens, message.usage.output_tokens) == (prompt, out)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (prompt, out)
    stopped = {"length": ("max_tokens", "incomplete"), "stop": ("end_turn", "completed")}
    assert (message.stop_reason, response.status) == stopped[chat.choices[0].finish_reason]
