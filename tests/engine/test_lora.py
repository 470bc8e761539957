"""LoRA adapters: greedy output with an adapter equals PEFT's model ``generate`` token for token
(float64), with several adapters and the base model mixed in one batch, through prefill chunks and
decodes alike; the prefix cache never shares blocks across adapters; the adapters held stay bounded.
The adapters are made with ``peft`` at test time (random A and B)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import reference
from worker.engine import LLM, LoRARequest, SamplingParams
from worker.engine.model.lora import AdapterError

MAX_NEW = 10

# name -> (rank, alpha, targets, rslora): every projection, attention only with rsLoRA, the MLP and o_proj.
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "attn": (8, 16, ["q_proj", "k_proj", "v_proj"], True),
    "mlp": (2, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


def make_adapter(base: Any, target: Path, seed: int, rank: int, alpha: int, modules: list[str], rslora: bool) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0
    )
    # init_lora_weights=False: B random too (PEFT's default zeroes it), so each adapter changes the output.
    get_peft_model(copy.deepcopy(base), config).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def adapters(tiny_ref: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: LoRARequest(name, str(make_adapter(tiny_ref, root / name, seed, *spec)))
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_references(tiny_ref: Any, adapters: dict[str, LoRARequest]) -> Any:
    """``refs(adapter name or None, prompt)``: PEFT's model's greedy ``generate`` (the base model's for None)."""
    from peft import PeftModel

    models = {name: PeftModel.from_pretrained(copy.deepcopy(tiny_ref), r.path).eval() for name, r in adapters.items()}
    cache: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}

    def refs(name: str | None, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = reference(models[name] if name else tiny_ref, prompt, MAX_NEW)
        return cache[key]

    return refs


def prompts(n: int, seed: int, low: int = 2, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40_000) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def make_llm(make_engine: Any, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_loras", 4)
    llm = LLM.__new__(LLM)
    llm.engine, llm._next_id = make_engine(**kwargs), 0
    return llm


def check_mixed(llm: LLM, batch: list[list[int]], names: list[str | None], adapters: Any, refs: Any) -> None:
    requests = [adapters[n] if n else None for n in names]
    outs = llm.generate(batch, SamplingParams(max_new_tokens=MAX_NEW), lora_request=requests)
    for prompt, name, out in zip(batch, names, outs, strict=True):
        assert out.token_ids == refs(name, prompt), f"adapter {name} diverged from PEFT on {len(prompt)} tokens"


def test_adapters_and_base_mixed_in_one_batch_match_peft(make_engine: Any, adapters: Any, peft_references: Any) -> None:
    llm = make_llm(make_engine, max_num_batched_tokens=4096)
    batch = prompts(16, seed=11)
    names: list[str | None] = [[None, "all", "attn", "mlp"][i % 4] for i in range(len(batch))]
    check_mixed(llm, batch, names, adapters, peft_references)
    assert llm.engine.stats.steps <= MAX_NEW + 1  # all prefilled in one step, then decoded together
    # Each adapter changes what the model says: the comparison above is not the base model's against itself.
    for name in ("all", "attn", "mlp"):
        assert any(peft_references(name, p) != peft_references(None, p) for p in batch)


def test_one_adapter_beside_base_rows_and_alone_match_peft(
    make_engine: Any, adapters: Any, peft_references: Any
) -> None:
    llm = make_llm(make_engine, max_num_batched_tokens=4096)
    batch = prompts(4, seed=16)
    check_mixed(llm, batch, [None, "attn", None, "attn"], adapters, peft_references)
    check_mixed(llm, batch, ["mlp"] * 4, adapters, peft_references)


def test_prefill_chunks_beside_decodes_of_other_adapters_match_peft(
    make_engine: Any, adapters: Any, peft_references: Any
) -> None:
    llm = make_llm(make_engine, max_num_batched_tokens=9)  # prompts split into chunks, decodes of others beside
    batch = prompts(8, seed=12, low=12)
    names: list[str | None] = [["all", None, "mlp", "attn"][i % 4] for i in range(len(batch))]
    check_mixed(llm, batch, names, adapters, peft_references)


def test_the_prefix_cache_keeps_adapters_apart(make_engine: Any, adapters: Any, peft_references: Any) -> None:
    llm = make_llm(make_engine, block_size=4)
    prompt = prompts(1, seed=13, low=30, high=31)[0]
    for name in (None, "all", "attn", None, "all"):
        check_mixed(llm, [prompt], [name], adapters, peft_references)
    # The second base and "all" runs reuse their own first run's full blocks (tokens counted); no run found
    # another adapter's.
    assert llm.engine.stats.prefix_cache_hits == 2 * ((len(prompt) - 1) // 4 * 4)


def test_held_adapters_are_bounded_least_recently_used_first(
    make_engine: Any, adapters: Any, peft_references: Any
) -> None:
    llm = make_llm(make_engine, max_loras=2)
    held = llm.engine.adapters
    assert held is not None
    batch = prompts(3, seed=14)
    for name in ("all", "attn", "mlp", "all"):
        check_mixed(llm, batch, [name] * 3, adapters, peft_references)
        assert len(held) <= 2
    assert held.loaded() == ["mlp", "all"]
    assert (held.loads, held.evictions) == (4, 2)
    # A batch using more adapters than the bound holds them all while it runs, then drops back to the bound.
    check_mixed(llm, batch, ["all", "attn", "mlp"], adapters, peft_references)
    assert len(held) == 2


def test_an_adapter_the_engine_cannot_serve_is_refused(make_engine: Any, tmp_path: Path) -> None:
    llm = make_llm(make_engine)
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        llm.generate([[5, 6, 7]], lora_request=LoRARequest("missing", str(tmp_path)))
    base_only = make_llm(make_engine, max_loras=0)
    with pytest.raises(ValueError, match="serves none"):
        base_only.generate([[5, 6, 7]], lora_request=LoRARequest("missing", str(tmp_path)))
    assert not llm.engine.has_unfinished()


def test_the_fused_cpu_path_steps_aside_for_adapter_rows(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    """float32 on the CPU kernels (fused decoder layers, packed matmuls): a step with adapter rows runs the
    layers' own code with the deltas, the base rows beside them keep the fused path's values."""
    from peft import PeftModel

    from worker.engine import EngineConfig, LLMEngine
    from worker.engine.model.fused_decoder_layer import FusedDecoderLayer
    from worker.engine.model.model_loader import load_model

    model, tokenizer = load_model(str(tiny_model_dir), torch.float32, "cpu")
    ref_base, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    llm = LLM.__new__(LLM)
    llm.engine, llm._next_id = (
        LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256, block_size=4, max_loras=4)),
        0,
    )
    if not any(isinstance(layer.__dict__.get("forward"), FusedDecoderLayer) for layer in model.model.layers):
        pytest.skip("the CPU kernels are not built here: no fused layers to step aside from")
    batch = prompts(6, seed=15)
    names = [None, "all", "mlp", None, "attn", "all"]
    outs = llm.generate(
        batch, SamplingParams(max_new_tokens=MAX_NEW), lora_request=[adapters[n] if n else None for n in names]
    )
    for prompt, name, out in zip(batch, names, outs, strict=True):
        ref = PeftModel.from_pretrained(copy.deepcopy(ref_base), adapters[name].path).eval() if name else ref_base
        assert out.token_ids == reference(ref, prompt, MAX_NEW), f"adapter {name} diverged on the fused path"


def test_a_hub_adapter_resolves_through_the_local_hub_cache(
    adapters: dict[str, LoRARequest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter named by hub id (no such local directory) loads from huggingface_hub's cache, laid out as
    ``snapshot_download`` leaves it (refs/main naming a snapshot); offline, an id not in the cache is refused."""
    import shutil

    from huggingface_hub import constants

    from worker.engine.model.lora import resolve_adapter_dir

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-lora"
    shutil.copytree(adapters["mlp"].path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local someone/tiny-lora directory

    assert resolve_adapter_dir("someone/tiny-lora") == repo / "snapshots" / commit
    assert resolve_adapter_dir(adapters["mlp"].path) == Path(adapters["mlp"].path)
    with pytest.raises(AdapterError, match="someone/absent"):
        resolve_adapter_dir("someone/absent")


def test_a_hub_adapter_runs_as_its_local_copy_does(
    make_engine: Any,
    adapters: dict[str, LoRARequest],
    peft_references: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shutil

    from huggingface_hub import constants

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--someone--tiny-lora"
    shutil.copytree(adapters["attn"].path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    llm = make_llm(make_engine)
    prompt = prompts(1, seed=17)[0]
    out = llm.generate(
        [prompt], SamplingParams(max_new_tokens=MAX_NEW), lora_request=LoRARequest("hub", "someone/tiny-lora")
    )
    assert out[0].token_ids == peft_references("attn", prompt)


def test_the_lora_rows_kernel_adds_what_the_torch_ops_add(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    """bf16: the kernel's deltas (each row its own adapter's A and B, held in bf16, a sibling group in one call)
    against the torch ops' (fp32 weights, a mask over the step's adapters, prefill chunks apart), rows of three
    adapters and of none."""
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available
    from worker.engine.model.lora import AdapterSet
    from worker.engine.model.model_loader import load_model

    paged_decode_available()  # builds or loads the CPU kernels' library
    model, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    kernel_set, torch_set = AdapterSet(model, 4, cpu_kernels=True), AdapterSet(model, 4, cpu_kernels=False)
    for request in adapters.values():
        held = kernel_set.acquire(request).layers
        for name, weights in torch_set.acquire(request).layers.items():  # the same bf16 values, in fp32
            assert held[name].a.dtype == torch.bfloat16
            weights.a, weights.b = held[name].a.float(), held[name].b.float()
    keys = {name: r.key for name, r in adapters.items()}
    entries = [(0, 1, keys["all"]), (1, 1, None), (2, 3, keys["attn"]), (5, 1, keys["mlp"]), (6, 1, keys["attn"])]
    with_kernel, with_torch = kernel_set.step_for(entries), torch_set.step_for(entries)
    assert with_kernel is not None and with_torch is not None
    if with_kernel.kernel is None:
        pytest.skip("the CPU kernels are not built here")
    assert with_torch.kernel is None
    attention = model.model.layers[1].self_attn
    siblings, width = [], 0
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        siblings.append((projection, width, width + projection.out_features))
        width += projection.out_features
    torch.manual_seed(0)
    x = torch.randn(7, attention.q_proj.in_features, dtype=torch.bfloat16)
    y = torch.randn(7, width, dtype=torch.bfloat16)
    got = with_kernel.siblings(siblings, x, y.clone())
    want = with_torch.siblings(siblings, x, y.clone())
    one_ulp = {"rtol": 2**-7, "atol": 2**-5}  # the sums' order differs: a value may round one bf16 step apart
    torch.testing.assert_close(got, want, **one_ulp)
    assert torch.equal(got[1], y[1])  # the base row is left alone
    assert not torch.equal(got[0], y[0]) and not torch.equal(got[2:5], y[2:5])
    down = model.model.layers[0].mlp.down_proj
    x = torch.randn(7, down.in_features, dtype=torch.bfloat16)
    y = torch.randn(7, down.out_features, dtype=torch.bfloat16)
    torch.testing.assert_close(with_kernel.module(down, x, y.clone()), with_torch.module(down, x, y.clone()), **one_ulp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("width_in", "outs", "tiled"), [(48, (80, 32), False), (48, (80, 32), True), (40, (24, 8), False)]
)
def test_the_lora_rows_kernel_matches_the_formula_for_blocks_of_rows(
    dtype: torch.dtype, width_in: int, outs: tuple[int, int], tiled: bool
) -> None:
    """Rows of one adapter in blocks (twenty rows: more than a block), of other adapters interleaved and of
    none, a projection an adapter leaves out; sizes that are and are not multiples of 16 (the vector path
    and the plain loops), B transposed as [r, out] and tiled [out/16, r, 16]: each row gets
    y + round(scale * B(A x)), computed here in float64."""
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available

    if not paged_decode_available():
        pytest.skip("the CPU kernels are not built here")
    torch.manual_seed(3)
    rank, adapters = 8, 3
    slots = torch.tensor([0] * 12 + [1, -1, 2, 0, 1] + [0] * 8 + [-1, 2], dtype=torch.long)
    x = torch.randn(len(slots), width_in).to(dtype)
    y = torch.randn(len(slots), sum(outs)).to(dtype)
    from worker.engine.model.lora import LoraWeights, weights_table

    a, bt, scales = [], [], []
    for s in range(adapters):
        for p, out in enumerate(outs):
            absent = s == 2 and p == 1
            a.append(torch.empty(0) if absent else (torch.randn(rank, width_in) / 4).to(dtype))
            bt.append(torch.empty(0) if absent else (torch.randn(rank, out) / 4).to(dtype))
            scales.append(0.0 if absent else 0.5 + s)
    bounds = [0, outs[0], outs[0], outs[0] + outs[1]]
    got = y.clone()
    held = [w.view(rank, -1, 16).transpose(0, 1).contiguous() if tiled and w.numel() else w for w in bt]
    weights = [LoraWeights(a[i], bt[i].T, scales[i], held[i]) if a[i].numel() else None for i in range(len(a))]
    table = weights_table(weights, bounds)
    torch.ops.inflightq.lora_rows(got, x, slots, table.table, bounds, table.dtype)
    want = y.double().clone()
    for i, s in enumerate(slots.tolist()):
        for p in range(len(outs)):
            weights = s * len(outs) + p
            if s < 0 or a[weights].numel() == 0:
                continue
            delta = (bt[weights].double().T @ (a[weights].double() @ x[i].double())) * scales[weights]
            want[i, bounds[2 * p] : bounds[2 * p + 1]] += delta.to(dtype).double()
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2**-7, atol=2**-5)
    assert torch.equal(got[13], y[13]) and torch.equal(got[25], y[25])  # rows of no adapter left alone
    assert torch.equal(got[14, outs[0] :], y[14, outs[0] :])  # the projection adapter 2 leaves out


def test_the_lora_rows_kernel_refuses_what_it_cannot_read() -> None:
    """The weights table is checked as it is built (shapes, layout, one dtype) and as the kernel reads it
    (its width, slots in range, each projection's columns inside y): a clear error, never a wild read."""
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available
    from worker.engine.model.lora import LoraWeights, weights_table

    if not paged_decode_available():
        pytest.skip("the CPU kernels are not built here")
    a, b = torch.randn(4, 32), torch.randn(48, 4)
    good = LoraWeights(a, b, 1.0, b.T.contiguous())
    with pytest.raises(ValueError, match="fitting the projection"):
        weights_table([good], [0, 40])  # B's 48 columns against a 40-column projection
    with pytest.raises(ValueError, match="contiguous"):
        weights_table([LoraWeights(a, b, 1.0)], [0, 48])  # B.T as it comes: not contiguous
    with pytest.raises(ValueError, match="one dtype"):
        weights_table([good, LoraWeights(a.double(), b, 1.0, b.T.contiguous().double())], [0, 48])
    table = weights_table([good], [0, 48])
    y, x, op = torch.zeros(2, 48), torch.randn(2, 32), torch.ops.inflightq.lora_rows
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(y, x, torch.tensor([0, 1]), table.table, [0, 48], table.dtype)
    with pytest.raises(RuntimeError, match="inside y"):
        op(y, x, torch.tensor([0, -1]), table.table, [0, 64], table.dtype)
    with pytest.raises(RuntimeError, match="weights table"):
        op(y, x, torch.tensor([0, -1]), table.table[:, :4].contiguous(), [0, 48], table.dtype)
    with pytest.raises(RuntimeError, match="fp32 or y's dtype"):
        op(y, x, torch.tensor([0, -1]), table.table, [0, 48], torch.bfloat16)
    op(y, x, torch.tensor([0, -1]), table.table, [0, 48], table.dtype)
    torch.testing.assert_close(y[0], b @ (a @ x[0]))
    assert torch.equal(y[1], torch.zeros(48))
    wide = torch.zeros(2, 64)  # y a column slice (strided): computed apart and written back in place
    op(wide[:, 8:56], x, torch.tensor([0, -1]), table.table, [0, 48], table.dtype)
    torch.testing.assert_close(wide[0, 8:56], y[0])
    assert not wide[:, :8].any() and not wide[:, 56:].any() and not wide[1].any()


def test_a_decode_step_with_adapter_rows_runs_all_layers_as_one_op_with_the_same_values(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on decode_linear (up to 4 rows): decode steps with rows of several adapters and of none run every
    layer in one decode_layers call, which adds each projection group's deltas after its matmul as the layers
    one by one do: the same logprobs to the last bit. The adapters target different projections (one leaves
    the attention's out, one the MLP's), so some tables are empty; with only such an adapter's rows nothing
    is added to those groups."""
    from tests.engine.conftest import tiny_llm
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available

    if not paged_decode_available():
        pytest.skip("the CPU kernels are not built here")
    llm = tiny_llm(tiny_model_dir, torch.bfloat16, monkeypatch, decode_rows=4, max_loras=4)
    decode_forward = llm.engine.runner.decode_forward
    assert decode_forward is not None and decode_forward.all_layers is not None
    params = SamplingParams(max_new_tokens=8, logprobs=3)
    batch = prompts(4, seed=5)
    cases: dict[str, list[str | None]] = {"mixed": ["all", None, "attn", "mlp"], "one": ["attn"], "mlp": ["mlp"]}
    results = {}
    for enabled in (True, False):
        decode_forward.all_layers.enabled = enabled
        for case, names in cases.items():
            requests = [adapters[n] if n else None for n in names]
            with torch.profiler.profile() as prof:
                outs = llm.generate(batch[: len(names)], params, lora_request=requests)
            counts = {e.key: e.count for e in prof.key_averages()}
            assert counts.get("inflightq::decode_layers", 0) == (7 if enabled else 0), (case, counts)
            results[enabled, case] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
    decode_forward.all_layers.enabled = True
    for case in cases:
        assert results[True, case] == results[False, case], case
    base = llm.generate(batch[:1], params)[0]
    assert (base.token_ids, base.logprobs) != results[True, "one"][0][:2]  # the adapter changed what was computed
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
