"""`tokenworks bench world`: tokenworks against llama.cpp's own test material, counted.

- tokenizers: each vocabulary with test vectors, texts tokenised to llama.cpp's ids and
  decoded back;
- templates: each real chat template, the conversations rendered as transformers renders
  them (where transformers is installed);
- chat formats: each template with test-chat.cpp cases, the tool-call format and reasoning
  markers chosen and the cases parsed to llama.cpp's message, whole and streamed in chunks
  of every size.

One record; docs/world-files.md shows its tables.
"""

from __future__ import annotations

from collections import defaultdict

from tqdm import tqdm

from tokenworks.bench.chat_cases import check, read_cases
from tokenworks.bench.llama_cpp_sources import (
    VERSION,
    llama_cpp_sources,
    vocab_vectors,
    vocabulary,
)
from tokenworks.bench.record import make_record, write_record

# the conversations every template is rendered with: a plain chat, a tool round trip and a
# reasoning turn, each (messages, tools)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city"}, "days": {"type": "integer"}}},
}}]  # fmt: skip
CONVERSATIONS = {
    "plain": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ], None),
    "tool round trip": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call12345", "type": "function",  # (Mistral's templates want 9 characters)
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
         "content": '{"temp": 21}'},
    ], TOOLS),
    "reasoning": ([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3+3?"},
    ], None),
}  # fmt: skip


def tokenizers(sources) -> dict:
    from tokenworks.models.gguf_metadata import read_metadata
    from tokenworks.tokenizer.tokenizer import TokenizerError

    out = {}
    paths = sorted((sources / "models").glob("ggml-vocab-*.gguf.inp"))
    for inp in tqdm(paths, desc="vocabularies"):
        path = inp.with_suffix("")
        name = path.name[len("ggml-vocab-") : -len(".gguf")]
        try:
            tok = vocabulary(path)
        except TokenizerError as e:
            out[name] = {"refused": str(e)}
            continue
        vectors = vocab_vectors(path)
        exact = round_trip = 0
        for text, want in vectors:
            exact += tok.encode(text, add_special_tokens=False, parse_special=False) == want
            round_trip += tok.decode(want, skip_special_tokens=False) == text
        metadata = read_metadata(path)
        out[name] = {"model": metadata.get("tokenizer.ggml.model"),
                     "pre": metadata.get("tokenizer.ggml.pre"), "texts": len(vectors),
                     "exact": exact, "round_trip": round_trip}  # fmt: skip
    return out


def templates(sources) -> dict:
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return {"status": "NOT_RUN", "reason": "transformers is not installed (the hf extra)"}
    from tokenworks.tokenizer.chat import ChatTemplate

    special = {"bos_token": "<s>", "eos_token": "</s>"}
    out = {}
    for path in tqdm(sorted((sources / "models" / "templates").glob("*.jinja")), "templates"):
        source = path.read_text(encoding="utf-8")
        row = {}
        chat = ChatTemplate(source)
        for name, (messages, tools) in CONVERSATIONS.items():
            given = special | chat.variables(tools)  # (the same time now for both)
            try:
                theirs = render_jinja_template(
                    [messages], tools=tools, chat_template=source, add_generation_prompt=True,
                    **given,
                )[0][0]
            except Exception:  # the template refuses the conversation
                theirs = None
            try:
                ours = chat.render(messages, tools=tools, **given)
            except ValueError:
                ours = None
            # ours only: transformers refuses what llama.cpp renders (tojson of a generator)
            row[name] = ("both refuse" if theirs is None and ours is None
                         else "ours only" if theirs is None
                         else "equal" if ours == theirs else "differ")  # fmt: skip
        out[path.name] = row
    return out


def chat_formats(sources) -> dict:
    from tokenworks.serve import reasoning, tool_formats

    rows: dict[str, dict] = defaultdict(lambda: {"cases": 0, "parsed": 0})
    for case in tqdm(read_cases(sources), desc="chat cases"):
        row = rows[case.template]
        if "format" not in row:
            source = (sources / "models" / "templates" / case.template).read_text("utf-8")
            thinks = reasoning.resolve("auto", source, None)
            row["format"] = tool_formats.resolve("auto", source, None).name
            row["reasoning"] = f"{thinks.open} {thinks.close}" if thinks else None
        row["cases"] += 1
        row["parsed"] += check(case, sources, streamed=True)[0]
    return dict(sorted(rows.items()))


def run_world(args) -> None:
    sources = llama_cpp_sources()
    results = {"tokenizers": tokenizers(sources), "templates": templates(sources),
               "chat_formats": chat_formats(sources)}  # fmt: skip
    results["summary"] = summary(results)
    record = make_record(
        kind="world", engine={"name": "tokenworks"}, model={},
        workload={"material": f"llama-cpp-python {VERSION} sdist, vendor/llama.cpp",
                  "tokenizers": "models/ggml-vocab-*.gguf with .inp/.out",
                  "templates": "models/templates/*.jinja, three conversations",
                  "chat_formats": "tests/test-chat.cpp peg_tester whole-answer cases"},
        results=results,
    )  # fmt: skip
    path = write_record(record, args.out)
    for key, value in results["summary"].items():
        print(f"{key.replace('_', ' ')}: {value}")
    print(f"record: {path}")


def summary(results: dict) -> dict:
    vocab, formats = results["tokenizers"].values(), results["chat_formats"].values()
    renders = [v for row in results["templates"].values() if isinstance(row, dict)
               for v in row.values()]  # fmt: skip
    return {
        "vocabularies": len(vocab),
        "vocabularies_exact": sum(v.get("exact") == v.get("texts") for v in vocab),
        "template_renders": len(renders),
        "template_renders_equal": renders.count("equal"),
        "template_renders_both_refuse": renders.count("both refuse"),
        "template_renders_ours_only": renders.count("ours only"),
        "chat_templates": len(formats),
        "chat_templates_whole": sum(r["parsed"] == r["cases"] for r in formats),
        "chat_cases": sum(r["cases"] for r in formats),
        "chat_cases_parsed": sum(r["parsed"] for r in formats),
    }
