"""llama.cpp's chat-format cases, read from its tests/test-chat.cpp: for a real template, a
model's output and the message it must parse to (content, reasoning, tool calls).

Each `peg_tester("models/templates/NAME.jinja")` block holds statements like

    tst.test("<tool_call>\\n{...}</tool_call>").tools({ special_function_tool })
        .reasoning_format(COMMON_REASONING_FORMAT_AUTO).expect(message_assist_call).run();

read here from the C++ text: string literals (adjacent ones joined, raw R"(...)" ones too,
and the block's `const std::string` constants added to them with "+"),
the tools by their static definitions, the expected message by its `simple_assist_msg(...)`
definition or the statement's own expect_content / expect_reasoning / expect_tool_calls.
Cases that continue a prefilled message, take a JSON schema or a forced tool choice, or
parse a partial output are left out: they test other things than reading a whole answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}
_SKIPPED = (".messages(", ".continue_final_message(", ".json_schema(", ".tool_choice(")


@dataclass
class ChatCase:
    template: str  # the file name in models/templates
    output: str  # what the model wrote
    tools: list[dict]  # OpenAI tools
    reasoning: bool  # False: reasoning_format NONE (thinking is left in the content)
    enable_thinking: bool
    content: str
    reasoning_content: str
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON)
    line: int = 0


def _literal(text: str, i: int) -> tuple[str, int] | None:
    """The C++ string literal at text[i:] (after blanks and comments) and where it ends."""
    while True:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if text.startswith("//", i):
            i = text.index("\n", i)
            continue
        break
    if text.startswith('R"', i):
        open_paren = text.index("(", i)
        delim = text[i + 2 : open_paren]
        end = text.index(f"){delim}\"", open_paren)
        return text[open_paren + 1 : end], end + len(delim) + 2
    if not text.startswith('"', i):
        return None
    out, i = [], i + 1
    while text[i] != '"':
        if text[i] == "\\":
            nxt = text[i + 1]
            if nxt == "x":
                digits = re.match(r"[0-9a-fA-F]+", text[i + 2 :]).group(0)
                out.append(chr(int(digits, 16)))
                i += 2 + len(digits)
                continue
            if nxt == "u":
                out.append(chr(int(text[i + 2 : i + 6], 16)))
                i += 6
                continue
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out), i + 1


def _literals(text: str, i: int) -> tuple[str, int] | None:
    """Adjacent literals joined, as the compiler joins them."""
    first = _literal(text, i)
    if first is None:
        return None
    parts, i = [first[0]], first[1]
    while (more := _literal(text, i)) is not None:
        parts.append(more[0])
        i = more[1]
    return "".join(parts), i


def _expression(text: str, i: int, constants: dict[str, str]) -> tuple[str, int] | None:
    """A string expression at text[i:]: literals and the block's string constants joined
    by "+" ("I think.\\n" + get_time_call), and where it ends."""
    parts = []
    while True:
        found = _literals(text, i)
        if found is None:
            name = re.match(r"\s*(\w+)", text[i:])
            if name is None or name.group(1) not in constants:
                return None
            found = constants[name.group(1)], i + name.end()
        parts.append(found[0])
        plus = re.match(r"\s*\+", text[found[1] :])
        if plus is None:
            return "".join(parts), found[1]
        i = found[1] + plus.end()


def _constants(body: str) -> dict[str, str]:
    """A block's `const std::string NAME = ...;` values, each read with those before it."""
    found: dict[str, str] = {}
    for m in re.finditer(r"const std::string (\w+)\s*=", body):
        if (value := _expression(body, m.end(), found)) is not None:
            found[m.group(1)] = value[0]
    return found


def _call_args(text: str, start: int, pair: str = "()") -> str:
    """The text between the bracket at `start` and its match (literals skipped whole)."""
    depth, i = 0, start
    while True:
        c = text[i]
        if text.startswith("//", i):  # (a comment may hold quotes and brackets)
            i = text.index("\n", i)
            continue
        if c == '"' or text.startswith('R"', i):
            i = _literal(text, i)[1]
            continue
        if c == pair[0]:
            depth += 1
        elif c == pair[1]:
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1


