"""Offline API in vLLM's convention: ``LLM(model).generate(prompts, params) -> [RequestOutput]``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from worker.engine.hardware import resolve_device, resolve_dtype
from worker.engine.llm_engine import LLMEngine
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams

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
        tokenizer: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        """``model``: what the model loader takes (alias, HF directory, .gguf, hub id), or a loaded HF
        model together with ``tokenizer``."""
        from worker.engine.model_loader import load_model

        torch_device = resolve_device(device)
        if isinstance(model, str):
            model, tokenizer = load_model(model, resolve_dtype(dtype, torch_device), torch_device)
        elif tokenizer is None:
            raise ValueError("pass tokenizer= with a loaded model")
        self.engine = LLMEngine(
            model,
            tokenizer,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            **engine_kwargs,
        )
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        batch = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch) or (priorities is not None and len(priorities) != len(batch)):
            raise ValueError("params and priorities must match the number of prompts")
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, prompt in enumerate(batch):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, ids, params[i], priority=priorities[i] if priorities else 0)
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
