"""The fairness benchmark's outputs: JSON (everything), a markdown report and a plot (bench/fairness.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench import results_files
from bench.serve_report import _clean, _ms

# The tenants' names and the targets, which the benchmark and its report share.
A, B, HEAVY, LIGHT = "A", "B", "weight3", "weight1"
TARGET_TTFT_RATIO, TARGET_THROUGHPUT_RATIO, TARGET_WEIGHT_ERROR = 2.0, 0.95, 0.10


def _setup_label(name: str, row: dict[str, Any]) -> str:
    where = "Redis Cluster" if row["cluster"] else "Redis"
    return f"{row['workers']} worker{'s' if row['workers'] > 1 else ''}, {where} (`{name}`)"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def summary_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| setup | saturation req/s | B TTFT p99 idle ms | B p99 under flood, fair: ms (x idle) "
        "| FCFS: ms (x idle) | flood out tok/s fair / FCFS | weights 3:1 tokens served (error) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["setups"].items():
        t = row["targets"]
        fair = f"{t['b_fair_p99_ms']:,.0f} (**{t['b_fair_vs_idle']:.2f}x**, {_met(t['ttft_met'])})"
        fcfs = f"{t['b_fcfs_p99_ms']:,.0f} ({t['b_fcfs_vs_idle']:.1f}x)" if "b_fcfs_p99_ms" in t else "-"
        tput = (
            f"{t['throughput_fair_tok_s']} / {t['throughput_fcfs_tok_s']} = **{t['throughput_ratio']:.1%}** "
            f"({_met(t['throughput_met'])}){_by_round(row)}"
            if "throughput_ratio" in t
            else "-"
        )
        weights = (
            f"**{t['weights_ratio']:.2f}** ({t['weights_error']:.1%}, {_met(t['weights_met'])})"
            if "weights_ratio" in t
            else "-"
        )
        lines.append(
            f"| {_setup_label(name, row)} | {row['saturation']['requests_per_s']} | {t['b_idle_p99_ms']:,.0f} "
            f"| {fair} | {fcfs} | {tput} | {weights} |"
        )
    return lines


def _by_round(row: dict[str, Any]) -> str:
    """Each round's fair / FCFS output tok/s, where the floods took turns more than once."""
    fair, fcfs = row["fair"].get("rounds_output_tok_s", []), row["fcfs"].get("rounds_output_tok_s", [])
    if len(fair) < 2:
        return ""
    return "; by round " + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(fair, fcfs, strict=False))


def detail_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| setup | run | tenant | ok / sent | TTFT p50 / p90 / p99 ms | TPOT p50 ms | cancelled at the end "
        "| preemptions in the run: fair_share / urgency / kv_blocks; steps stopped (share of step time); "
        "tokens recomputed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["setups"].items():
        idle = row["idle"]
        lines.append(
            f"| `{name}` | idle, one at a time | B | {idle['completed']} / {idle['requests']} "
            f"| {_ms(idle['ttft_ms'], 'p50')} / {_ms(idle['ttft_ms'], 'p90')} / {_ms(idle['ttft_ms'], 'p99')} "
            f"| {_ms(idle['tpot_ms'], 'p50')} | - | - |"
        )
        for run in ("fair", "fcfs"):
            if run not in row:
                continue
            for tenant in ("A", "B"):
                m = row[run][tenant]
                lines.append(
                    f"| `{name}` | flood, {run} | {tenant} | {m['completed']} / {m['sent']} "
                    f"| {_ms(m['ttft_ms'], 'p50')} / {_ms(m['ttft_ms'], 'p90')} / {_ms(m['ttft_ms'], 'p99')} "
                    f"| {_ms(m['tpot_ms'], 'p50')} | {row[run]['cancelled'] if tenant == 'A' else '-'} "
                    f"| {_preemptions(row[run]) if tenant == 'A' else '-'} |"
                )
        if w := row.get("weights"):
            for tenant in (HEAVY, LIGHT):
                x = w["tenants"][tenant]
                lines.append(
                    f"| `{name}` | weights, {w['tenants'][tenant]['weight']:g} | {tenant} | {x['completed']} / "
                    f"{x['sent']} | tokens served {x['tokens']:,} (output {x['output_tokens']:,}) | - "
                    f"| {w['cancelled']} (both) | {_preemptions(w) if tenant == HEAVY else '-'} |"
                )
    return lines


def _preemptions(run: dict[str, Any]) -> str:
    p = run.get("preemptions") or {}
    out = " / ".join(f"{p.get(reason, 0):.0f}" for reason in ("fair_share", "urgency", "kv_blocks"))
    if e := run.get("engine"):
        stopped = e.get("engine_interrupted_seconds", 0.0) / max(e.get("engine_step_seconds", 0.0), 1e-9)
        out += f"; {100 * stopped:.1f}%; {e.get('engine_recomputed_tokens', 0):,.0f}"
    return out


