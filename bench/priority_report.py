"""The priority benchmark's outputs: JSON (everything), a markdown report and a plot (bench/priority.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.serve_report import _clean, _ms

LABELS = {
    "idle": "idle stack, one at a time (priority 0)",
    "priority": "mixed load, priorities (urgent 0, background 2-3)",
    "fcfs": "mixed load, FCFS (every request at priority 3)",
    "transformers_cb": "transformers CB, FCFS, short variant",
    "calibration": "calibration: background, all at once",
}


def _goodput(m: dict[str, Any]) -> str:
    g = m.get("goodput")
    return "-" if not g else f"{g['share']:.0%} ({g['good']}/{g['requests']})"


def latency_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| run | class | ok / n | TTFT p50 / p90 / p99 ms | TPOT p50 / p99 ms | SLO goodput | out tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in report["runs"].items():
        if name == "calibration":
            continue
        rows = list(run.get("classes", {}).items())
        if name in ("fcfs", "transformers_cb"):
            rows.append(("all (FCFS: what an urgent request meets)", run["all"]))
        for klass, m in rows:
            ttft, tpot = m["ttft_ms"], m["tpot_ms"]
            lines.append(
                f"| {LABELS[name]} | {klass} | {m['completed']} / {m['requests']} "
                f"| {_ms(ttft, 'p50')} / {_ms(ttft, 'p90')} / **{_ms(ttft, 'p99')}** "
                f"| {_ms(tpot, 'p50')} / {_ms(tpot, 'p99')} | {_goodput(m)} | {m['output_throughput']} |"
            )
    return lines


def worker_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| run | duration s | out tok/s (all) | engine steps | stopped for urgent arrivals (ms spent) "
        "| preemptions: urgency / kv_blocks | per minute "
        "| recomputed tokens | pool full (share of 1 s samples) | mean sequences held / of them running "
        "| queued: mean / max | load avg before / after "
        "| mean ms in queue / to first token by priority (worker's histograms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("calibration", "priority", "fcfs"):
        run = report["runs"].get(name)
        if not run:
            continue
        w, p, m = run["worker"], run["pool"], run["all"]
        per_min = w.get("preemptions_per_min", round(w["engine_preemptions"] / (m["duration_s"] / 60), 2))
        lines.append(
            f"| {LABELS[name]} | {m['duration_s']:.0f} | {m['output_throughput']} | {w['engine_steps']:.0f} "
            f"| {w.get('engine_interrupted_steps', 0):.0f} ({1000 * w.get('engine_interrupted_seconds', 0):.0f}) "
            f"| {w['engine_preemptions_by_reason:urgency']:.0f} / {w['engine_preemptions_by_reason:kv_blocks']:.0f} "
            f"| {per_min} | {w['engine_recomputed_tokens']:.0f} | {p['full_share']} "
            f"| {p.get('mean_held', '-')} / {p['mean_running']} "
            f"| {p['mean_queued']} / {p['max_queued']} | {' / '.join(map(str, run.get('load_average', ['-'])))} "
            f"| {_split_by_priority(w)} |"
        )
    return lines


def _split_by_priority(worker: dict[str, Any]) -> str:
    levels = sorted({k.split(":")[1] for k in worker if k.startswith("mean_time_in_queue_ms:")})
    return (
        ", ".join(
            f"{level}: {worker[f'mean_time_in_queue_ms:{level}']:.0f} / "
            f"{worker.get(f'mean_time_to_first_token_ms:{level}', math.nan):.0f}"
            for level in levels
        )
        or "-"
    )


def target_lines(report: dict[str, Any]) -> list[str]:
    t, lines = report.get("targets", {}), []
    if x := t.get("urgent_p99_ttft_vs_idle_p99"):
        lines.append(
            f"- Urgent p99 TTFT under load vs idle p99 (target <= {x['target']}x): {x['loaded_ms']:.0f} / "
            f"{x['idle_ms']:.0f} ms = **{x['ratio']:.2f}x ({'met' if x['met'] else 'NOT met'})**, with the pool full "
            f"in {x['pool_full_share']:.0%} of the run's 1 s samples."
        )
    if x := t.get("background_throughput_vs_all_background"):
        lines.append(
            f"- Background throughput vs the all-background (FCFS) run (target >= {x['target']:.0%}): "
            f"{x['background_tok_s']} / {x['all_background_tok_s']} tok/s = **{x['ratio']:.1%} "
            f"({'met' if x['met'] else 'NOT met'})**; all output, priorities vs FCFS: "
            f"{x['total_tok_s_priority_vs_fcfs']:.1%}."
        )
    contended = [LABELS[n] for n, r in report["runs"].items() if r.get("contended_by")]
    if contended:
        lines.append(f"- Another benchmark ran alongside: {', '.join(contended)}.")
    return lines


def header(report: dict[str, Any]) -> list[str]:
    d, w, s = report["dataset"], report.get("workload", {}), report.get("saturation", {})
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; "
        f"engine {json.dumps(report['engine'])}; every request streamed through `{report['endpoint']}`  ",
    ]
    if report.get("note"):
        lines.append(f"Machine state: {report['note']}  ")
    if w:
        sat = (
            f"{s['requests_per_s']} req/s given"
            if s.get("given")
            else f"{s['output_tok_s']} tok/s = {s['requests_per_s']} req/s of this workload, measured in this run"
        )
        lines.append(
            f"Workload: {w['requests']} seeded synthetic chat requests (seed {d['seed']}), prompts "
            f"{d['input_len'][0]}-{d['input_len'][1]} tokens, outputs {d['output_len'][0]}-{d['output_len'][1]}, "
            f"greedy, ignore_eos. {w['burst']} background requests at once (the pool starts full), then Poisson "
            f"arrivals at {w['offered_rate_req_s']} req/s = {w['overload']}x the pool's saturation ({sat}). "
            f"{w['urgent']} urgent (priority 0, {w['urgent'] / w['requests']:.0%}), {w['background']} background "
            f"(priority 2 or 3). SLO: {report['slo']['definition']}: TTFT <= {report['slo']['ttft_ms']} ms, "
            f"TPOT <= {report['slo']['tpot_ms']} ms."
        )
    if tf := report["runs"].get("transformers_cb"):
        lines.append(f"transformers CB: {tf['variant']}, {tf['dtype']}.")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    # 1: urgent TTFT percentiles per system (FCFS systems: every request).
    bars = []
    for name in ("idle", "priority", "fcfs", "transformers_cb"):
        run = runs.get(name)
        if run:
            m = run["classes"].get("urgent") or run["all"]
            bars.append((name, m["ttft_ms"]))
    width = 0.25
    for j, p in enumerate(("p50", "p90", "p99")):
        xs = [i + (j - 1) * width for i in range(len(bars))]
        axes[0].bar(xs, [b[1][p] or math.nan for b in bars], width, label=p)
    if "slo" in report:
        axes[0].axhline(report["slo"]["ttft_ms"], color="k", linestyle="--", label="2x idle p99")
    axes[0].set_xticks(range(len(bars)), [b[0] for b in bars])
    axes[0].set_yscale("log")
    axes[0].set_title("urgent TTFT (ms, log)")
    axes[0].legend(fontsize=7)
    # 2: throughput per run and class.
    names = [n for n in ("calibration", "priority", "fcfs", "transformers_cb") if n in runs]
    axes[1].bar(names, [runs[n]["all"]["output_throughput"] for n in names], color="lightgray", label="all requests")
    bg = [runs[n].get("classes", {}).get("background", {}).get("output_throughput", math.nan) for n in names]
    axes[1].bar(names, bg, width=0.4, label="background class")
    axes[1].set_title("output tokens/s")
    axes[1].legend(fontsize=7)
    # 3: the pool during the priority run, and each urgent request's TTFT at its send time.
    ax = axes[2]
    for name, style in (("priority", "-"), ("fcfs", ":")):
        run = runs.get(name)
        if not run:
            continue
        series = run["pool"]["series"]
        ax.plot(series["t"], series["running"], "C0" + style, label=f"{name}: running sequences")
        ax.plot(series["t"], series["queued"], "C1" + style, label=f"{name}: queued in Redis")
    ax.set_xlabel("s into the run")
    ax2 = ax.twinx()
    for name, marker in (("priority", "o"), ("fcfs", "x")):
        if name in runs:
            sent, ttft = runs[name]["urgent_sent_s"], runs[name]["urgent_ttft_ms"]
            ax2.plot(sent, ttft, "k" + marker, label=f"{name}: urgent TTFT")
    ax2.set_yscale("log")
    ax2.set_ylabel("urgent TTFT (ms, log)")
    ax.legend(fontsize=6, loc="upper left")
    ax2.legend(fontsize=6, loc="upper right")
    ax.set_title("pool state and urgent TTFT")
    fig.suptitle(f"inflightq bench priority: {report['model']}, {report['dtype']}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict[str, Any], folder: Path, tag: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"priority-{report['date'][:10]}{'-' + tag if tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(_clean(report), indent=2) + "\n")
    plot(report, stem.with_suffix(".png"))
    body = [
        f"# Priority benchmark, {report['date']}",
        "",
        *header(report),
        "",
        *latency_table(report),
        "",
        *worker_table(report),
        "",
        *target_lines(report),
        "",
        f"![priority benchmark]({stem.name}.png)",
    ]
    stem.with_suffix(".md").write_text("\n".join(body) + "\n")
    print(f"wrote {stem}.json, .md, .png")
    return stem
