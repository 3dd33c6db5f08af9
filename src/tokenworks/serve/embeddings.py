"""POST /v1/embeddings: each input's final hidden states pooled into one unit-length vector.

The inputs run through the engine like any requests (batched with whatever else is
running), each with max_tokens 0 and the server's pooling (`--embedding-pooling`: the mean
over every position, or the last position's). `encoding_format: "base64"` gives the
little-endian float32 bytes, as the OpenAI API does.
"""

from __future__ import annotations

import base64
import struct

from fastapi import APIRouter, Request

from tokenworks.serve import api_times
from tokenworks.serve.common import ServerState, collect, merge, respond, sampling_params, submit
from tokenworks.serve.errors import bad_request
from tokenworks.serve.openai import prompt_token_lists
from tokenworks.serve.protocol import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    api_times.handler_entered()
    state: ServerState = request.app.state.tokenworks
    state = state.for_model(body.model)
    if state.remote is not None:
        raw = await request.json()
        return await state.remote.relay(raw, "/embeddings", body.model, state.deadline(None))
    width = state.engine.engine.spec.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise bad_request(
            f"dimensions is {body.dimensions}; this model's embeddings have {width}", "dimensions"
        )
    inputs = prompt_token_lists(state, body.input, "input")
    params = sampling_params(max_tokens=0, pooling=state.embedding_pooling)
    streams, ids = [], []
    try:
        for tokens in inputs:
            rid = state.engine.new_request_id("embd")
            streams.append(await submit(state, params, tokens, request_id=rid))
            ids.append(rid)
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    vectors: dict[int, list[float]] = {}
    for i, update in await collect(request, merge(streams)):
        if update.embedding is not None:
            vectors[i] = update.embedding
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vectors[i], body.encoding_format)}
        for i in range(len(inputs))
    ]
    tokens = sum(len(t) for t in inputs)
    return respond(
        {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
