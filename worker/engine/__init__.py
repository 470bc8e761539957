"""The continuous-batching engine. Knows nothing of Redis; the worker drives ``LLMEngine``, users ``LLM``.

Three rooms: ``core`` (the loop, scheduler, block manager, sequences, outputs), ``model`` (runner,
forwards, attention backends, loader, and the C++ kernels in ``model/kernels``) and ``sampling``
(sampler, filters, penalties, structured output, watermark, detokenizer)."""

from worker.engine.core.config import EngineConfig
from worker.engine.core.llm_engine import LLMEngine
from worker.engine.core.outputs import EngineEvent, EngineStats, RequestOutput
from worker.engine.llm import LLM
from worker.engine.model.lora import LoRARequest
from worker.engine.sampling.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "EngineEvent",
    "EngineStats",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
