"""LoRA adapters in the batch: throughput and time per output token at 1, 8 and 32 streams with 0
(the base model alone), 1, 4 and 16 distinct adapters spread over the streams, same engine, same run.

One offline engine on the default model serves every cell (its adapters made with ``peft`` at the
start: random rank-8 A and B on every projection of every layer, so each costs what a real one
does); the cells alternate per round. Each cell submits ``streams`` requests at once (greedy, the
engine benchmark's questions) and runs them to the end: tokens/s over the wall time, and TPOT, each
request's time from its first to its last token over its tokens after the first. Speculative
decoding is off, so the figures are the adapters' alone. Reports each cell's ratio to the base
model's cell at the same streams.

``--peers vllm`` then runs the same cells on vLLM's CPU build (bench/peers/install.sh) with the same
adapters, prompts and settings, in its own venv's python (bench/peers/vllm_lora.py), and reports its tok/s
and TPOT per cell, each against vLLM's own base cell, and ours over vLLM's; when vLLM cannot serve LoRA
here the results say why instead.

    python -m bench.lora            # or: inflightq bench lora
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine import QUESTIONS
from bench.results_files import run_header
from bench.speculative import chat_prompts

STREAMS = (1, 8, 32)
ADAPTER_COUNTS = (0, 1, 4, 16)
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_lora.py"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Any, count: int, root: Path, rank: int) -> list[Any]:
    """``count`` random adapters of ``model`` saved under ``root``, as ``LoRARequest`` s."""
    import torch
    from peft import LoraConfig, get_peft_model

    from worker.engine import LoRARequest

    out = []
    for i in range(count):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(copy.deepcopy(model), config).save_pretrained(root / f"a{i}")
        out.append(LoRARequest(f"a{i}", str(root / f"a{i}")))
    return out


def run_cell(llm: Any, prompts: list[list[int]], loras: list[Any], streams: int, max_new: int) -> dict:
    """``streams`` requests at once, request i with ``loras[i % len(loras)]`` (none when empty)."""
    from worker.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    started = time.perf_counter()
    for i in range(streams):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompts[i % len(prompts)], params, lora=lora)
    while engine.has_unfinished():
        for event in engine.step():
            now = time.perf_counter()
            if event.token_id >= 0:
                first.setdefault(event.request_id, now)
                last[event.request_id] = now
                counts[event.request_id] = counts.get(event.request_id, 0) + 1
    elapsed = time.perf_counter() - started
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    tokens = sum(counts.values())
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "tpot_ms": 1000 * sum(tpots) / len(tpots)}


def merge(cells: dict[tuple[int, int], list[dict]], streams_list: list[int], counts: list[int]) -> dict:
    """Each cell's rounds as one: tokens/s over their summed wall time, TPOT their mean (None when none has one)."""
    merged = {}
    for streams in streams_list:
        for count in counts:
            runs = cells[streams, count]
            tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
            tpots = [r["tpot_ms"] for r in runs if r.get("tpot_ms") is not None]
            merged[streams, count] = (tokens / seconds, sum(tpots) / len(tpots) if tpots else None)
    return merged


def base_rows(
    merged: dict, streams_list: list[int], counts: list[int], cells: dict[tuple[int, int], list[dict]] | None = None
) -> list[dict]:
    """One row per cell: tokens/s and TPOT, each against the base model's cell at the same streams; with
    ``cells`` (each cell's rounds) also each round's tokens/s against the base cell of the same round, and
    their median: a round the host's other load slowed moves the summed figure, not the median."""
    rows = []
    for streams in streams_list:
        anchor_count = 0 if (streams, 0) in merged else counts[0]
        anchor = merged[streams, anchor_count]
        for count in counts:
            tok_s, tpot = merged[streams, count]
            row: dict[str, Any] = {
                "streams": streams,
                "adapters": count,
                "tok_s": round(tok_s, 2),
                "tpot_ms": None if tpot is None else round(tpot, 2),
                "throughput_vs_base": _ratio(tok_s, anchor[0]),
                "tpot_vs_base": _ratio(tpot, anchor[1]),
            }
            if cells is not None:
                pairs = zip(cells[streams, count], cells[streams, anchor_count], strict=True)
                per_round = [_ratio(c["tokens"] / c["seconds"], b["tokens"] / b["seconds"]) for c, b in pairs]
                row["throughput_vs_base_rounds"] = per_round
                row["throughput_vs_base_median"] = statistics.median(r for r in per_round if r is not None)
            rows.append(row)
    return rows


