"""Engine checks on a CUDA device: exactness against transformers' ``generate`` (decode steps from
CUDA graphs, and without them), then speed against transformers' continuous batching on the same
GPU, with and without the graphs. Run by ``scripts/device-check.sh``.

    python -m bench.device_check --out bench/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def generate_reference(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.eos_token_id,
    )
    return out[0, len(prompt) :].tolist()


def exactness(device: str, dtype: torch.dtype, cuda_graphs: bool) -> dict:
    """Ragged prompts, chunked prefill and prefix hits on a tiny random Llama: greedy tokens equal generate's
    (decode steps of 25 sequences down to one, so every graph bucket up to 32 replays)."""
    from worker.engine import LLM, SamplingParams
    from worker.engine.model.model_loader import load_model
    from worker.engine.model.tiny_model import make_tiny_llama

    folder = make_tiny_llama(Path(tempfile.gettempdir()) / "inflightq-device-check-tiny")
    ours, tokenizer = load_model(str(folder), dtype, device)
    ref, _ = load_model(str(folder), dtype, device)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40_000) for _ in range(rng.randrange(1, 90))] for _ in range(24)]
    prompts += [prompts[0] + [7, 8, 9]]  # a prefix-cache hit
    failures = []
    for budget in (4096, 32):  # all prefills in one step; then chunked prefill
        llm = LLM(
            ours,
            tokenizer=tokenizer,
            max_num_batched_tokens=budget,
            num_kv_blocks=1024,
            block_size=16,
            max_num_seqs=32,
            cuda_graphs=cuda_graphs,
        )
        graphs = llm.engine.runner.decode_graphs
        if cuda_graphs and (graphs is None or not graphs.capture):
            raise AssertionError("cuda_graphs=True built no captured decode graphs")
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=12))
        for prompt, out in zip(prompts, outs, strict=True):
            if out.token_ids != generate_reference(ref, prompt, 12):
                failures.append({"budget": budget, "prompt_len": len(prompt)})
    return {
        "dtype": str(dtype),
        "cuda_graphs": cuda_graphs,
        "prompts": len(prompts),
        "failures": failures,
        "ok": not failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "exactness": [
            exactness("cuda", dtype, graphs) for dtype in (torch.float64, torch.float32) for graphs in (True, False)
        ],
    }
    print(json.dumps(results["exactness"]), flush=True)
    if not args.skip_speed:
        from bench import engine

        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        common = ["--device", "cuda", "--dtypes", dtype, "--repeats", "3", "--out", args.out]
        results["speed"] = {
            graphs: engine.main([*common, "--cuda-graphs", graphs, "--tag", f"graphs-{graphs}"])
            for graphs in ("on", "off")
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"device-check-{results['date'][:10]}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if all(e["ok"] for e in results["exactness"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
