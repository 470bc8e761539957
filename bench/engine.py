"""Engine throughput: our LLM.generate vs transformers' own continuous batching, same process.

Workload: 32 chat prompts on the default model, 32..256 new tokens each (seeded), greedy,
ignore_eos, all submitted at once. Reports tok/s for both, the ratio, and the share of the
engine's step time spent in the model forward, for each dtype asked.

    python -m bench.engine            # or: inflightq bench engine
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_files import pyplot, save

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the sea.",
    "How do vaccines work?",
    "Give me three tips for a job interview.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
    "Suggest a name for a bakery.",
    "What are prime numbers?",
    "Describe the water cycle.",
    "How do I make a cup of tea?",
    "What causes earthquakes?",
    "Write a short poem about autumn leaves.",
    "What is machine learning?",
    "List some healthy breakfast ideas.",
    "Why do cats purr?",
    "How do airplanes fly?",
    "What is the Pythagorean theorem?",
    "Give me a fun fact about octopuses.",
    "How can I improve my sleep?",
    "What is inflation in economics?",
    "Explain what a black hole is.",
    "Write a limerick about a programmer.",
    "What are the planets of the solar system?",
    "How does recycling help the environment?",
    "What is the tallest mountain on Earth?",
    "Describe a good way to learn a new language.",
    "What is the role of the heart in the body?",
    "Tell me a story about a brave mouse.",
    "Why do we have seasons?",
]


KV_TOKENS = 16384  # KV cache room for both engines: the workload needs about 32 x 300 tokens
MAX_BATCH_TOKENS = 1024


def workload(tokenizer: Any, num_prompts: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts, [rng.randint(32, 256) for _ in prompts]


class Ours:
    def __init__(
        self, model_name: str, dtype: torch.dtype, device: str = "cpu", compile: bool = False, cuda_graphs: str = "auto"
    ) -> None:
        from worker.engine.model.model_loader import load_model
        from worker.models import locate

        # Names resolve explicitly: scripts/device-check.sh runs this from a checkout that is not
        # installed, where the engine finds no default resolver.
        self.model, self.tokenizer = load_model(model_name, dtype, device, resolve=locate)
        self.compile = compile
        self.cuda_graphs: bool | str = {"on": True, "off": False}.get(cuda_graphs, cuda_graphs)

    def run(self, prompts: list[list[int]], lengths: list[int]) -> dict:
        from worker.engine import LLM, SamplingParams

        # A fresh engine per run, so no run finds the previous one's prompts in its prefix cache.
        llm = LLM(
            self.model,
            tokenizer=self.tokenizer,
            max_num_seqs=len(prompts),
            max_num_batched_tokens=MAX_BATCH_TOKENS,
            num_kv_blocks=KV_TOKENS // 16,
            block_size=16,
            compile=self.compile,
            cuda_graphs=self.cuda_graphs,
        )
        llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up: first-call costs
        stats = llm.engine.stats
        before = (stats.forward_time_s, stats.step_time_s, stats.steps)
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
        forward, step_time = stats.forward_time_s - before[0], stats.step_time_s - before[1]
        return {
            "tokens": tokens,
            "seconds": round(wall, 3),
            "tok_per_s": round(tokens / wall, 1),
            "steps": stats.steps - before[2],
            "forward_share_of_step": round(forward / step_time, 3),
            "step_share_of_wall": round(step_time / wall, 3),
            "sample_text": outs[0].text[:120],
            "warmup_s": round(stats.warmup_s, 2),  # compile or CUDA-graph capture, before the timed run
        }


class TransformersCB:
    def __init__(self, model_name: str, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from worker.engine.model.model_loader import load_model
        from worker.models import locate

        self.model, _ = load_model(model_name, dtype, device, resolve=locate)
        # Left to itself it takes 90% of free RAM for its cache; give it the same room and token budget as ours.
        self.cb_config = ContinuousBatchingConfig(num_blocks=KV_TOKENS // 256, max_batch_tokens=MAX_BATCH_TOKENS)

    def _generate(self, prompts: list[list[int]], lengths: list[int]) -> int:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0)
        tokens = 0
        with self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=self.cb_config, block=True, timeout=30
        ) as manager:
            for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
            done = 0
            while done < len(prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done += 1
                    tokens += len(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died")
        return tokens

    def run(self, prompts: list[list[int]], lengths: list[int]) -> dict:
        self._generate(prompts[:2], [4, 4])  # warm-up
        started = time.perf_counter()
        tokens = self._generate(prompts, lengths)
        wall = time.perf_counter() - started
        return {"tokens": tokens, "seconds": round(wall, 3), "tok_per_s": round(tokens / wall, 1)}


def best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["tok_per_s"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both engines (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the two engines this often; best of each")
    parser.add_argument("--skip-transformers", action="store_true", help="run only our engine (for profiling)")
    parser.add_argument("--out", default="bench/results", help="folder for engine-<date>.json/.md; '' to skip")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (results then named engine-<date>-cuda)")
    parser.add_argument("--compile", action="store_true", help="our engine with its compiled forward")
    parser.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="our engine's decode steps from CUDA graphs (auto: on with --device cuda)",
    )
    parser.add_argument(
        "--tag", default="", help="appended to the results' name, so a second run that day keeps the first"
    )
    args = parser.parse_args(argv)
    from worker.engine.model.model_loader import load_tokenizer
    from worker.models import locate

    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(args.model, resolve=locate)
    prompts, lengths = workload(tokenizer, args.num_prompts, args.seed)
    results: dict[str, Any] = {
        "command": "python -m bench.engine "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}",
        "device": args.device,
        "tag": args.tag,
        "workload": {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "new_tokens": sum(lengths)},
        "runs": {},
    }
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        row: dict[str, Any] = {"load_average_before": os.getloadavg()[0]}
        engines: dict[str, Any] = {"ours": Ours(args.model, dtype, args.device, args.compile, args.cuda_graphs)}
        if not args.skip_transformers:
            engines["transformers_cb"] = TransformersCB(args.model, dtype, args.device)
        # Alternating runs, best of each: a noisy shared machine slows whichever runs in a bad moment.
        tries: dict[str, list[dict]] = {key: [] for key in engines}
        for _ in range(args.repeats):
            for key, engine in engines.items():
                tries[key].append(engine.run(prompts, lengths))
                print(f"[{name}] {key}: {tries[key][-1]['tok_per_s']} tok/s", flush=True)
        for key in engines:
            row[key] = {**best(tries[key]), "all_tok_per_s": [t["tok_per_s"] for t in tries[key]]}
        row["load_average_after"] = os.getloadavg()[0]
        if "transformers_cb" in row:
            row["ratio"] = round(row["ours"]["tok_per_s"] / row["transformers_cb"]["tok_per_s"], 2)
            # Each try of ours against the CB try right after it: the spread says how noisy the box was.
            pairs = zip(tries["ours"], tries["transformers_cb"], strict=True)
            row["pair_ratios"] = [round(a["tok_per_s"] / b["tok_per_s"], 2) for a, b in pairs]
            row["median_pair_ratio"] = round(statistics.median(row["pair_ratios"]), 3)
        print(
            f"[{name}] best: ours {row['ours']['tok_per_s']} tok/s (forward {row['ours']['forward_share_of_step']:.0%}"
            f" of step), transformers CB {row.get('transformers_cb', {}).get('tok_per_s')}, ratio {row.get('ratio')}"
        )
        results["runs"][name] = row
        del engines
    if args.out:
        write(results, Path(args.out))
    return results


def write(results: dict, folder: Path) -> None:
    device = results.get("device", "cpu")
    tag = results.get("tag", "")
    stem = folder / f"engine-{results['date'][:10]}{'' if device == 'cpu' else '-' + device}{'-' + tag if tag else ''}"
    lines = [
        f"# Engine benchmark, {results['date']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}  ",
        f"Workload: {json.dumps(results['workload'])}, greedy, ignore_eos, all submitted at once",
        "",
        "| dtype | ours tok/s | transformers CB tok/s | ratio (best of each) | ratio per pair (median) "
        "| forward share of step | all tries (ours; CB) | load avg before/after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["runs"].items():
        cb = row.get("transformers_cb", {}).get("tok_per_s", "-")
        share = row["ours"]["forward_share_of_step"]
        load = f"{row['load_average_before']:.1f} / {row.get('load_average_after', float('nan')):.1f}"
        tries = f"{row['ours']['all_tok_per_s']}; {row.get('transformers_cb', {}).get('all_tok_per_s', '-')}"
        ratio = row.get("ratio", "-")
        pairs = f"{row.get('pair_ratios', '-')} ({row.get('median_pair_ratio', '-')})"
        lines.append(
            f"| {name} | {row['ours']['tok_per_s']} | {cb} | {ratio} | {pairs} | {share:.0%} | {tries} | {load} |"
        )
    save(stem, results, lines, plot)


def plot(results: dict, path: Path) -> None:
    if (plt := pyplot()) is None:
        return
    names = list(results["runs"])
    ours = [results["runs"][n]["ours"]["tok_per_s"] for n in names]
    theirs = [results["runs"][n].get("transformers_cb", {}).get("tok_per_s", 0) for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="inflightq LLM.generate")
    ax.bar([x + 0.2 for x in xs], theirs, width=0.4, label="transformers continuous batching")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"32 chat prompts, {results['workload']['new_tokens']} new tokens, same process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
