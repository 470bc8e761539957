"""Where a decode step goes at 1 to 64 sequences, against two bounds measured in the same rotation.

One engine (default model) holds ``batch`` sequences of ``--context`` prompt tokens each, all
decoding. Each round runs, in an order that rotates every round, so the machine's drift hits
them alike:

- ``step``: one ``LLMEngine.step`` (a decode step of every sequence), split by the engine's own
  counters into the forward, the sampler (timed around ``Sampler.sample``) and the rest (scheduling,
  block manager, detokenizing, events);
- the forward's parts replayed on the step's own shapes and tensors: ``matmuls`` (every linear of
  the step, head included, through the engine's own kernels at ``batch`` rows), ``attention`` (the
  paged-decode kernel of every layer over the sequences' real block tables and cache), ``small ops``
  (each layer's norms, rotary split, SiLU-and-multiply and residual add at ``batch`` rows); what
  the forward takes beyond their sum is Python, dispatch and allocation (``forward other``);
- ``GEMM``: the step's matmul shapes as plain bf16 GEMMs (``F.linear`` on the weights as loaded),
  and oneDNN's prepacked matmul on the same shapes (of the fp32 upcast on a CPU without bf16 units,
  as the engine packs them); the faster of the two is the GEMM bound;
- ``read``: one read of as many bytes as the step's weights and the K/V it attends over (a buffer no
  cache holds), the memory bound;
- once per batch size, oneDNN's prepacked matmul over the same weights at ``--peak-rows`` rows,
  scaled to ``batch`` rows: the arithmetic floor at the best rate a GEMM reaches on this machine.

Each figure is a median over ``--rounds`` rounds; every ratio is between figures of one rotation.

    python -m bench.step_bounds --batches 1,8,32,64 --context 128 --rounds 15 --out bench/results --tag T
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.results_files import pyplot, run_header, save, stem, write_figure

PARTS = ("step", "matmuls", "attention", "small ops", "GEMM plain", "GEMM packed", "read")


def _timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    started = clock()
    fn()
    return clock() - started


def _clock(name: str) -> Callable[[], float]:
    """``wall`` (perf_counter) or ``cpu`` (the process's CPU time: with one thread on a shared machine,
    what the work itself took, not the time other processes held the core)."""
    return time.process_time if name == "cpu" else time.perf_counter


class StepShapes:
    """The step's linears (the engine's callables and the plain weights), its layers' constants and caches."""

    def __init__(self, engine: Any) -> None:
        from worker.engine.model.fast_linear import PackedLinear

        runner = engine.runner
        forward = runner.decode_forward
        assert forward is not None, "the decode forward applies to the default model"
        self.layers = [layer for _, layer in forward.layers]
        modules = [module for module, _ in forward.layers]
        head = forward.head.__dict__.get("forward")
        linears: list[PackedLinear] = [p for layer in self.layers for p in layer.packed]
        if isinstance(head, PackedLinear):
            linears.append(head)
        self.engine_linears = linears
        # The plain weights of the same shapes: the fused q/k/v and gate/up groups' and the others'.
        plain: list[torch.Tensor] = []
        for module, layer in zip(modules, self.layers, strict=True):
            o, down = module.self_attn.o_proj.weight, module.mlp.down_proj.weight
            plain += [layer.qkv.weight, o.detach(), layer.gate_up.weight, down.detach()]
        plain.append(forward.head.weight.detach())
        self.plain = [w.contiguous() for w in plain]
        # PackedLinear with no kernel layouts: oneDNN's packing, of the fp32 upcast where the CPU has no
        # bf16 units (oneDNN packs no bf16 weight there), as the engine's own matmuls past its kernels.
        self.packed = [PackedLinear(w, None) for w in self.plain]
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.plain)
        self.flops_per_row = 2 * sum(w.numel() for w in self.plain)
        self.kv_caches = runner.kv_caches
        self.dtype = runner.dtype

    def matmuls(self, fns: list[Callable[[torch.Tensor], torch.Tensor]], rows: int) -> Callable[[], None]:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(self.dtype) for w in self.plain}
        pairs = [(fn, inputs[w.shape[1]]) for fn, w in zip(fns, self.plain, strict=True)]

        def run() -> None:
            for fn, x in pairs:
                fn(x)

        return run

    def plain_gemm(self, rows: int) -> Callable[[], None]:
        return self.matmuls([lambda x, w=w: F.linear(x, w) for w in self.plain], rows)

    def small_ops(self, rows: int) -> Callable[[], None]:
        """Each layer's norms, rotary split, SiLU-and-multiply and residual add on ``rows`` rows."""
        ops = torch.ops.inflightq
        first = self.layers[0]
        hidden = torch.randn(1, rows, first.in_weight.shape[0]).to(self.dtype)
        qkv = torch.randn(rows, first.qkv.packed.out_features).to(self.dtype)  # type: ignore[union-attr]
        gate_up = torch.randn(1, rows, first.gate_up.packed.out_features).to(self.dtype)  # type: ignore[union-attr]
        cos = torch.randn(1, rows, first.head_dim).to(self.dtype)
        sin = torch.randn(1, rows, first.head_dim).to(self.dtype)

        def run() -> None:
            for layer in self.layers:
                ops.rms_norm(hidden, layer.in_weight, layer.in_eps)
                ops.rotary_split(qkv, cos, sin, layer.num_heads, layer.num_kv_heads, layer.head_dim)
                _, residual = ops.add_rms_norm(hidden, hidden, layer.post_weight, layer.post_eps)
                down_in = ops.silu_mul(gate_up)
                residual.add(hidden)  # the layer's last op, the residual add
                del down_in

        return run

    def attention(self, meta: Any) -> Callable[[], None]:
        first = self.layers[0]
        rows = meta.num_decodes
        q = torch.randn(rows, first.num_heads, first.head_dim).to(self.dtype)
        out = torch.empty_like(q)
        table = meta.decode_blocks.view(rows, -1)
        lens = meta.decode_context_lens

        def run() -> None:
            for layer in self.layers:
                k_cache, v_cache = self.kv_caches[layer.layer_idx]
                torch.ops.inflightq.paged_decode(q, k_cache, v_cache, table, lens, meta.block_size, layer.scale, out)

        return run

    def kv_bytes(self, context_lens: list[int]) -> int:
        _, v_cache = self.kv_caches[0]
        kv_heads, head_dim = v_cache.shape[0], v_cache.shape[-1]
        per_token = 2 * len(self.kv_caches) * kv_heads * head_dim * v_cache.element_size()
        return per_token * sum(context_lens)


