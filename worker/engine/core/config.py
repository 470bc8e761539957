"""The engine's knobs in one place. The engine reads no environment: the worker fills this from
its settings (``INFLIGHTQ_*``), the offline ``LLM`` from its keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str = ""  # a Hugging Face directory, a .gguf file, a hub id, or a model name the resolver knows
    served_model_name: str | None = None  # what requests call the model; None = model
    dtype: str | torch.dtype = "auto"  # auto: bf16 where the hardware runs it fast, else fp32 (fp16 on old GPUs)
    device: str | torch.device = "auto"  # auto: cuda if present, else cpu
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # tokens one step computes at most
    # Prompt tokens a step that also decodes computes at most; None = up to max_num_batched_tokens.
    # Bounds a step's time (each stream's time between tokens, and how long an urgent arrival waits
    # for the step in progress) under load; a step without decodes still prefills at full budget.
    max_prefill_tokens_beside_decodes: int | None = None
    block_size: int = 16  # tokens per KV cache block
    # None: what max_num_seqs sequences of max_model_len tokens fill, at most kv_memory_fraction of free memory.
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.25  # of the memory free at start; processes sharing it each take a share
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings (and what the KV cache holds)
    aging_steps: int | None = 256  # steps after which a waiting request gains one priority level; None: no aging
    fair_share: bool = True  # False: tenants are not told apart in who runs next (no fair clause of displaces)
    attention_backend: str = "auto"  # auto, torch, cpu (the compiled CPU kernel), flash
    cpu_kernels: bool = True  # False: never build or use the compiled CPU kernels (plain-torch attention, HF layers)
    amx_linear: bool = True  # False: bf16 matmuls of a few dozen rows stay on oneDNN on AMX CPUs too
    kernel_cache_dir: str | None = None  # where the CPU kernel is built; None: ~/.cache/inflightq/kernels
    # Compiled forward (torch.compile over padded token-count buckets, all compiled at start). Off by
    # default: a CPU step is bound by streaming the weights, so compiling gains little for minutes of
    # warm-up at every start (see docs/benchmarks.md). "auto": on for CPU bf16/fp32 models.
    compile: bool | str = False
    compile_cache_dir: str | None = None  # inductor's caches; None: ~/.cache/inflightq/inductor
    # Token counts compiled for; a step runs the smallest bucket >= its tokens, bigger steps run eager.
    compile_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # One graph for 2..max(compile_buckets) tokens (symbolic size, no padding) plus one for a single
    # token, instead of one graph per bucket: two compiles at warm-up instead of len(buckets).
    compile_dynamic: bool = False
    # Decode steps replayed from CUDA graphs, one per padded batch-size bucket (worker/engine/model/decode_graphs.py).
    # "auto": on CUDA (not with compile; a failed capture leaves decode eager); True: on, CUDA only, a failed
    # capture fails the start; "eager": the same padded step uncaptured.
    cuda_graphs: bool | str = "auto"
    converted_model_dir: str | None = None  # a .gguf's de-quantized copy; None: ~/.cache/inflightq/models/<name>
    # Intra-op CPU threads (worker/engine/core/cpu_threads.py): None leaves torch's setting alone; N > 0 runs N;
    # 0 runs as many as the CPUs this process may use (affinity, cgroup quota) times cpu_share, fewer while
    # other processes take some of them.
    cpu_threads: int | None = None
    cpu_share: float = 1.0  # with cpu_threads=0: this engine's share of those CPUs (engines sharing a host)

    # Speculative decoding from the sequence's own n-grams (worker/engine/core/speculation.py): tokens proposed
    # per step at most (0: never), the n-gram lengths looked up, the share of proposed tokens kept below which
    # a sequence pauses proposing, and whether a request that does not say (SamplingParams.speculate None) speculates.
    speculative_tokens: int = 4
    speculative_ngram_max: int = 3
    speculative_ngram_min: int = 2
    speculative_min_acceptance: float = 0.3
    speculate_by_default: bool = False

    # LoRA adapters held at once (least recently used dropped beyond, never one a request in the engine uses);
    # 0: the engine serves no adapters and its forward is the base model's alone (worker/engine/model/lora.py).
    max_loras: int = 0

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
