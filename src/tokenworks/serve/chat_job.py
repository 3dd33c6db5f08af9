"""One request, whatever protocol it came in, and the one pipeline that serves it.

Each protocol module (serve/openai.py's chat completions and completions,
serve/anthropic.py's Messages, serve/responses.py) only parses its body into a ChatJob and
turns what comes back into its own wire format. `start` runs the pipeline on the model's
own engine, through whichever front holds it (the native engine core, the transformers
front): the server's limits, the tools offered and the grammar they force, the chat
template, the thinking budget, admission once, the sampling parameters, submit.
`upstream` is the one way a job goes to a remote backend instead: an OpenAI chat
completion's body. The defaults a request leaves out live here once (DEFAULT_TEMPERATURE,
DEFAULT_TOP_P), as SamplingParams has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from tokenworks.engine.request import SamplingParams, StructuredOutput, Thinking
from tokenworks.front.streams import RequestStream
from tokenworks.serve import remote, tools
from tokenworks.serve.answer_parser import answer_parser, request_thinking, skip_special
from tokenworks.serve.common import (
    ServerState,
    clamp_max_tokens,
    render_chat,
    sampling_params,
    submit,
    tenant_salt,
)
from tokenworks.serve.tools import Tool

DEFAULT_TEMPERATURE = SamplingParams.temperature
DEFAULT_TOP_P = SamplingParams.top_p


@dataclass
class ChatJob:
    """What every chat protocol asks of the engine; None where the request said nothing."""

    messages: list[dict]  # OpenAI-shaped, as the chat template is fed ([]: a raw prompt)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None  # the top alternatives a token reports (None: no logprobs)
    sampling: dict = field(default_factory=dict)  # OpenAI's other SamplingParams fields
    tools: list[Tool] = field(default_factory=list)
    tool_mode: str = "auto"  # auto, none, required or named (tools.openai_choice's)
    tool_name: str | None = None
    parallel_tool_calls: bool | None = None
    output: StructuredOutput | None = None  # the response format asked
    reasoning_budget: int | None = None  # thinking tokens at most (0: no thinking)
    reasoning_effort: str | None = None  # low, medium or high (serve/reasoning.py)
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None  # the request's own (the API key's is added to it)
    timeout: float | None = None  # seconds the request may take (the server's may be less)
    # how the protocol names things, for its errors and ids
    names: dict[str, str] = field(default_factory=dict)  # a SamplingParams field -> its own
    tool_conflict: str = "a forced tool call cannot be combined with a response format"
    id_prefix: str = "chatcmpl"
    call_id_prefix: str = "call_"
    full_status: int = 429  # a full queue's HTTP status (Anthropic's is 529)

    def name(self, field_name: str) -> str:
        return self.names.get(field_name, field_name)


@dataclass
class Started:
    """A job the engine took: its request's stream of updates, the tools it offered and
    its thinking (what the answer parser needs)."""

    request_id: str
    updates: RequestStream
    offered: list[Tool]
    thinking: Thinking | None
    call_id_prefix: str = "call_"

    def parser(self, state: ServerState):
        """A completion's answer parser: its thinking, text and tool calls apart."""
        return answer_parser(state, self.thinking, self.offered, self.call_id_prefix)


def offered_tools(state: ServerState, job: ChatJob) -> tuple[list[Tool], StructuredOutput | None]:
    """The tools the prompt offers, and the grammar the output follows (a forced call's or
    the response format's)."""
    return tools.resolve(job.tools, job.tool_mode, job.tool_name, job.output,
                         job.tool_conflict, state.tool_format)  # fmt: skip


def render(state: ServerState, job: ChatJob, offered: list[Tool]) -> str:
    return render_chat(state, job.messages, offered,
                       add_generation_prompt=job.add_generation_prompt,
                       **job.template_kwargs)  # fmt: skip


async def start(
    state: ServerState, request: Request, job: ChatJob, prompt_ids: list[int] | None = None
) -> Started:
    """Run the pipeline and submit: the engine's stream of the job's one request. With
    prompt_ids (/v1/completions: a prompt's tokens as given), no template, tools or
    thinking: the rest of the pipeline alike."""
    limits = state.limits
    limits.check_stop(job.stop, job.name("stop"))
    limits.check_n(job.n)
    limits.check_logprobs(job.logprobs, job.name("logprobs"))
    offered, constraint, thinking = [], job.output, None
    if prompt_ids is None:
        offered, constraint = offered_tools(state, job)
        prompt = render(state, job, offered)
        prompt_ids = state.encode(prompt)
        asked = [(job.name("max_reasoning_tokens"), job.reasoning_budget),
                 (job.name("reasoning_effort"), job.reasoning_effort)]  # fmt: skip
        thinking = request_thinking(state, prompt, asked)
    max_tokens = clamp_max_tokens(
        state, job.max_tokens, len(prompt_ids), job.name("max_tokens"), job.name("messages")
    )
    params = sampling_params(
        job.names,
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if job.temperature is None else job.temperature,
        top_p=DEFAULT_TOP_P if job.top_p is None else job.top_p,
        top_k=max(job.top_k or 0, 0),
        seed=job.seed,
        stop=job.stop,
        n=job.n,
        logprobs=job.logprobs,
        structured=constraint,
        thinking=thinking,
        skip_special_tokens=skip_special(state, offered, job.skip_special_tokens),
        **job.sampling,
    )
    rid = state.engine.new_request_id(job.id_prefix)
    updates = await submit(
        state, params, prompt_ids, full_status=job.full_status, request_id=rid,
        deadline=state.deadline(job.timeout), priority=job.priority,
        cache_salt=tenant_salt(state, request, job.cache_salt),
    )  # fmt: skip
    return Started(rid, updates, offered, thinking, job.call_id_prefix)


def upstream(job: ChatJob) -> dict:
    """The job as an OpenAI chat completion's body, for a remote backend: what the request
    set, and nothing it left to the upstream's defaults."""
    out = {"messages": job.messages} | remote.tool_fields(job.tools, job.tool_mode, job.tool_name)
    fields = (("max_tokens", job.max_tokens), ("temperature", job.temperature),
              ("top_p", job.top_p), ("top_k", job.top_k), ("seed", job.seed),
              ("stop", job.stop or None), ("n", job.n if job.n != 1 else None),
              ("parallel_tool_calls", job.parallel_tool_calls),
              ("max_reasoning_tokens", job.reasoning_budget),
              ("reasoning_effort", job.reasoning_effort),
              ("chat_template_kwargs", job.template_kwargs or None))  # fmt: skip
    out |= {key: value for key, value in fields if value is not None}
    return out | remote.response_format(job.output)


def remote_chunks(state: ServerState, job: ChatJob):
    """The job on the model's remote backend: the upstream's chat chunks (its tool choice
    and output format checked here first, as for the model's own engine)."""
    offered_tools(state, job)
    return state.remote.chat_chunks(upstream(job), state.deadline(job.timeout))
