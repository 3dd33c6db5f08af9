"""tokenworks: an LLM inference engine, server and measurement lab, from first principles."""

from tokenworks.engine.request import FinishReason, RequestOutput, SamplingParams
from tokenworks.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "FinishReason", "RequestOutput", "SamplingParams", "__version__"]