def _ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def peer_rows(peer: dict, ours: list[dict], streams_list: list[int], counts: list[int]) -> list[dict]:
    """vLLM's cells (``peer["cells"]``, one entry per cell per round, from bench/peers/vllm_lora.py) as rows:
    its tok/s and TPOT, each against its own base cell at the same streams, and ours over its."""
    cells: dict[tuple[int, int], list[dict]] = {}
    for cell in peer["cells"]:
        cells.setdefault((cell["streams"], cell["adapters"]), []).append(cell)
    our_tok_s = {(r["streams"], r["adapters"]): r["tok_s"] for r in ours}
    rows = base_rows(merge(cells, streams_list, counts), streams_list, counts, cells)
    for row in rows:
        row["ours_vs_vllm"] = _ratio(our_tok_s.get((row["streams"], row["adapters"])), row["tok_s"])
    return rows


def peer_table(rows: list[dict]) -> str:
    lines = [
        "| streams | adapters | vLLM tok/s | x vLLM base | vLLM TPOT ms | x vLLM base | ours / vLLM tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['streams']} | {r['adapters']} | {r['tok_s']:.1f} | {_fmt(r['throughput_vs_base'], '.2f')} "
            f"| {_fmt(r['tpot_ms'], '.1f')} | {_fmt(r['tpot_vs_base'], '.2f')} | {_fmt(r['ours_vs_vllm'], '.2f')} |"
        )
    return "\n".join(lines)


