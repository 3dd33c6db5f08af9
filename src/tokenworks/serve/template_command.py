"""`tokenworks template render|parse`: what the server does with a model's chat template,
shown without a server.

render prints the prompt a conversation (and its tools) becomes; parse reads a model's
output on standard input and prints the OpenAI chat message the server would answer with
(content, reasoning_content, tool_calls), naming on standard error the tool-call format and
reasoning markers it chose. Both go through the server's own pieces (serve/tools.py's
prepare_messages, serve/tool_formats.py, serve/reasoning.py, serve/answer_parser.py), so
what they show is what a request gets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenworks.serve import reasoning, tool_formats
from tokenworks.serve.answer_parser import make_answer_parser
from tokenworks.serve.errors import APIError
from tokenworks.serve.tools import openai_tools, prepare_messages
from tokenworks.tokenizer.chat import ChatTemplate

PROBE = [{"role": "user", "content": "Hi"}]  # what the generation prompt is read from


def add_template_parser(sub) -> None:
    p = sub.add_parser(
        "template",
        help="what the server does with a chat template: the prompt a conversation renders "
        "to (render), or the message a model's output parses to (parse)",
    )
    verbs = p.add_subparsers(dest="verb", required=True)
    for verb, what in (
        ("render", "print the prompt text of --messages (and --tools)"),
        ("parse", "read a model's output on standard input; print the chat message as JSON"),
    ):
        v = verbs.add_parser(verb, help=what)
        v.add_argument("--model", default=None,
                       help="a catalogue name, .gguf file or model directory: its template, "
                       "special tokens and tokenizer (only its metadata is read)")  # fmt: skip
        v.add_argument("--chat-template", default=None,
                       help="a Jinja template file (in place of the model's)")  # fmt: skip
        v.add_argument("--tools", default=None, help="a JSON file: OpenAI tools, a list")
        v.add_argument("--chat-template-kwargs", type=json.loads, default=None,
                       help='what a request\'s chat_template_kwargs gives the template, as '
                       'JSON (\'{"enable_thinking": false}\')')  # fmt: skip
        if verb == "render":
            v.add_argument("--messages", required=True,
                           help="a JSON file: OpenAI chat messages, a list")  # fmt: skip
            v.add_argument("--no-generation-prompt", action="store_true",
                           help="leave out the assistant turn's opening")  # fmt: skip
        else:
            v.add_argument("--tool-call-parser", default="auto",
                           choices=tool_formats.TOOL_CALL_PARSERS)  # fmt: skip
            v.add_argument("--reasoning-parser", default="auto",
                           choices=reasoning.REASONING_PARSERS)  # fmt: skip
        v.set_defaults(fn=run)


def _json_file(path: str | None, what: str) -> list:
    if path is None:
        return []
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path}: {e}") from None
    if not isinstance(value, list):
        raise ValueError(f"{what} {path}: expected a JSON list")
    return value


def _template(args) -> tuple[ChatTemplate, object]:
    tokenizer = None
    source = None
    if args.model is not None:
        from tokenworks.models import load
        from tokenworks.tokenizer import TokenizerWrapper

        tokenizer = TokenizerWrapper.from_loaded(load(args.model, weights=False))
        source = tokenizer.chat.source if tokenizer.chat else None
    if args.chat_template is not None:
        source = Path(args.chat_template).read_text(encoding="utf-8")
    if source is None:
        raise ValueError("no chat template: give --chat-template FILE, or a --model that has one")
    return ChatTemplate(source, tokenizer), tokenizer


def render(chat: ChatTemplate, messages: list, tools: list, fmt, generation_prompt=True,
           kwargs: dict | None = None) -> str:  # fmt: skip
    """The prompt the server renders for these messages and tools (OpenAI shapes); kwargs:
    a request's chat_template_kwargs."""
    offered = openai_tools(tools)
    prepared, extra = prepare_messages(messages, offered, chat.source, fmt)
    return chat.render(prepared, add_generation_prompt=generation_prompt, **extra, **(kwargs or {}))


def parse(text: str, chat: ChatTemplate, tools: list, fmt, thinks, kwargs=None,
          chunks: tuple[int | None, ...] = (None,)) -> list[dict]:  # fmt: skip
    """The assistant message the server makes of a model's output, after a prompt rendered
    with kwargs (a request's chat_template_kwargs): one for each chunk size the output is
    streamed in (None: whole)."""
    offered = openai_tools(tools)
    # does the template's generation prompt open the thinking?
    probe = render(chat, PROBE, tools, fmt, kwargs=kwargs)
    opened = reasoning.opened_by(thinks, probe) if thinks else None
    messages = []
    for size in chunks:
        parser = make_answer_parser(thinks, opened, fmt, offered)
        size = size or max(len(text), 1)
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        events = [e for k, p in enumerate(pieces) for e in parser.feed(p, k == len(pieces) - 1)]
        messages.append(_message(events))
    return messages


def _message(events: list) -> dict:
    content, thought, calls = [], [], []
    for kind, value in events:
        if kind == "text":
            content.append(value)
        elif kind == "reasoning":
            thought.append(value)
        elif kind == "call_end":
            function = {"name": value.name, "arguments": value.arguments}
            calls.append({"id": value.id, "type": "function", "function": function})
    message = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
    if thought:
        message["reasoning_content"] = "".join(thought)
    if calls:
        message["tool_calls"] = calls
    return message


def run(args) -> int:
    chat, tokenizer = _template(args)
    tools = _json_file(args.tools, "--tools")
    try:
        if args.verb == "render":
            messages = _json_file(args.messages, "--messages")
            fmt = tool_formats.resolve("auto", chat.source, tokenizer)
            prompt = render(chat, messages, tools, fmt, not args.no_generation_prompt,
                            args.chat_template_kwargs)  # fmt: skip
            sys.stdout.write(prompt)
            return 0
        fmt = tool_formats.resolve(args.tool_call_parser, chat.source, tokenizer)
        thinks = reasoning.resolve(args.reasoning_parser, chat.source, None)
        marks = f"{thinks.open} ... {thinks.close}" if thinks else "none"
        print(f"tool calls: {fmt.name}; reasoning: {marks}", file=sys.stderr)
        [message] = parse(sys.stdin.read(), chat, tools, fmt, thinks, args.chat_template_kwargs)
    except APIError as e:  # a refusal the server would answer with a 400
        raise ValueError(e.message) from None
    print(json.dumps(message, ensure_ascii=False, indent=2))
    return 0
