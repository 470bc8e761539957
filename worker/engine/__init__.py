"""The continuous-batching engine. Knows nothing of Redis; the worker drives ``LLMEngine``."""

from worker.engine.config import EngineConfig
from worker.engine.llm import LLM
from worker.engine.llm_engine import LLMEngine
from worker.engine.outputs import EngineEvent, EngineStats, RequestOutput
from worker.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineEvent", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
