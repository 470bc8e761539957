"""Offline API in vLLM's convention: ``LLM(model).generate(prompts, params) -> [RequestOutput]``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from worker.engine.core.config import EngineConfig
from worker.engine.core.llm_engine import LLMEngine
from worker.engine.core.outputs import RequestOutput
from worker.engine.model.lora import LoRARequest
from worker.engine.model.model_loader import Resolve
from worker.engine.sampling.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | Any,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        cpu_kernels: bool = True,
        kernel_cache_dir: str | None = None,
        tokenizer: Any = None,
        resolve: Resolve | None = None,
        **config_fields: Any,
    ) -> None:
        """``model``: a model name (``smollm2-135m-instruct``), a Hugging Face directory, a .gguf file or a hub
        id; or a loaded HF model together with ``tokenizer``. The keywords are ``EngineConfig``'s fields, with
        its defaults: ``cpu_kernels=False`` keeps plain-torch CPU attention and norms (no compiled kernels),
        ``kernel_cache_dir`` moves the kernel's build cache from ~/.cache/inflightq/kernels; ``config_fields``
        takes the others (max_model_len, aging_steps, attention_backend, served_model_name, ...). ``resolve``
        maps a model name to its files; by default names resolve through the installed table of models
        (``model_loader.installed_resolver``)."""
        config = EngineConfig(
            model=model if isinstance(model, str) else "",
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            cpu_kernels=cpu_kernels,
            kernel_cache_dir=kernel_cache_dir,
            **config_fields,
        )
        if isinstance(model, str):
            self.engine = LLMEngine.from_config(config, resolve=resolve)
        elif tokenizer is None:
            raise ValueError("pass tokenizer= with a loaded model")
        else:
            self.engine = LLMEngine(model, tokenizer, config)
        self._next_id = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"}
        return cls(config.model, **fields)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: the LoRA adapter every prompt runs with, or one (or None: the base model) per prompt;
        the engine must be built with ``max_loras`` > 0."""
        batch = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(batch)
        if len(params) != len(batch) or (priorities is not None and len(priorities) != len(batch)):
            raise ValueError("params and priorities must match the number of prompts")
        if len(lora_request) != len(batch):
            raise ValueError("lora_request must match the number of prompts")
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, prompt in enumerate(batch):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(
                request_id, ids, params[i], priority=priorities[i] if priorities else 0, lora=lora_request[i]
            )
            wants_logprobs = params[i].logprobs is not None
            outputs[request_id] = RequestOutput(
                request_id,
                ids,
                logprobs=[] if wants_logprobs else None,
                top_logprobs=[] if params[i].logprobs else None,
            )
            order.append(request_id)
        progress = _progress(len(batch)) if use_tqdm else None
        while self.engine.has_unfinished():
            for event in self.engine.step():
                out = outputs[event.request_id]
                if event.token_id >= 0:
                    out.token_ids.append(event.token_id)
                    if out.logprobs is not None and event.logprob is not None:
                        out.logprobs.append(event.logprob)
                    if out.top_logprobs is not None and event.top_logprobs is not None:
                        out.top_logprobs.append(event.top_logprobs)
                out.text += event.text
                if event.finish_reason is not None:
                    out.finish_reason = event.finish_reason
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [outputs[r] for r in order]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