def _line_end(text: str, i: int) -> int:
    j = text.find("\n", i)
    return len(text) if j < 0 else j


def _groups(args: str) -> list[str]:
    """The top-level {...} groups of an initialiser list (literals skipped whole)."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(args):
        if args.startswith("//", i):
            i = _line_end(args, i)
            continue
        if args[i] == '"' or args.startswith('R"', i):
            i = _literal(args, i)[1]
            continue
        if args[i] == "{":
            depth += 1
            start = i if depth == 1 else start
        elif args[i] == "}":
            depth -= 1
            if depth == 0:
                out.append(args[start + 1 : i])
        i += 1
    return out


def _strings(args: str) -> list[str]:
    """The string literals among a call's arguments, in order ("" for {})."""
    out, i = [], 0
    while i < len(args):
        if args[i] == '"' or args.startswith('R"', i):
            s, i = _literals(args, i)
            out.append(s)
        elif args.startswith("{}", i):
            out.append("")
            i += 2
        elif args.startswith("/*", i):
            i = args.index("*/", i) + 2
        elif args.startswith("//", i):
            i = _line_end(args, i)
        else:
            i += 1
    return out


def _tools(source: str) -> dict[str, dict]:
    found = {}
    for m in re.finditer(r"static common_chat_tool (\w+)\s*\{", source):
        body = _call_args(source, m.end() - 1, "{}")
        if (tool := _tool(_strings(body))) is not None:
            found[m.group(1)] = tool
    return found


def _tool(strings: list[str]) -> dict | None:
    """An OpenAI tool of a common_chat_tool's (name, description, parameters) literals."""
    if len(strings) < 3:
        return None
    try:
        params = json.loads(strings[2])
    except json.JSONDecodeError:
        return None
    fn = {"name": strings[0], "description": strings[1], "parameters": params}
    return {"type": "function", "function": fn}


def _messages(source: str) -> dict[str, tuple[str, str, list]]:
    """name -> (content, reasoning, tool calls) of each `simple_assist_msg(...)` constant."""
    found = {}
    for m in re.finditer(r"const common_chat_msg (\w+)\s*=\s*simple_assist_msg\(", source):
        strings = _strings(_call_args(source, m.end() - 1))
        content, reasoning, name, arguments = (strings + ["", "", "", ""])[:4]
        found[m.group(1)] = (content, reasoning, [(name, arguments)] if name else [])
    return found


def _pairs(strings: list[str]) -> list[tuple[str, str]]:
    return list(zip(strings[::2], strings[1::2], strict=False))


# test-chat.cpp's functions that build an expected message: their string arguments ->
# (content, reasoning, tool calls)
_BUILDERS = {
    "simple_assist_msg": lambda s: ((s + ["", ""])[0], (s + ["", ""])[1], _pairs(s[2:4])),
    "message_with_tool_calls": lambda s: ("", "", _pairs(s[:2])),
    "message_with_tool_calls_and_reasoning": lambda s: ("", s[2], _pairs(s[:2])),
    "message_with_content_and_tool_call": lambda s: (s[0], "", _pairs(s[1:3])),
    "message_with_reasoning_and_tool_call": lambda s: ("", s[0], _pairs(s[1:3])),
    "message_with_reasoning_content_and_multiple_tool_calls": lambda s: (s[1], s[0],
                                                                         _pairs(s[2:])),
}


def read_cases(sources: Path) -> list[ChatCase]:
    """Every whole-answer case of test-chat.cpp's peg_tester blocks."""
    source = (sources / "tests" / "test-chat.cpp").read_text(encoding="utf-8")
    tools, messages = _tools(source), _messages(source)
    blocks = list(re.finditer(r'peg_tester\("models/templates/([^"]+)"', source))
    cases = []
    for k, block in enumerate(blocks):
        end = blocks[k + 1].start() if k + 1 < len(blocks) else len(source)
        body = source[block.end() : end]
        constants = _constants(body)
        for stmt in re.finditer(r"\btst\.test\(", body):
            # (a chain may break its lines after the dot: `).\n    run();`)
            stop = re.compile(r"\)\s*\.\s*run\(\);").search(body, stmt.end())
            if stop is None:
                continue
            text = re.sub(r"\)\.\s*\n\s*", ").", body[stmt.end() - 1 : stop.start() + 1])
            case = _case(block.group(1), text, tools, messages, constants)
            if case is not None:
                case.line = source.count("\n", 0, block.end() + stmt.start()) + 1
                cases.append(case)
    return cases


