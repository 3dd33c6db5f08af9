"""LoRA adapters loaded and unloaded while serving, as vLLM's routes take them:
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
{"lora_name"}. Refused unless the server was started with --allow-runtime-lora-updating;
an adapter loaded here is served under its name at once, in /v1/models and the model field.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from tokenworks.engine.messages import LoRANotFoundError
from tokenworks.serve.common import ServerState
from tokenworks.serve.errors import APIError, bad_request

router = APIRouter()


class LoadLoRA(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRA(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)


def _updatable(request: Request) -> ServerState:
    state: ServerState = request.app.state.tokenworks
    if not state.runtime_lora:
        raise bad_request(
            "loading LoRA adapters while serving is off: start the server with "
            "--allow-runtime-lora-updating (and --enable-lora)"
        )
    return state


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRA, request: Request):
    state = _updatable(request)
    if body.lora_name in state.served_names:
        raise bad_request(f"the name {body.lora_name!r} is served already", "lora_name")
    try:
        await state.engine.lora("load", body.lora_name, body.lora_path)
    except ValueError as e:  # unreadable, too large a rank, no slot left, another model's
        raise bad_request(str(e), "lora_path") from e
    state.add_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRA, request: Request):
    state = _updatable(request)
    if body.lora_name not in state.adapters:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded",
                       param="lora_name", code="model_not_found")  # fmt: skip
    del state.adapters[body.lora_name]  # new requests naming it are refused from now
    try:
        await state.engine.lora("unload", body.lora_name)
    except LoRANotFoundError:
        pass  # the engine had it unloaded already
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
