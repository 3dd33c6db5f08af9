"""How each model family writes a tool call, and how it is read back and forced.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen2.5,
                 Qwen3, SmolLM)
    llama3_json  {"name": ..., "parameters": {...}} as the whole answer, or after
                 <|python_tag|>; several separated by ";"                  (Llama 3.1 to 3.3)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or
                 [TOOL_CALLS]name[ARGS]{...} per call                      (Mistral, Mixtral)
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
                 </tool_call>                                              (Qwen3-Coder)
    seed_oss     the same in <seed:tool_call>, values as written          (Seed-OSS)
    minicpm5     <function name="NAME"><param name="KEY">VALUE</param></function> (MiniCPM 5)
    lfm2         <|tool_call_start|>[NAME(key="value", n=1)]<|tool_call_end|>, Python's
                 syntax (serve/python_calls.py)                             (LFM2)
    gigachat     <|function_call|>{"name": ..., "arguments": {...}}, or GigaChat 3's
                 "function call" turn                                      (GigaChat)
    nemotron     <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>  (Nemotron Nano 2)
    harmony      <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
                 <|call|>, thinking on the analysis channel (serve/harmony.py) (gpt-oss)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 ```json {...}```<｜tool▁call▁end｜>                        (DeepSeek R1, V3, V3.1)
    deepseek_v32 <｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter
                 name="KEY" string="true">...                              (DeepSeek V3.2, V4)
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|>...      (Kimi K2)
    glm45        <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>
                 </tool_call>                                              (GLM 4.5 to 4.7)
    command_r7b  <|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters":
                 {...}}]<|END_ACTION|>, the answer in <|START_RESPONSE|>   (Command R7B,
                 ... <|END_RESPONSE|>                                      Cohere2)
    gemma4       <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>  (Gemma 4)
    minimax_m2   <minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE
                 </parameter></invoke></minimax:tool_call>                 (MiniMax M2)
    minimax_m3   ]<]minimax[>[ before every tag of <tool_call><invoke name="NAME"><KEY>
                 VALUE</KEY></invoke></tool_call>, objects and lists as elements (MiniMax M3)
    kimi_k3      <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>argument
                 key="KEY" type="number"<|sep|>1<|close|>argument<|sep|>...   (Kimi K3)
    command_r    Action:\n```json\n[{"tool_name": ..., "parameters": {...}}]\n```  (Command R+)
    apriel       <tool_calls>[{"name": ..., "arguments": {...}}]</tool_calls>  (Apriel)
    apertus      <|tools_prefix|>[{"NAME": {...}}]<|tools_suffix|>           (Apertus)
    firefunction  functools[{"name": ..., "arguments": {...}}]               (Firefunction v2)
    functionary_v31  <function=NAME>{...}</function>                       (Functionary v3.1)
    functionary_v32  >>>NAME\n{...} per call, >>>all\n before text, the first >>> the
                 prompt's (serve/functionary.py)                            (Functionary v3.2)
    atem         <|start|>assistant to=NAME<|message|><atem:function_calls><atem:invoke
                 name="NAME"><atem:parameter name="KEY">...; to=self thinks, to=user
                 answers (serve/atem.py)                                    (Muse Glimmer)

`--tool-call-parser` (vLLM's flag) picks one; auto reads the chat template. Hermes calls
stream their arguments as they are generated (serve/tools.py's ToolCallParser); the other
formats' calls are read whole once the completion ends, the text before them streaming as
it comes. Forcing a call (tool_choice required or named) writes the format's own syntax
through a grammar; a marker that is one special token of the tokenizer is matched as that
token, and its text is kept in the output so the parser can see it.
"""

from __future__ import annotations

import json
import re

from tokenworks.engine.request import close_objects
from tokenworks.serve.atem import Atem
from tokenworks.serve.family_formats import (
    GLM45,
    CommandR,
    CommandR7B,
    DeepSeekDSML,
    DeepSeekV3,
    Gemma4,
    Harmony,
    KimiK2,
)
from tokenworks.serve.functionary import FunctionaryV31, FunctionaryV32
from tokenworks.serve.python_calls import PythonCalls
from tokenworks.serve.tool_format_base import (
    ToolFormat,
    WholeCallsParser,
    json_value,
    value_rule,
)
from tokenworks.serve.tools import CLOSE, parse_call
from tokenworks.serve.xml_formats import KimiK3, MiniCPM5, MiniMaxM2, MiniMaxM3

__all__ = ["FORMATS", "TOOL_CALL_PARSERS", "ToolFormat", "resolve"]


class Llama3Json(ToolFormat):
    name, start, args_key = "llama3_json", "<|python_tag|>", "parameters"

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix, leading_brace=True)

    def how_to_call(self) -> str:
        return (
            "To call a function, answer with nothing but a JSON object of the form "
            '{"name": "<function name>", "parameters": {<arguments as JSON>}}; separate '
            'several calls with "; ".'
        )

    def render_call(self, name, arguments):
        return json.dumps({"name": name, "parameters": arguments})

    def grammar(self, tools):
        return "start: call\n" + self._json_call(tools)

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        text, decoder, calls = region.replace(self.start, "", 1), json.JSONDecoder(), []
        i = 0
        while True:
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                return calls or None
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            call = parse_call(obj)
            if call is None:
                return None
            calls.append(call)