def _case(template: str, text: str, tools: dict, messages: dict,
          constants: dict[str, str]) -> ChatCase | None:  # fmt: skip
    if any(s in text for s in _SKIPPED) or ".is_partial(true)" in text:
        return None
    output = _expression(text, 1, constants)
    if output is None:
        return None
    output, after = output
    chain = text[after:]
    offered = []
    if (at := chain.find(".tools(")) >= 0:
        listed = _call_args(chain, at + len(".tools")).strip()[1:-1]  # inside the {...}
        inline = _groups(listed)
        if inline:  # { { "name", "description", R"(schema)" }, ... }
            offered = [_tool(_strings(group)) for group in inline]
        else:
            names = [n.strip() for n in listed.split(",") if n.strip()]
            offered = [tools.get(n) for n in names]
        if None in offered:
            return None
    content = reasoning = None
    calls: list | None = None
    if (m := re.search(r"\.expect\((\w+)\)", chain)) is not None:
        if m.group(1) not in messages:
            return None
        content, reasoning, calls = messages[m.group(1)]
    elif (m := re.search(r"\.expect\((\w+)\(", chain)) is not None:
        if m.group(1) not in _BUILDERS:
            return None
        content, reasoning, calls = _BUILDERS[m.group(1)](_strings(_call_args(chain, m.end() - 1)))
    for what in ("content", "reasoning"):
        at = chain.find(f".expect_{what}(")
        if at >= 0:
            found = _expression(chain, at + len(f".expect_{what}("), constants)
            if found is None:
                return None
            value = found[0]
            content, reasoning = (value, reasoning) if what == "content" else (content, value)
    at = chain.find(".expect_tool_calls(")
    if at >= 0:
        listed = _call_args(chain, at + len(".expect_tool_calls"))
        calls = [tuple((_strings(group) + ["", ""])[:2]) for group in _groups(listed[1:-1])]
    if content is None and reasoning is None and calls is None:
        return None
    fmt = re.search(r"COMMON_REASONING_FORMAT_(\w+)", chain)
    return ChatCase(
        template=template, output=output, tools=offered,
        reasoning=bool(fmt) and fmt.group(1) != "NONE",
        enable_thinking=".enable_thinking(false)" not in chain,
        content=content or "", reasoning_content=reasoning or "", tool_calls=calls or [],
    )  # fmt: skip


def check(case: ChatCase, sources: Path, streamed: bool = False) -> tuple[bool, dict]:
    """Whether tokenworks parses the case's output to its message (content and reasoning
    compared without surrounding blanks, arguments as JSON values), and what it made;
    streamed: also fed in chunks of every size from one character up."""
    from tokenworks.serve import reasoning, tool_formats
    from tokenworks.serve.template_command import parse
    from tokenworks.tokenizer.chat import ChatTemplate

    source = (sources / "models" / "templates" / case.template).read_text(encoding="utf-8")
    chat = ChatTemplate(source)
    fmt = tool_formats.resolve("auto", source, None)
    thinks = reasoning.resolve("auto" if case.reasoning else "none", source, None)
    kwargs = {"enable_thinking": case.enable_thinking}
    chunks = (None, *range(1, len(case.output))) if streamed else (None,)
    try:
        messages = parse(case.output, chat, case.tools, fmt, thinks, kwargs, chunks)
    except Exception as e:  # a template that refuses the probe conversation, say
        return False, {"error": f"{type(e).__name__}: {e}"}
    want = [(name, _json_value(args)) for name, args in case.tool_calls]
    for size, got in zip(chunks, messages, strict=True):
        calls = [(c["function"]["name"], _json_value(c["function"]["arguments"]))
                 for c in got.get("tool_calls", [])]  # fmt: skip
        if not (
            (got.get("content") or "").strip() == case.content.strip()
            and (got.get("reasoning_content") or "").strip() == case.reasoning_content.strip()
            and calls == want
        ):
            return False, got | {"chunk": size}
    return True, messages[0]


def _json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