def run_vllm(spec: dict, timeout: float) -> dict:
    """bench/peers/vllm_lora.py on ``spec`` in vLLM's venv: its JSON answer, or ``{"error": why}``."""
    from bench.serve_peer_weights import hf_dir
    from bench.serve_peers import VLLM, PeerConfig, _kv_gib, _missing, peers_dir

    root = peers_dir() / VLLM
    python = root / "venv" / "bin" / "python"
    markers = list(root.glob(".installed-*"))
    if not python.exists() or not markers:
        return {"error": str(_missing(VLLM, python))}
    try:
        weights = hf_dir(spec["model_name"])
    except Exception as exc:  # the weights vLLM loads cannot be written out: recorded, not fatal
        return {"error": f"no HF directory for {spec['model_name']}: {exc}"}
    spec = {**spec, "model": str(weights)}
    kv_tokens = spec["max_num_seqs"] * spec["max_model_len"]
    config = PeerConfig(spec["model_name"], spec["max_num_seqs"], spec["max_num_batched_tokens"], kv_tokens,
                        spec["max_model_len"], spec["max_num_seqs"], dtype=spec["dtype"])  # fmt: skip
    env = {
        **os.environ,
        "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(python.parent.parent),
        # Room for every stream's whole request (vLLM's CPU build takes it in GiB), unless set by the caller.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(_kv_gib(weights, config)),
        "VLLM_TARGET_DEVICE": "cpu",  # its CPU platform, whatever the distribution's version says (install.sh)
        # Every core for its model, as ours has (by default it keeps one for its front end), unless set.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PYTHONPATH", None)  # this project's modules must not shadow anything in vLLM's venv
    log = Path(tempfile.mkstemp(prefix="inflightq-bench-lora-vllm-", suffix=".log")[1])
    with log.open("wb") as err:
        # A session of its own: vLLM's engine core is a child process, stopped with it on a timeout.
        proc = subprocess.Popen(
            [str(python), str(PEER_SCRIPT)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=err, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(json.dumps(spec).encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"error": f"vLLM did not finish in {timeout:.0f} s; log {log}"}
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
            except (ProcessLookupError, PermissionError):
                pass
    return parse_peer_output(out.decode(errors="replace"), proc.returncode, log, markers[0].name)


def parse_peer_output(stdout: str, returncode: int, log: Path, marker: str = "") -> dict:
    """The script's last JSON line (its answer), or an error naming the log when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(answer, dict):
            if "error" in answer:
                answer["log"] = str(log)
            answer.setdefault("installed", marker.removeprefix(".installed-"))
            # vLLM's CPU worker binds its compute threads to some cores and leaves others to its front end.
            text = log.read_text(errors="replace") if log.exists() else ""
            binding = re.findall(r"(core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])", text)
            if binding:
                answer["cpu_binding"] = ", ".join(dict.fromkeys(binding))
            return answer
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    return {"error": f"vLLM exited with {returncode} and no answer; log {log}:\n{tail}", "log": str(log)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the cells")
    parser.add_argument("--streams", default=",".join(map(str, STREAMS)))
    parser.add_argument("--adapters", default=",".join(map(str, ADAPTER_COUNTS)))
    parser.add_argument(
        "--peers", default="", choices=["", "vllm"], help="vllm: the same cells on vLLM's CPU build after ours"
    )
    parser.add_argument("--peer-timeout", type=float, default=3600, help="seconds vLLM's whole run may take")
    parser.add_argument("--out", default="", help="a JSON file for the results; '' to print only")
    args = parser.parse_args(argv)
    header = run_header("bench.lora", argv)
    streams_list = [int(s) for s in args.streams.split(",")]
    counts = [int(c) for c in args.adapters.split(",")]

    from worker.engine import LLM
    from worker.engine.model.model_loader import load_model

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(streams_list), max_loras=max(counts), speculative_tokens=0)
    prompts = chat_prompts(llm.tokenizer, QUESTIONS)
    base, _ = load_model(args.model)  # a float32 copy for peft to shape the adapters on
    peer: dict | None = None
    with tempfile.TemporaryDirectory(prefix="inflightq-bench-lora-") as root:
        adapters = make_adapters(base, max(counts), Path(root), args.rank)
        del base
        run_cell(llm, prompts, adapters, max(streams_list), 4)  # warm-up: every adapter loaded, every path run
        cells: dict[tuple[int, int], list[dict]] = {}
        for _ in range(args.rounds):
            for streams in streams_list:
                for count in counts:
                    cell = run_cell(llm, prompts, adapters[:count], streams, args.max_new_tokens)
                    cells.setdefault((streams, count), []).append(cell)
        if args.peers == "vllm":
            config = llm.engine.config
            dtype = str(next(llm.engine.model.parameters()).dtype).removeprefix("torch.")
            spec = {
                "model_name": args.model,
                "dtype": dtype,
                "rank": args.rank,
                "max_loras": max(counts),
                "max_num_seqs": max(streams_list),
                "max_num_batched_tokens": config.max_num_batched_tokens,
                # The longest prompt and its output (and the warm-up's), rounded up to whole KV blocks.
                "max_model_len": -(-(max(map(len, prompts)) + max(args.max_new_tokens, 4)) // 16) * 16 + 16,
                "enable_prefix_caching": config.enable_prefix_caching,
                "prompts": prompts,
                "adapters": [a.path for a in adapters],
                "streams": streams_list,
                "counts": counts,
                "max_new_tokens": args.max_new_tokens,
                "rounds": args.rounds,
            }
            del llm  # our engine's weights and KV cache are not held while vLLM runs
            gc.collect()
            print(f"vLLM: the same cells ({PEER_SCRIPT.name}, up to {args.peer_timeout:.0f} s) ...", file=sys.stderr)
            peer = run_vllm(spec, args.peer_timeout)
            peer["settings"] = {k: v for k, v in spec.items() if k not in ("prompts", "adapters")}
    print("| streams | adapters | tok/s | x base | x base per round: median (min-max) | TPOT ms | x base |")
    print("|---|---|---|---|---|---|---|")
    rows = base_rows(merge(cells, streams_list, counts), streams_list, counts, cells)
    for r in rows:
        rounds = r["throughput_vs_base_rounds"]
        print(
            f"| {r['streams']} | {r['adapters']} | {r['tok_s']:.1f} | {r['throughput_vs_base']:.2f} "
            f"| {r['throughput_vs_base_median']:.2f} ({min(rounds):.2f}-{max(rounds):.2f}) "
            f"| {r['tpot_ms']:.1f} | {r['tpot_vs_base']:.2f} |"
        )
    results = {"header": header, "rank": args.rank, "max_new_tokens": args.max_new_tokens, "rows": rows}
    if peer is not None:
        if "error" in peer:
            print(f"\nvLLM: no figures ({peer['error'].splitlines()[0] if peer['error'] else '?'})")
        else:
            peer["rows"] = peer_rows(peer, rows, streams_list, counts)
            binding = f"; its worker's {peer['cpu_binding']}" if "cpu_binding" in peer else ""
            version, start = peer.get("version", "?"), peer.get("start_s")
            print(f"\nvLLM {version} (CPU build), same cells, started in {start} s{binding}:")
            print(peer_table(peer["rows"]))
        results["peers"] = {"vllm": peer}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