class GigaChat(ToolFormat):
    """GigaChat's calls: one JSON object {"name": ..., "arguments": {...}} after
    <|function_call|> (3.1), or after a turn of the "function call" role (3)."""

    name, start = "gigachat", "<|function_call|>"
    TURN = "<|message_sep|>\n\nfunction call<|role_sep|>\n"  # GigaChat 3's

    def __init__(self, tokenizer=None, start: str | None = None):
        self.start = start or self.start
        super().__init__(tokenizer)

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (f'To call a function, answer {self.start}{{"name": "<function name>", '
                '"arguments": {<arguments as JSON>}}.')  # fmt: skip

    def render_call(self, name, arguments):
        return self.start + json.dumps({"name": name, "arguments": arguments})

    def grammar(self, tools):
        return f"start: {self._marker_rule} call\n" + self._json_call(tools)

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = [parse_call(json_value(part.strip()))
                 for part in filter(str.strip, region.split(self.start))]  # fmt: skip
        return None if not calls or None in calls else calls


class Mistral(ToolFormat):
    name, start = "mistral", "[TOOL_CALLS]"

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (
            f"To call functions, answer {self.start} followed by a JSON list of calls, "
            'each {"name": "<function name>", "arguments": {<arguments as JSON>}}.'
        )

    def render_call(self, name, arguments):
        return self.start + json.dumps([{"name": name, "arguments": arguments}])

    def grammar(self, tools):
        return f'start: {self._marker_rule} "[" call "]"\n' + self._json_call(tools)

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for part in filter(str.strip, region.split(self.start)):
            if "[ARGS]" in part:  # the newer spelling: name[ARGS]{...} (or [CALL_ID]id[ARGS])
                name, _, args = part.partition("[ARGS]")
                name = name.partition("[CALL_ID]")[0]
                call = parse_call({"name": name.strip(), "arguments": json_value(args)})
                found = [call] if call is not None else None
            else:
                listed = json_value(part)
                listed = listed if isinstance(listed, list) else [listed]
                found = [parse_call(c) for c in listed]
            if not found or None in found:
                return None
            calls += found
        return calls or None


class Nemotron(Mistral):
    """Nemotron Nano 2's calls: Mistral's JSON list between <TOOLCALL> and </TOOLCALL>."""

    name, start, end = "nemotron", "<TOOLCALL>", "</TOOLCALL>"

    def render_call(self, name, arguments):
        return f"{self.start}{json.dumps([{'name': name, 'arguments': arguments}])}{self.end}"

    def grammar(self, tools):
        return f'start: {self._marker_rule} "[" call "]{self.end}"\n' + self._json_call(tools)

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        return super().parse(region.replace(self.end, ""), tools)


class Apriel(Nemotron):
    """Apriel's calls: the JSON list in <tool_calls> and </tool_calls>."""

    name, start, end = "apriel", "<tool_calls>", "</tool_calls>"


class Apertus(Nemotron):
    """Apertus's calls: a JSON list of {NAME: {arguments}} objects between <|tools_prefix|>
    and <|tools_suffix|>."""

    name, start, end = "apertus", "<|tools_prefix|>", "<|tools_suffix|>"

    def how_to_call(self) -> str:
        return (f"To call functions, answer {self.start} followed by a JSON list of calls, each "
                f'{{"<function name>": {{<arguments as JSON>}}}}, then {self.end}.')  # fmt: skip

    def render_call(self, name, arguments):
        return f"{self.start}{json.dumps([{name: arguments}])}{self.end}"

    def _call_schema(self, tool):
        return {"type": "object", "properties": {tool.name: close_objects(tool.parameters)},
                "required": [tool.name], "additionalProperties": False}  # fmt: skip

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        calls = []
        for part in filter(str.strip, region.replace(self.end, "").split(self.start)):
            listed = json_value(part)
            for obj in listed if isinstance(listed, list) else [listed]:
                if not (isinstance(obj, dict) and len(obj) == 1):
                    return None
                ((name, args),) = obj.items()
                if not isinstance(args, dict):
                    return None
                calls.append((name, args))
        return calls or None


class Firefunction(Mistral):
    """Firefunction v2's calls: Mistral's JSON list after "functools"."""

    name, start = "firefunction", "functools"


