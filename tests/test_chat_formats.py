"""llama.cpp's chat-format cases (tests/test-chat.cpp, read by bench/chat_cases.py): a real
template, a model's output and the message it must parse to. tokenworks parses them through
`tokenworks template parse`'s path, the server's own (serve/template_command.py). The
templates listed here parse every case of theirs; docs/world-files.md counts the rest."""

from __future__ import annotations

import io
import json

import pytest

from tokenworks.bench.chat_cases import check, read_cases
from tokenworks.cli import main

# every case of these templates parses to llama.cpp's message, whole and streamed in chunks
# of every size
WHOLE = (
    "Apertus-8B-Instruct.jinja", "Apriel-1.6-15b-Thinker-fixed.jinja", "ByteDance-Seed-OSS.jinja",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "GLM-4.6.jinja", "GLM-4.7-Flash.jinja",
    "GigaChat3-10B-A1.8B.jinja", "GigaChat3.1-10B-A1.8B.jinja", "Kimi-K2-Thinking.jinja",
    "Kimi-K3.jinja", "LFM2.5-8B-A1B.jinja", "MiniMax-M2.jinja", "MiniMax-M3.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja", "NVIDIA-Nemotron-Nano-v2.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "Qwen-QwQ-32B.jinja",
    "Qwen3-Coder.jinja", "Reka-Edge.jinja", "Spark2.5.jinja", "StepFun3.5-Flash.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
    "deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
    "deepseek-ai-DeepSeek-V4.jinja", "fireworks-ai-llama-3-firefunction-v2.jinja",
    "google-gemma-2-2b-it.jinja", "google-gemma-4-31B-it.jinja",
    "ibm-granite-granite-3.3-2B-Instruct.jinja", "ibm-granite-granite-4.0.jinja",
    "ibm-granite-granite-4.1.jinja", "llama-cpp-deepseek-r1.jinja",
    "meetkai-functionary-medium-v3.1.jinja", "meetkai-functionary-medium-v3.2.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja", "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja", "moonshotai-Kimi-K2.jinja", "muse-glimmer.jinja",
    "openai-gpt-oss-120b.jinja", "openbmb-MiniCPM5-1B.jinja", "unsloth-Apriel-1.5.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
)  # fmt: skip


@pytest.fixture(scope="module")
def cases(llama_cpp_sources):
    found = read_cases(llama_cpp_sources)
    assert len(found) >= 250 and len({c.template for c in found}) >= 45
    return found


@pytest.mark.parametrize("template", WHOLE)
def test_every_case_of_the_family_parses_to_llama_cpps_message(cases, llama_cpp_sources,
                                                                 template):  # fmt: skip
    mine = [c for c in cases if c.template == template]
    assert mine
    for case in mine:
        ok, got = check(case, llama_cpp_sources, streamed=True)
        assert ok, (case.line, case.output, got)


def test_template_parse_prints_the_message_and_names_the_format(
    llama_cpp_sources, tmp_path, monkeypatch, capsys
):
    template = llama_cpp_sources / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    output = ('<think>\nPlan.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>')  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO(output))
    argv = ["template", "parse", "--chat-template", str(template), "--tools",
            str(tmp_path / "tools.json")]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    message = json.loads(out)
    assert message["reasoning_content"].strip() == "Plan."
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert "tool calls: hermes; reasoning: <think> ... </think>" in err


def test_template_render_prints_the_prompt_with_the_tools(llama_cpp_sources, tmp_path, capsys):
    template = llama_cpp_sources / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": "Weather?"}]))
    (tmp_path / "t.json").write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]))  # fmt: skip
    argv = ["template", "render", "--chat-template", str(template), "--messages",
            str(tmp_path / "m.json"), "--tools", str(tmp_path / "t.json")]  # fmt: skip
    assert main(argv) == 0
    prompt = capsys.readouterr().out
    assert '"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_command_without_a_template_says_what_to_give(tmp_path, capsys):
    (tmp_path / "m.json").write_text("[]")
    assert main(["template", "render", "--messages", str(tmp_path / "m.json")]) == 2
    assert "give --chat-template FILE" in capsys.readouterr().err