def header(report: dict[str, Any]) -> list[str]:
    d, ph = report["dataset"], report["phases"]
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; "
        f"engine {report['engine']}  ",
    ]
    if report.get("note"):
        lines.append(f"Machine state: {report['note']}  ")
    lines.append(
        f"Seeded synthetic chat requests (seed {d['seed']}), prompts {d['input_len'][0]}-{d['input_len'][1]} tokens, "
        f"outputs {d['output_len'][0]}-{d['output_len'][1]}, greedy, ignore_eos, all streamed through "
        f"/v1/chat/completions at one priority. Flood: tenant A keeps {ph['flood_factor']}x the pool's slots in "
        f"flight for {ph['flood_s']:.0f} s; tenant B sends Poisson arrivals at {ph['light_share']}x the saturation "
        f"measured in the same run, from {ph['warmup_s']:.0f} s to {ph['flood_s'] - ph['tail_s']:.0f} s; output "
        f"throughput counts every token that came from {ph['warmup_s']:.0f} s to {ph['flood_s']:.0f} s. "
        + (
            f"The fair and FCFS floods took turns {ph['rounds']} times, each on a fresh stack with B's arrivals of "
            "its own; B's TTFTs and the throughput are pooled over the rounds. "
            if ph.get("rounds", 1) > 1
            else ""
        )
        + f"FCFS anchor: "
        f"{report['fcfs_anchor']}. Weights: tenants of weight 3 and 1 each keep {ph['weights_factor']}x the slots "
        f"in flight for {ph['weights_s']:.0f} s; tokens served = output tokens that came from "
        f"{ph.get('weights_settle_s', 0):.0f} s to {ph['weights_s']:.0f} s + the prompts of the requests whose first "
        "token came then. Load average (1 min, others' processes included) before / after each setup: "
        + "; ".join(f"`{n}` {' / '.join(map(str, r.get('load_average', [])))}" for n, r in report["setups"].items())
        + "."
    )
    return lines


def target_lines(report: dict[str, Any]) -> list[str]:
    return [
        f"Targets: B's p99 TTFT under the flood <= {TARGET_TTFT_RATIO}x its idle p99; flood throughput >= "
        f"{TARGET_THROUGHPUT_RATIO:.0%} of FCFS; tokens served within {TARGET_WEIGHT_ERROR:.0%} of 3:1."
    ]


def plot(report: dict[str, Any], path: Path) -> None:
    plt = results_files.pyplot()
    if plt is None:
        return
    setups = report["setups"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    names = list(setups)
    width = 0.25
    for j, (label, key) in enumerate((("idle", "b_idle_p99_ms"), ("fair", "b_fair_p99_ms"), ("FCFS", "b_fcfs_p99_ms"))):
        xs = [i + (j - 1) * width for i in range(len(names))]
        axes[0].bar(xs, [setups[n]["targets"].get(key) or math.nan for n in names], width, label=label)
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set_yscale("log")
    axes[0].set_title("tenant B's TTFT p99 (ms, log): idle, under A's flood")
    axes[0].legend(fontsize=7)
    for name in names:  # B's TTFT at its send time under the flood, fair (o) and FCFS (x)
        for run, marker in (("fair", "o"), ("fcfs", "x")):
            if run in setups[name]:
                r = setups[name][run]
                pts = [(s, t) for s, t in zip(r["b_sent_s"], r["b_ttft_ms"], strict=True) if t is not None]
                axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker, label=f"{name} {run}", alpha=0.7)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("B's send time, s into the flood")
    axes[1].set_title("B's TTFT under the flood (ms, log)")
    axes[1].legend(fontsize=6)
    for i, name in enumerate(names):
        w = setups[name].get("weights")
        if not w:
            continue
        t = w["series"]["t"]
        axes[2].plot(t, w["series"][HEAVY], f"C{i}-", label=f"{name}: weight 3")
        axes[2].plot(t, w["series"][LIGHT], f"C{i}:", label=f"{name}: weight 1")
    axes[2].set_xlabel("s into the weights run")
    axes[2].set_title("output tokens served, cumulative")
    axes[2].legend(fontsize=6)
    fig.suptitle(f"inflightq bench fairness: {report['model']}, {report['dtype']}, {report['date']}")
    results_files.write_figure(fig, path)


def markdown(report: dict[str, Any], stem: Path) -> list[str]:
    return [
        f"# Fair share benchmark, {report['date']}",
        "",
        *header(report),
        "",
        *target_lines(report),
        "",
        *summary_table(report),
        "",
        *detail_table(report),
        "",
        f"![fairness benchmark]({stem.name}.png)",
    ]


def write(report: dict[str, Any], folder: Path, tag: str = "") -> Path:
    stem = results_files.stem(folder, "fairness", report["date"], tag)
    results_files.save(stem, _clean(report), markdown(report, stem), plot)
    return stem