class Qwen3Coder(ToolFormat):
    name, close = "qwen3_coder", CLOSE
    _pad = "\n"  # around each value
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    @property
    def starts(self):  # (a model may leave out the <tool_call> its template writes)
        return (self.start, "<function=")

    def parser(self, tools, id_prefix):
        return WholeCallsParser(self, tools, id_prefix)

    def how_to_call(self) -> str:
        return (
            "To call a function, answer in this form, one block per call:\n"
            f"{self.start}\n<function=FUNCTION NAME>\n<parameter=PARAMETER NAME>\nVALUE\n"
            f"</parameter>\n</function>\n{self.close}"
        )

    def render_call(self, name, arguments):
        params = "".join(
            f"<parameter={k}>{self._pad}{v if isinstance(v, str) else json.dumps(v)}{self._pad}"
            "</parameter>\n"
            for k, v in arguments.items()
        )
        return f"{self.start}\n<function={name}>\n{params}</function>\n{self.close}"

    def grammar(self, tools):
        """One call of one tool, each of its parameters at most once in declared order,
        the required ones present. A string is one line of text without "<" (up to its
        maxLength, else MAX_TEXT characters); any other value is JSON valid against its
        schema."""
        rules, options = [], []
        for i, t in enumerate(tools):
            props = t.parameters.get("properties", {})
            required = set(t.parameters.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(props.items()):
                value = f"v{i}_{j}"
                rules.append(f"{value}: {value_rule(schema)}")
                pad = json.dumps(self._pad)[1:-1]
                rule = f'"<parameter={k}>{pad}" {value} "{pad}</parameter>\\n"'
                parts.append(rule if k in required else f"({rule})?")
            rules.append(f'tool{i}: "<function={t.name}>\\n" {" ".join(parts)} "</function>"')
            options.append(f"tool{i}")
        start = f'start: {self._marker_rule} "\\n" ({" | ".join(options)}) "\\n{self.close}"'
        return "\n".join([start, *rules]) + "\n"

    def parse(self, region: str, tools) -> list[tuple[str, dict]] | None:
        types = {t.name: t.parameters.get("properties", {}) for t in tools}
        calls = []
        for name, body in self._FUNCTION.findall(region):
            props = types.get(name.strip(), {})
            args = {}
            for key, value in self._PARAMETER.findall(body):
                kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
                args[key] = value if kind == "string" else json_value(value, default=value)
            calls.append((name.strip(), args))
        return calls or None


class SeedOSS(Qwen3Coder):
    """Seed-OSS's calls: Qwen3-Coder's in <seed:tool_call>, each value as written (its
    newlines are part of it)."""

    name, start, close = "seed_oss", "<seed:tool_call>", "</seed:tool_call>"
    _pad = ""
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


FORMATS = {f.name: f for f in (ToolFormat, Llama3Json, Mistral, Qwen3Coder, Harmony,
                                DeepSeekV3, DeepSeekDSML, KimiK2, GLM45, CommandR7B,
                                CommandR, Gemma4, MiniMaxM2, MiniMaxM3, KimiK3,
                                SeedOSS, MiniCPM5, PythonCalls, Nemotron, GigaChat,
                                Apriel, Apertus, Firefunction, FunctionaryV31,
                                FunctionaryV32, Atem)}  # fmt: skip
TOOL_CALL_PARSERS = ("auto", *FORMATS)  # --tool-call-parser's choices


# what a chat template writes -> its format, the first that matches (any of its needles)
_SIGNS = (
    (("<|channel|>",), "harmony"), (("<atem:function_calls>",), "atem"),
    (("tool▁calls▁begin",), "deepseek_v3"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"), (("'<|open|>' + tag",), "kimi_k3"),
    (("]<]minimax[>[",), "minimax_m3"), (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_call>",), "gemma4"), (("<|START_ACTION|>",), "command_r7b"),
    (("Action:\\n```json",), "command_r"), (("<arg_key>",), "glm45"),
    (("<|function_call|>",), "gigachat"), (("<|tool_call_start|>",), "lfm2"),
    (("<TOOLCALL>",), "nemotron"), (('<param name="',), "minicpm5"),
    (("<seed:tool_call>",), "seed_oss"), (("<|tools_prefix|>",), "apertus"),
    (("<tool_calls>",), "apriel"), ((" functools[",), "firefunction"),
    (("'>>>' + tool_call",), "functionary_v32"),
    (("<parameter=", "<tool_call>\n<function="), "qwen3_coder"),
    (("<function=",), "functionary_v31"), (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>", "ipython"), "llama3_json"),
)  # fmt: skip


def resolve(setting: str, template_source: str | None, tokenizer) -> ToolFormat:
    """The format under --tool-call-parser; auto: the one the chat template writes."""
    if setting == "auto":
        source = template_source or ""
        if "｜DSML｜" in source:
            wrapper = "tool_calls" if "｜DSML｜tool_calls" in source else "function_calls"
            return DeepSeekDSML(tokenizer, wrapper)
        turn = "function call<|role_sep|>" in source or "'role': 'function call'" in source
        if turn and "<|function_call|>" not in source:
            return GigaChat(tokenizer, GigaChat.TURN)  # GigaChat 3's turn of its own
        signs = (name for needles, name in _SIGNS if any(n in source for n in needles))
        setting = next(signs, "hermes")
    return FORMATS[setting](tokenizer)
