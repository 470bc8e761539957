"""LoRA adapters in PEFT's format, several of them and the base model mixed in one batch.

An adapter is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``, as
PEFT's ``save_pretrained`` writes it, or a hub id whose snapshot holds them. For each linear layer
it targets it holds ``A`` [r, in] and ``B`` [out, r], and the layer's output becomes
``y + scale * B(A x)`` (PEFT's order of operations, so float64 results match PEFT's model).

A step may hold rows of several adapters and rows of none. ``LoraStep`` gives each row its
adapter's slot; on the CPU kernels (a 16-bit or fp32 model) one op per projection group (q/k/v,
o, gate/up, down) adds every row's delta with its own adapter's A and B (``lora_rows``, in
``kernels/lora_rows.cpp``): each adapter's rows are taken together and read only its weights, which
sit in one buffer per adapter (``AdapterSet._packed``), and a step pays four calls a layer (a
16-bit model's adapters held in its dtype, the sums in fp32). Elsewhere (fp64, GPUs, no
kernels) the decode rows go through one grouped torch op per layer,
``((x @ A_cat.T) * mask) @ B_cat.T``, where ``A_cat`` / ``B_cat`` concatenate the step's adapters
along the rank and the mask keeps each row's own adapter's columns (zeros elsewhere add nothing,
so a row without an adapter keeps the base output exactly); each prefill chunk, many rows of one
adapter, with its own A and B.

Where it hooks in: every linear layer inside the decoder's layers gets a ``LoraLinear`` forward
(once the engine loads its first adapter) that adds the step's delta when the step has adapter
rows and is the old forward otherwise: transformers' layer code calls those. The fused CPU decoder
layers call their projections directly, so they add the deltas themselves (``LoraStep.module`` /
``siblings``, where ``meta.lora`` is set); the one-op decode step and CUDA graphs step aside for a
step with adapter rows. A step without keeps every fast path untouched.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_COMBINATIONS = 8  # concatenated weights kept for this many distinct sets of a step's adapters
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the model dtypes lora_rows takes


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with: its ``name`` (what requests call it) and the directory it loads from."""

    name: str
    path: str

    @functools.cached_property
    def key(self) -> str:
        """Names the adapter's weights: the prefix cache keeps blocks of different keys apart."""
        return f"{self.name}@{self.path}"


@dataclass
class LoraWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float
    held_bt: torch.Tensor | None = None  # B transposed as lora_rows reads it, where the set packs it

    @property
    def bt(self) -> torch.Tensor:
        """B transposed as lora_rows reads it: [r, out], or tiled [out/16, r, 16] where the set packed it."""
        return self.held_bt if self.held_bt is not None else self.b.T


@dataclass
class Adapter:
    request: LoRARequest
    layers: dict[str, LoraWeights]  # module name (``model.layers.0.self_attn.q_proj``) -> its weights
    pins: int = 0  # sequences in the engine using it; a pinned adapter is never evicted

    @functools.cached_property
    def key(self) -> str:
        return self.request.key


class AdapterError(ValueError):
    """An adapter that cannot be served: missing files, a format or a feature this engine does not run."""


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    # PEFT's rule: a pattern key matches a module whose name ends with it (after a dot or in full).
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", name):
            return value
    return default


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # owner/name: a hub repository, where no such local directory exists


def resolve_adapter_dir(path: str | Path) -> Path:
    """The local directory of an adapter: ``path`` itself, or for a hub id (``owner/name``, not a local
    directory) its snapshot through huggingface_hub, from the local cache first with ``HF_HUB_OFFLINE``."""
    directory = Path(path).expanduser()
    if directory.is_dir() or not HUB_ID.match(str(path)):
        return directory
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(
            snapshot_download(
                str(path), allow_patterns=[CONFIG_FILE, WEIGHTS_FILE], local_files_only=constants.HF_HUB_OFFLINE
            )
        )
    except Exception as exc:  # not on the hub, no network and not cached, offline and not cached
        raise AdapterError(f"{path}: neither a local directory nor a hub adapter found ({exc})") from exc