def _read(num_bytes: int) -> Callable[[], None]:
    """One read of ``num_bytes`` from a buffer no cache holds, summed by torch on the engine's threads."""
    buffer = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32)
    return lambda: buffer.sum()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.step_bounds", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--peak-rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time (use with --threads 1)"
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.engine.model.model_loader import load_model

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), "cpu")
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=4096, max_num_seqs=max(batches)))
    shapes = StepShapes(engine)
    clock = _clock(args.clock)
    sampler_time = [0.0]
    sample = engine.sampler.sample

    def timed_sample(*a: Any, **kw: Any) -> Any:
        started = clock()
        try:
            return sample(*a, **kw)
        finally:
            sampler_time[0] += clock() - started

    forward_time = [0.0]
    run = engine.runner.run

    def timed_run(*a: Any, **kw: Any) -> Any:
        started = clock()
        try:
            return run(*a, **kw)
        finally:
            forward_time[0] += clock() - started

    engine.sampler.sample = timed_sample  # type: ignore[method-assign]
    engine.runner.run = timed_run  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(args.seed)
    vocab = len(tokenizer)
    rows = []
    for batch in batches:
        ids = [f"{batch}-{i}" for i in range(batch)]
        for request_id in ids:
            prompt = torch.randint(0, vocab, (args.context,), generator=generator).tolist()
            params = SamplingParams(max_new_tokens=args.rounds + 16, ignore_eos=True)
            engine.add_request(request_id, prompt, params)
        while any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + engine.scheduler.waiting
        ):
            engine.step()
        engine.step()  # every sequence decoding
        seqs = list(engine.scheduler.running)
        assert len(seqs) == batch
        meta, *_ = engine.runner._prepare(seqs, [1] * batch)
        context_lens = [s.num_computed_tokens + 1 for s in seqs]
        kv_bytes = shapes.kv_bytes(context_lens)
        parts: dict[str, Callable[[], Any]] = {
            "step": engine.step,
            "matmuls": shapes.matmuls(shapes.engine_linears, batch),  # type: ignore[arg-type]
            "attention": shapes.attention(meta),
            "small ops": shapes.small_ops(batch),
            "GEMM plain": shapes.plain_gemm(batch),
            "GEMM packed": shapes.matmuls(shapes.packed, batch),
            "read": _read(shapes.weight_bytes + kv_bytes),
        }
        for fn in parts.values():  # warm: first calls allocate and lay out
            if fn is not engine.step:
                fn()
        times: dict[str, list[float]] = {p: [] for p in (*PARTS, "forward", "sampler", "outside forward")}
        for r in range(args.rounds):
            order = PARTS[r % len(PARTS) :] + PARTS[: r % len(PARTS)]
            for part in order:
                if part == "step":
                    forward_time[0] = sampler_time[0] = 0.0
                    wall = _timed(engine.step, clock)
                    forward = forward_time[0]
                    times["step"].append(wall)
                    times["forward"].append(forward)
                    times["sampler"].append(sampler_time[0])
                    times["outside forward"].append(wall - forward - sampler_time[0])
                else:
                    times[part].append(_timed(parts[part], clock))
        peak_run = shapes.matmuls(shapes.packed, args.peak_rows)
        peak_run()
        peak = statistics.median(_timed(peak_run, clock) for _ in range(3)) * batch / args.peak_rows
        for request_id in ids:
            engine.abort(request_id)
        ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
        gemm = min(ms["GEMM plain"], ms["GEMM packed"])
        row = {
            "batch": batch,
            "context_tokens_mean": round(sum(context_lens) / batch, 1),
            "ms": {p: round(v, 3) for p, v in ms.items()},
            "forward_other_ms": round(ms["forward"] - ms["matmuls"] - ms["attention"] - ms["small ops"], 3),
            "gemm_bound_ms": round(gemm, 3),
            "gemm_at_peak_rate_ms": round(peak * 1e3, 3),
            "read_bound_ms": round(ms["read"], 3),
            "read_bytes": shapes.weight_bytes + kv_bytes,
            "kv_bytes": kv_bytes,
            "read_gb_s": round((shapes.weight_bytes + kv_bytes) / ms["read"] / 1e6, 1),
            "matmul_gflop_s": round(shapes.flops_per_row * batch / ms["matmuls"] / 1e6, 1),
            "step_vs_gemm": round(ms["step"] / gemm, 2),
            "step_vs_read": round(ms["step"] / ms["read"], 2),
            "step_vs_bound": round(ms["step"] / max(gemm, ms["read"]), 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        **run_header("bench.step_bounds", argv),
        "model": args.model,
        "dtype": args.dtype,
        "context": args.context,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "weight_bytes": shapes.weight_bytes,
        "rows": rows,
    }
    if args.out:
        save(stem(args.out, "step-bounds", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"# Decode step against its bounds ({report['date']})",
        "",
        f"`{report['command']}`",
        "",
        f"{report['machine']}; model {report['model']}, {report['dtype']}, {report['context']}-token prompts, "
        f"medians of {report['rounds']} rotated rounds, {report['threads']} torch threads, {report['clock']} time "
        f"(cpu: the process's CPU time); weights {report['weight_bytes'] / 1e6:.0f} MB.",
        "",
        "| batch | step ms | forward | matmuls | attention | small ops | forward other | sampler | outside forward "
        "| GEMM bound (plain / packed) | GEMM at peak rate | read bound (GB/s) | step / GEMM | step / read |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        ms = row["ms"]
        lines.append(
            f"| {row['batch']} | {ms['step']:.2f} | {ms['forward']:.2f} | {ms['matmuls']:.2f} "
            f"({row['matmul_gflop_s']} GFLOP/s) | {ms['attention']:.2f} | {ms['small ops']:.2f} "
            f"| {row['forward_other_ms']:.2f} | {ms['sampler']:.2f} | {ms['outside forward']:.2f} "
            f"| {row['gemm_bound_ms']:.2f} ({ms['GEMM plain']:.2f} / {ms['GEMM packed']:.2f}) "
            f"| {row['gemm_at_peak_rate_ms']:.2f} | {row['read_bound_ms']:.2f} ({row['read_gb_s']}) "
            f"| **{row['step_vs_gemm']}x** | **{row['step_vs_read']}x** |"
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = [str(r["batch"]) for r in report["rows"]]
    bottom = [0.0] * len(batches)
    for part, key in (
        ("matmuls", "matmuls"),
        ("attention", "attention"),
        ("small ops", "small ops"),
        ("sampler", "sampler"),
        ("outside forward", "outside forward"),
    ):
        values = [r["ms"][key] for r in report["rows"]]
        ax.bar(batches, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(batches, [r["gemm_bound_ms"] for r in report["rows"]], "k_", markersize=30, label="GEMM bound")
    ax.plot(batches, [r["read_bound_ms"] for r in report["rows"]], "r_", markersize=30, label="read bound")
    ax.set_xlabel("sequences")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7)
    write_figure(fig, path)


if __name__ == "__main__":
    main()