def read_adapter(path: str | Path, targets: dict[str, nn.Linear]) -> tuple[dict[str, Any], dict[str, LoraWeights]]:
    """The adapter's config and its weights per module (on the CPU, as stored), checked against ``targets``
    (the model's linears that may carry an adapter, by name); ``path`` a local directory or a hub id."""
    from safetensors.torch import load_file

    directory = resolve_adapter_dir(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{directory} does not hold {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{directory}: peft_type {config.get('peft_type')!r} (only LORA is served)")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "bias": config.get("bias", "none") != "none",
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if any(unsupported.values()):
        raise AdapterError(f"{directory}: {', '.join(k for k, v in unsupported.items() if v)} not supported")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    alpha_pattern = config.get("alpha_pattern") or {}
    tensors = load_file(str(weights_file))
    layers: dict[str, LoraWeights] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise AdapterError(f"{directory}: unexpected tensor {key} (only LoRA A/B weights are served)")
            continue
        name = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        linear = targets.get(name)
        if linear is None:
            raise AdapterError(f"{directory}: targets {name}, not a linear layer of the model's decoder layers")
        if b is None or a.dim() != 2 or b.shape != (linear.out_features, a.shape[0]):
            raise AdapterError(f"{directory}: {name}'s A/B shapes do not fit its layer")
        if a.shape[1] != linear.in_features:
            raise AdapterError(f"{directory}: {name}'s A/B shapes do not fit its layer")
        rank = a.shape[0]
        module_alpha = float(_pattern_value(alpha_pattern, name, alpha))
        scale = module_alpha / (rank**0.5 if rslora else rank)
        layers[name] = LoraWeights(a, b, scale)
    if not layers:
        raise AdapterError(f"{directory}: no LoRA weights")
    return config, layers


@dataclass(frozen=True)
class WeightsTable:
    """``lora_rows``' weights for one projection group and one set of adapters: per adapter and projection
    the addresses of A and B transposed, the rank, whether B is tiled and the scale (int64 [S * P, 5]), with
    the tensors it points into held here, so they live as long as the table."""

    table: torch.Tensor
    dtype: torch.dtype  # the weights': fp32 or the model's
    held: tuple[torch.Tensor, ...]


def weights_table(weights: Sequence[LoraWeights | None], bounds: Sequence[int]) -> WeightsTable:
    """The table of ``weights`` (slot-major: adapter s's projection p at s * P + p, None where it leaves p
    out), each projection p's output at columns ``bounds[2p]:bounds[2p+1]``; checks what the kernel trusts:
    one dtype, contiguous A [r, in] of one ``in``, Bt [r, out] or tiled [out/16, r, 16] of p's width."""
    groups = len(bounds) // 2
    present = [w for w in weights if w is not None]
    dtype, width_in = present[0].a.dtype, present[0].a.shape[1]
    rows: list[list[int]] = []
    held: list[torch.Tensor] = []
    for i, w in enumerate(weights):
        if w is None:
            rows.append([0, 0, 0, 0, 0])
            continue
        out, a, bt = bounds[2 * (i % groups) + 1] - bounds[2 * (i % groups)], w.a, w.bt
        rank = a.shape[0]
        tiled = bt.dim() == 3
        fits = bt.shape == ((out // 16, rank, 16) if tiled else (rank, out))
        if a.dtype != dtype or bt.dtype != dtype or a.device.type != "cpu" or bt.device.type != "cpu":
            raise ValueError("lora_rows' weights are CPU tensors of one dtype")
        if a.dim() != 2 or a.shape[1] != width_in or not fits or not a.is_contiguous() or not bt.is_contiguous():
            raise ValueError("lora_rows' weights are contiguous A [r, in] and B transposed fitting the projection")
        scale_bits = int(torch.tensor(w.scale, dtype=torch.float32).view(torch.int32))
        rows.append([a.data_ptr(), bt.data_ptr(), rank, int(tiled), scale_bits])
        held += [a, bt]
    return WeightsTable(torch.tensor(rows, dtype=torch.long), dtype, tuple(held))


def group_columns(
    name_of: dict[int, str], linears: Sequence[tuple[nn.Module, int, int]]
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A projection group's target names ('' for a linear no adapter may target) and its columns, lo, hi
    per projection, as ``lora_rows`` takes them."""
    names = tuple(name_of.get(id(linear), "") for linear, _, _ in linears)
    return names, tuple(b for _, lo, hi in linears for b in (lo, hi))


class LoraStep:
    """One step's rows grouped by adapter: ``entries`` is the runner's row layout, each entry
    (first row, rows, adapter or None) in the flattened batch's order."""

    def __init__(
        self,
        entries: Sequence[tuple[int, int, Adapter | None]],
        combination: Callable[..., Any],
        compute_dtype: torch.dtype,
        name_of: dict[int, str] | None = None,
        kernel: Callable[[tuple[str, ...], tuple[int, ...], list[Adapter]], Any] | None = None,
        sibling_keys: dict[int, tuple[Any, tuple[str, ...], tuple[int, ...]]] | None = None,
        stack: Callable[[Any, list[Adapter]], Any] | None = None,
    ) -> None:
        self.compute_dtype = compute_dtype
        self.name_of = name_of or {}  # id of a target linear -> its name
        # id of a fused sibling group -> it, its linears' names and columns (kept across steps: groups stay put)
        self.sibling_keys = sibling_keys if sibling_keys is not None else {}
        self.num_rows = sum(n for _, n, _ in entries)
        # The kernel's layout: every adapter of the step, and each row's slot among them (-1: none).
        self.kernel = kernel
        self._stack = stack
        self.adapters = list({a.key: a for _, _, a in entries if a is not None}.values())
        slot_of = {a.key: i for i, a in enumerate(self.adapters)}
        slots: list[int] = []
        for _, n, a in entries:
            slots += [slot_of[a.key] if a is not None else -1] * n
        self.slots = torch.tensor(slots, dtype=torch.long)
        self._tables: dict[tuple[str, ...], WeightsTable | bool] = {}
        # Single-row entries (decodes) go through the grouped op; longer ones (prefill chunks) one by one.
        singles = [(row, adapter) for row, n, adapter in entries if n == 1 and adapter is not None]
        self.chunks = [(row, row + n, adapter) for row, n, adapter in entries if n > 1 and adapter is not None]
        self.group: tuple[torch.Tensor, list[Adapter]] | None = None
        self._combination = combination
        self._masks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Every row of one adapter (one stream, or a batch of one fine-tune): one delta over all rows.
        keys = {a.key if a is not None else None for _, _, a in entries}
        self.uniform = entries[0][2] if len(keys) == 1 else None
        if singles:
            adapters = list({a.key: a for _, a in singles}.values())
            rows = torch.tensor([row for row, _ in singles], dtype=torch.long)
            self.group = (rows, adapters)
            self._slot = {a.key: i for i, a in enumerate(adapters)}
            self._single_adapters = [a for _, a in singles]

    def kernel_applies(self, x: torch.Tensor) -> bool:
        # The set gives a kernel only on the CPU (AdapterSet.kernel): the dtype is what is left to check.
        return self.kernel is not None and x.dtype in KERNEL_DTYPES

    def apply_kernel(
        self, names: tuple[str, ...], bounds: tuple[int, ...], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """``y`` (the projections ``names``' outputs for ``x``, each at its columns ``bounds[2p]:bounds[2p+1]``)
        with every row's delta added in place by the ``lora_rows`` kernel (``kernel_applies`` says where)."""
        found = self._tables.get(names)
        if found is None:
            assert self.kernel is not None
            found = self._tables[names] = self.kernel(names, bounds, self.adapters)
        if found is False:  # no adapter of the step targets these projections
            return y
        if y.dim() == 2 and x.dim() == 2:  # the fused layers' rows: no reshaping on the path of every call
            torch.ops.inflightq.lora_rows(y, x, self.slots, found.table, bounds, found.dtype)
            return y
        y2 = y.reshape(-1, y.shape[-1])
        torch.ops.inflightq.lora_rows(y2, x.reshape(-1, x.shape[-1]), self.slots, found.table, bounds, found.dtype)
        return y if y2.data_ptr() == y.data_ptr() else y.copy_(y2.view(y.shape))  # reshape viewed y, or copied it

    def stacked_tables(
        self, groups: Any
    ) -> tuple[list[torch.Tensor], tuple[tuple[int, ...], ...], torch.dtype] | bool | None:
        """For the one-op decode step (``DecodeLayers``; ``groups``: per layer its four projection groups, each
        a list of (module, lo, hi)): per group, every layer's weights table stacked [layers, S * P, 5], the q/k/v
        and gate/up columns (alike in every layer), and the weights' dtype; False where no adapter of the step
        targets any projection, None where the kernel does not apply."""
        if self._stack is None:
            return None
        return self._stack(groups, self.adapters)

    def __call__(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base layer's output for ``x``) with the adapters' deltas of layer ``name`` added."""
        if self.kernel_applies(x):
            return self.apply_kernel((name,), (0, y.shape[-1]), x, y)
        if self.uniform is not None:
            weights = self.uniform.layers.get(name)
            if weights is None:
                return y
            return y + ((x.to(self.compute_dtype) @ weights.a.T) @ weights.b.T * weights.scale).to(y.dtype)
        if self.group is None and not any(name in a.layers for _, _, a in self.chunks):
            return y
        out = y.reshape(-1, y.shape[-1]).clone()
        x2 = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
        for lo, hi, adapter in self.chunks:
            weights = adapter.layers.get(name)
            if weights is not None:
                out[lo:hi] += ((x2[lo:hi] @ weights.a.T) @ weights.b.T * weights.scale).to(out.dtype)
        if self.group is not None:
            rows, adapters = self.group
            if len(adapters) == 1:  # one adapter beside base rows: no mask needed
                weights = adapters[0].layers.get(name)
                if weights is not None:
                    rows = rows.to(x2.device)
                    out[rows] += ((x2[rows] @ weights.a.T) @ weights.b.T * weights.scale).to(out.dtype)
                return out.view(y.shape)
            combined = self._combination(name, adapters)
            if combined is not None:
                a_cat, b_cat, bounds, scales = combined
                mask, row_scale = self._mask(name, bounds, scales, x2.dtype, x2.device)
                rows = rows.to(x2.device)
                out[rows] += (((x2[rows] @ a_cat.T) * mask) @ b_cat.T * row_scale).to(out.dtype)
        return out.view(y.shape)

    def module(self, linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``__call__`` for the layer ``linear`` (a fused decoder layer's projection, which knows the module)."""
        if self.kernel_applies(x):
            return self.apply_kernel(*self._group(linear, ((linear, 0, y.shape[-1]),)), x, y)
        name = self.name_of.get(id(linear))
        return y if name is None else self(name, x, y)

    def siblings(self, linears: Sequence[tuple[nn.Module, int, int]], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A fused sibling group's output ``y`` (each linear's columns lo:hi) with each sibling's delta added."""
        if self.kernel_applies(x):
            return self.apply_kernel(*self._group(linears, linears), x, y)
        out: torch.Tensor | None = None
        for linear, lo, hi in linears:
            part = y[..., lo:hi]
            added = self.module(linear, x, part)
            if added is not part:
                if out is None:
                    out = y.clone()
                out[..., lo:hi] = added
        return y if out is None else out

    def _group(
        self, owner: Any, linears: Sequence[tuple[nn.Module, int, int]]
    ) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """A projection group's names and columns (``group_columns``), kept across steps by ``owner``'s id
        (a fused layer's sibling list, or the projection itself): groups stay put."""
        found = self.sibling_keys.get(id(owner))
        if found is None or found[0] is not owner:  # the id of a group no longer alive: recomputed
            found = self.sibling_keys[id(owner)] = (owner, *group_columns(self.name_of, linears))
        return found[1], found[2]

    def _mask(
        self, name: str, bounds: list[tuple[int, int]], scales: list[float], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per single row: 1 on its adapter's rank columns (0 elsewhere), and its adapter's scale for ``name``."""
        cache_key = f"{bounds}{scales}"
        cached = self._masks.get(cache_key)
        if cached is not None:
            return cached
        width = bounds[-1][1]
        mask = torch.zeros(len(self._single_adapters), width, dtype=dtype)
        row_scale = torch.zeros(len(self._single_adapters), 1, dtype=dtype)
        for i, adapter in enumerate(self._single_adapters):
            slot = self._slot[adapter.key]
            lo, hi = bounds[slot]
            mask[i, lo:hi] = 1
            row_scale[i, 0] = scales[slot]
        self._masks[cache_key] = cached = (mask.to(device), row_scale.to(device))
        return cached


@dataclass
class _Combination:
    """A set of adapters' weights of one layer, concatenated along the rank (absent ones take no columns)."""

    a_cat: torch.Tensor
    b_cat: torch.Tensor
    bounds: list[tuple[int, int]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


class AdapterSet:
    """The adapters an engine holds, at most ``max_loaded`` of them unless more are pinned (LRU beyond), on
    the model's device in the deltas' dtype (the model's; fp32 for a 16-bit model on a CPU), and the
    ``LoraLinear`` forwards reading the step in progress."""

    def __init__(self, model: nn.Module, max_loaded: int, cpu_kernels: bool = True) -> None:
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # The deltas' matmuls: a CPU's 16-bit matmuls of these small shapes run far slower than fp32 ones.
        half = self.dtype in (torch.bfloat16, torch.float16) and self.device.type == "cpu"
        self.compute_dtype = torch.float32 if half else self.dtype
        # The lora_rows kernel (CPU, fp32 deltas, the CPU kernels on and built); the torch ops elsewhere.
        self.kernel = cpu_kernels and self.device.type == "cpu" and self.compute_dtype == torch.float32
        # The kernel reads a 16-bit model's adapters in its dtype (sums in fp32): a step streams every adapter
        # its rows use, and at many adapters those reads are most of what the deltas cost.
        self._half = half
        self.max_loaded = max_loaded
        self.targets = lora_targets(model)
        self.name_of = {id(linear): name for name, linear in self.targets.items()}
        self._adapters: OrderedDict[str, Adapter] = OrderedDict()  # by key, least recently used first
        self._combinations: OrderedDict[tuple[str, ...], dict[Any, Any]] = OrderedDict()
        self._last_layers: tuple[list[Adapter], dict[Any, Any]] | None = None  # the last set asked for
        self._sibling_keys: dict[int, tuple[Any, tuple[str, ...], tuple[int, ...]]] = {}  # LoraStep.sibling_keys
        self._lock = threading.Lock()
        self.step: LoraStep | None = None  # set by the runner around a forward with adapter rows
        self.loads = 0
        self.evictions = 0
        self.load_time_s = 0.0
        # A model object an earlier engine served adapters on has the forwards already: this engine takes them over.
        self._installed = any(isinstance(t.__dict__.get("forward"), LoraLinear) for t in self.targets.values())
        if self._installed:
            self._install()

    def _install(self) -> None:
        """Wraps the targets' forwards, at the first load: an engine that never loads an adapter runs unchanged."""
        for name, linear in self.targets.items():
            forward = linear.__dict__.get("forward")
            if isinstance(forward, LoraLinear):
                forward.adapters = self  # a second engine over the same model object takes the forwards over
            else:
                linear.forward = LoraLinear(self, name, linear.forward)  # type: ignore[method-assign]
        self._installed = True

    def __len__(self) -> int:
        return len(self._adapters)

    def loaded(self) -> list[str]:
        """Names of the adapters held, least recently used first."""
        with self._lock:
            return [a.request.name for a in self._adapters.values()]

    def loaded_keys(self) -> list[str]:
        """Keys (``LoRARequest.key``) of the adapters held."""
        with self._lock:
            return list(self._adapters)

    def acquire(self, request: LoRARequest) -> Adapter:
        """The adapter of ``request``, pinned (``release`` unpins it); loaded from disk if not held, without
        holding the set's lock (a step never waits on a load)."""
        with self._lock:
            adapter = self._adapters.get(request.key)
            if adapter is not None:
                adapter.pins += 1
                self._adapters.move_to_end(request.key)
                return adapter
        started = time.perf_counter()
        _, raw = read_adapter(request.path, self.targets)
        if self.kernel_built():
            layers = self._packed(raw, self.dtype if self._half else self.compute_dtype)
        else:
            layers = {
                name: LoraWeights(
                    w.a.to(self.device, self.compute_dtype), w.b.to(self.device, self.compute_dtype), w.scale
                )
                for name, w in raw.items()
            }
        with self._lock:
            adapter = self._adapters.get(request.key)  # another thread may have loaded it meanwhile
            if not self._installed:
                self._install()  # a step running now has no adapter rows: the wrappers pass its values through
            if adapter is None:
                adapter = self._adapters[request.key] = Adapter(request, layers)
                self.loads += 1
                self.load_time_s += time.perf_counter() - started
            adapter.pins += 1
            self._adapters.move_to_end(request.key)
            self._evict()
            return adapter

    def _packed(self, raw: dict[str, LoraWeights], dtype: torch.dtype) -> dict[str, LoraWeights]:
        """The adapter's weights for lora_rows, in one buffer in the model's layer order (each A, then its B
        transposed, tiled [out/16, r, 16] where out allows): a step reads an adapter as a few long streams,
        not hundreds of short ones the memory system has to start afresh (docs/benchmarks.md, LoRA)."""
        names = [name for name in self.targets if name in raw]
        total = sum(raw[name].a.numel() + raw[name].b.numel() for name in names)
        buffer = torch.empty(total, dtype=dtype, device=self.device)
        layers, offset = {}, 0
        for name in names:
            w = raw[name]
            (rank, width_in), out = w.a.shape, w.b.shape[0]
            a = buffer[offset : offset + rank * width_in].view(rank, width_in)
            a.copy_(w.a)
            offset += a.numel()
            bt = w.b.T.to(dtype)
            if out % 16 == 0:
                bt = bt.reshape(rank, out // 16, 16).transpose(0, 1)
            held = buffer[offset : offset + bt.numel()].view(bt.shape)
            held.copy_(bt)
            offset += held.numel()
            layers[name] = LoraWeights(a, w.b.to(self.device, dtype), w.scale, held)
        return layers

    def release(self, adapter: Adapter) -> None:
        with self._lock:
            adapter.pins -= 1
            self._evict()

    def get(self, key: str) -> Adapter | None:
        with self._lock:
            return self._adapters.get(key)

    def _evict(self) -> None:
        """With the lock held: drop least recently used unpinned adapters past ``max_loaded``."""
        for key in list(self._adapters):
            if len(self._adapters) <= self.max_loaded:
                return
            if self._adapters[key].pins <= 0:
                del self._adapters[key]
                self.evictions += 1
                for combo in [c for c in self._combinations if key in c]:
                    del self._combinations[combo]
                self._last_layers = None

    def begin_step(self, seqs: Sequence[Any]) -> bool:
        """Clears the last step's rows; whether any of ``seqs`` (the engine's sequences) runs an adapter."""
        self.step = None
        return any(s.adapter is not None for s in seqs)

    def step_for(self, entries: Sequence[tuple[int, int, str | None]]) -> LoraStep | None:
        """The step's LoRA rows (entries: first row, rows, adapter key or None), or None where it has none."""
        if all(key is None for _, _, key in entries):
            return None
        with self._lock:
            grouped = [(row, n, self._adapters[key] if key is not None else None) for row, n, key in entries]
        built = self.kernel_built()
        kernel, stack = (self._kernel_table, self._kernel_stack) if built else (None, None)
        return LoraStep(grouped, self._combination, self.compute_dtype, self.name_of, kernel, self._sibling_keys, stack)

    def kernel_built(self) -> bool:
        """Whether steps run the lora_rows kernel: it applies here and the CPU kernels' library is loaded."""
        return self.kernel and hasattr(getattr(torch.ops, "inflightq", None), "lora_rows")

    def _layers_of(self, adapters: list[Adapter]) -> dict[Any, Any]:
        """The per-layer cache kept for this set of adapters (most recently used last, at most MAX_COMBINATIONS)."""
        last = self._last_layers
        if last is not None and last[0] is adapters:  # the same step's list: every layer asks, once per group
            return last[1]
        combo = tuple(a.key for a in adapters)
        with self._lock:
            layers = self._combinations.get(combo)
            if layers is None:
                layers = self._combinations[combo] = {}
                while len(self._combinations) > MAX_COMBINATIONS:
                    self._combinations.popitem(last=False)
            else:
                self._combinations.move_to_end(combo)
            self._last_layers = (adapters, layers)
        return layers

    def _kernel_table(
        self, names: tuple[str, ...], bounds: tuple[int, ...], adapters: list[Adapter]
    ) -> WeightsTable | bool:
        """``lora_rows``' weights table for the projections ``names`` (at columns ``bounds``) and the step's
        ``adapters`` (row s * len(names) + p: adapter s's projection p), or False where none of them targets
        any; kept per set of adapters like the torch path's concatenations."""
        layers = self._layers_of(adapters)
        found = layers.get(names)
        if found is None:
            weights = [a.layers.get(name) for a in adapters for name in names]
            found = False if all(w is None for w in weights) else weights_table(weights, bounds)
            layers[names] = found
        return found

    def _kernel_stack(self, groups: Any, adapters: list[Adapter]) -> Any:
        """``LoraStep.stacked_tables`` for ``adapters``, kept per set of adapters (the layers' own tables too)."""
        layers = self._layers_of(adapters)
        found = layers.get(("stacked", id(groups)))
        if found is not None and found[0] is groups:
            return found[1]
        per_kind: list[list[WeightsTable | bool]] = [[], [], [], []]
        bounds: list[set[tuple[int, ...]]] = [set(), set(), set(), set()]
        for layer in groups:
            for kind, linears in enumerate(layer):
                names, columns = group_columns(self.name_of, linears)
                per_kind[kind].append(self._kernel_table(names, columns, adapters))
                bounds[kind].add(columns)
        present = [t for kind in per_kind for t in kind if isinstance(t, WeightsTable)]
        result: Any
        if any(len(b) != 1 for b in bounds) or len({t.dtype for t in present}) > 1:
            result = None  # layers that differ: the layers one by one
        elif not present:
            result = False
        else:
            tables = []
            for kind, per_layer in enumerate(per_kind):
                width = len(adapters) * (len(next(iter(bounds[kind]))) // 2)
                absent = torch.zeros(width, 5, dtype=torch.long)
                tables.append(torch.stack([t.table if isinstance(t, WeightsTable) else absent for t in per_layer]))
            result = (tables, (next(iter(bounds[0])), next(iter(bounds[2]))), present[0].dtype)
        layers[("stacked", id(groups))] = (groups, result)  # beside the layers' tables, which hold the weights
        return result

    def _combination(self, name: str, adapters: list[Adapter]) -> tuple[Any, ...] | None:
        layers = self._layers_of(adapters)
        if name not in layers:
            layers[name] = _concatenate(name, adapters)
        found = layers[name]
        return None if found is None else (found.a_cat, found.b_cat, found.bounds, found.scales)


def _concatenate(name: str, adapters: list[Adapter]) -> _Combination | None:
    present = [a.layers.get(name) for a in adapters]
    if all(w is None for w in present):
        return None
    a_parts, b_parts, bounds, scales = [], [], [], []
    start = 0
    for weights in present:
        rank = weights.a.shape[0] if weights is not None else 0
        if weights is not None:
            a_parts.append(weights.a)
            b_parts.append(weights.b)
        bounds.append((start, start + rank))
        scales.append(weights.scale if weights is not None else 0.0)
        start += rank
    return _Combination(torch.cat(a_parts).contiguous(), torch.cat(b_parts, dim=1).contiguous(), bounds, scales)


class LoraLinear:
    """A linear layer's forward: its old forward, plus the step's adapter deltas where the step has adapter rows."""

    def __init__(self, adapters: AdapterSet, name: str, base: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.adapters, self.name, self.base = adapters, name, base

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.adapters.step
        return y if step is None else step(self.name, x, y)

    def __getattr__(self, name: str) -> Any:
        # The rerouted pieces' attributes (a fused sibling's ``group``) stay readable through the wrapper.
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)


def uninstall(model: nn.Module) -> None:
    """Gives the targets of a model object an earlier engine served adapters on their own forwards back: an
    engine that serves none must not run the earlier engine's LoRA forwards (their last step's rows)."""
    for linear in lora_targets(model).values():
        forward = linear.__dict__.get("forward")
        if isinstance(forward, LoraLinear):
            linear.forward = forward.base  # type: ignore[method-assign]


def lora_targets(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers an adapter may target: those inside the decoder's layers, by their module names."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else None
    if layers is None:
        raise AdapterError("the model has no decoder layers LoRA can target")
    layer_ids = {id(layer) for layer in layers}
    prefix_of = {id(m): name for name, m in model.named_modules() if id(m) in layer_ids}
    targets: dict[str, nn.Linear] = {}
    for layer in layers:
        prefix = prefix_of[id(layer)]
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                targets[f"{prefix}.{name}"] = module
    return targets
