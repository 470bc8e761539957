"""The affinity benchmark's outputs: JSON (everything), a markdown report and a plot (bench/affinity.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.results_files import pyplot, save, stem, write_figure

LABELS = {"single": "1 worker", "plain": "plain pull", "affinity": "affinity"}


def _f(x: Any, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def header(report: dict[str, Any]) -> list[str]:
    mt, sp = report["workloads"]["multi_turn"], report["workloads"]["shared_prefix"]
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; "
        f"engine {json.dumps(report['engine'])}; Redis: a {report['redis']} server; steal bound "
        f"{_f(report['steal_after_ms'])} ms  ",
    ]
    if report.get("note"):
        lines.append(f"Machine state: {report['note']}  ")
    lines += [
        f"Multi-turn: {mt['conversations']} conversations x {mt['turns']} turns, first user message "
        f"{mt['first_turn_len']} tokens, later ones {mt['turn_len']}, answers {mt['answer_len']} (greedy, "
        f"ignore_eos); each turn sent when the previous answer arrived, with the whole history "
        f"(prompts {_turns(report)} tokens by turn); {mt['num_kv_blocks']} KV blocks per worker.  ",
        f"Shared prefixes: {sp['prefixes']} system prompts ({sp['shared_prefix_tokens']} tokens of each prompt "
        f"shared), {sp['requests']} requests ({sp['suffix_len']}-token questions, {sp['answer_len']}-token answers) "
        f"from {sp['clients']} closed-loop clients; {sp['num_kv_blocks']} KV blocks per worker "
        f"(every prompt takes {sp['blocks_for_every_prefix']}).",
    ]
    return lines


def _turns(report: dict[str, Any]) -> str:
    runs = [r for r in report["runs"] if r["workload"] == "multi_turn"]
    return " / ".join(str(int(v)) for v in runs[0]["prompt_tokens_by_turn"].values()) if runs else "-"


def runs_table(report: dict[str, Any], workload: str) -> list[str]:
    lines = [
        "| workers | placement | ok / n | prefix hit rate (per worker) | tokens prefilled | TTFT p50 / p99 ms "
        "| follow-up turns' TTFT p50 / p99 ms | out tok/s | Redis commands / request "
        "| Redis CPU ms / request (model slot's) | offers taken / stolen (idle, timed out, worker gone) "
        "| longest idle while queued s (worker idle share) | load avg before / after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if r["workload"] != workload:
            continue
        a, p, idle = r["all"], r["prefix"], r["idle_while_queued"]
        per = ", ".join(_f(x, 2) for x in p["hit_rate_by_worker"])
        follow = r.get("follow_up_ttft_ms")
        lines.append(
            f"| {r['workers']} | {LABELS[r['mode']]}{' (from ' + r['from'] + ')' if r.get('from') else ''} | "
            f"{a['completed']} / {a['requests']} | "
            f"**{_f(p['hit_rate'], 3)}** ({per}) | {_f(p['prefilled_tokens'])} | "
            f"{_f(a['ttft_ms']['p50'])} / {_f(a['ttft_ms']['p99'])} | "
            f"{_f(follow['p50']) if follow else '-'} / {_f(follow['p99']) if follow else '-'} | "
            f"{a['output_throughput']} | {r['redis']['commands_per_request']} | {r['redis']['cpu_ms_per_request']} "
            f"({r['redis']['model_slot_ms_per_request']}) | {_offers(r.get('affinity_counters', {}))} | "
            f"{idle['longest_s']} ({', '.join(_f(x, 2) for x in idle['idle_share_by_worker'])}) | "
            f"{' / '.join(map(str, r.get('load_average', ['-'])))} |"
        )
    return lines


def _offers(c: dict[str, float]) -> str:
    if not c:
        return "-"
    steals = [c.get(f"steals:{k}", 0) for k in ("idle", "timed_out", "worker_gone")]
    return f"{c.get('offers_taken', 0):.0f} / {sum(steals):.0f} ({', '.join(f'{x:.0f}' for x in steals)})"


def target_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for t in report["targets"]:
        head = f"- {t['workload']}, {t['workers']} workers:"
        parts = []
        if h := t.get("hit_rate_vs_single"):
            parts.append(
                f"hit rate {h['affinity']} vs one worker's {h['single']} = **{h['ratio']}** (target >= 0.9: "
                f"{_met(h['met'])}; plain pull {h['plain_ratio']})"
            )
        parts.append(
            f"tokens prefilled vs plain **{t['prefilled_vs_plain']['ratio']}** ({_met(t['prefilled_vs_plain']['met'])})"
        )
        for p in ("p50", "p99"):
            x = t[f"ttft_{p}_vs_plain"]
            parts.append(
                f"TTFT {p} {_f(x['affinity_ms'])} vs {_f(x['plain_ms'])} ms = **{x['ratio']}** ({_met(x['met'])})"
            )
        parts.append(
            f"throughput vs plain **{t['throughput_vs_plain']['ratio']}** ({_met(t['throughput_vs_plain']['met'])})"
        )
        if i := t.get("idle_while_queued"):
            parts.append(
                f"longest idle while work waited {i['longest_s']} s (plain {i['plain_longest_s']} s; bound + one "
                f"sample {i['bound_s']} s: {_met(i['met'])})"
            )
        lines.append(f"{head} " + "; ".join(parts) + ".")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def projection_lines(report: dict[str, Any]) -> list[str]:
    proj = report.get("projection") or {}
    if "workloads" not in proj:
        return [f"Projection skipped: {proj.get('skipped', 'no data')}."]
    c = proj["costs"]
    lines = [
        f"Per-token costs fitted on the {c['from_runs_with_workers']}-worker runs' workers ({c['points']} points, "
        f"largest relative residual {c['max_relative_residual']}): prefill {c['prefill_ms_per_token']} ms, decode "
        f"{c['decode_ms_per_token']} ms per token (at this run's batch sizes). Simulated with the same engine "
        f"sizes and steal bound ({proj['steal_after_s']} s); workloads scaled with the pool "
        "(per workload below).",
        "",
        "| workload | workers | hit rate plain / affinity | prefilled, affinity / plain | TTFT p50 ratio | TTFT p99 "
        "ratio | throughput ratio | steals | Redis commands / request (affinity's own) | requests/s one Redis "
        "core serves (per worker) | summaries MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, w in proj["workloads"].items():
        redis_rows = {r["workers"]: r for r in proj["redis"].get(kind, {}).get("rows", [])}
        for row in w["rows"]:
            n, ratio, rr = row["workers"], row["affinity_vs_plain"], redis_rows.get(row["workers"], {})
            lines.append(
                f"| {kind} (x{n / w['per_worker_base']:g} {'/'.join(w['scaled_with_workers'])}) | {n} | "
                f"{row['plain']['hit_rate']} / {row['affinity']['hit_rate']} | {ratio['prefilled']} | "
                f"{ratio['ttft_p50']} | {ratio['ttft_p99']} | {ratio['throughput']} | {row['affinity']['steals']} | "
                f"{rr.get('commands_per_request', '-')} ({rr.get('affinity_commands_per_request', '-')}) | "
                f"{_f(rr.get('max_requests_per_s_one_redis_core'))} ({rr.get('max_requests_per_s_per_worker', '-')}) | "
                f"{rr.get('summaries_mb', '-')} |"
            )
    lines += ["", "Where it stops scaling:", "", *[f"- {x}" for x in proj.get("limits", [])]]
    return lines


def validation_lines(report: dict[str, Any]) -> list[str]:
    """The simulation at the measured worker counts beside the measurements: how far to trust it."""
    proj = report.get("projection") or {}
    lines = ["| workload | workers | placement | hit rate measured / simulated | out tok/s measured / simulated |"]
    lines.append("|---|---|---|---|---|")
    measured = {(r["workload"], r["mode"], r["workers"]): r for r in report["runs"]}
    for kind, w in proj.get("workloads", {}).items():
        for row in w["rows"]:
            for mode in ("plain", "affinity"):
                m = measured.get((kind, mode, row["workers"]))
                if m:
                    lines.append(
                        f"| {kind} | {row['workers']} | {mode} | {m['prefix']['hit_rate']} / {row[mode]['hit_rate']} | "
                        f"{m['all']['output_throughput']} / {row[mode]['output_throughput']} |"
                    )
    return lines if len(lines) > 2 else []


def markdown(report: dict[str, Any]) -> list[str]:
    body = [f"# Prefix affinity against plain pull, {report['date']}", "", *header(report), ""]
    for workload in ("multi_turn", "shared_prefix"):
        if any(r["workload"] == workload for r in report["runs"]):
            body += [f"## {workload.replace('_', '-')}", "", *runs_table(report, workload), ""]
    body += ["## Targets (affinity against plain pull and one worker, this run)", "", *target_lines(report), ""]
    body += ["## Projection to larger pools (bench/affinity_sim.py)", "", *projection_lines(report), ""]
    if v := validation_lines(report):
        body += ["The simulation at the measured pool sizes:", "", *v, ""]
    body.append(f"![affinity benchmark]({report['stem']}.png)")
    return body


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    runs = report["runs"]
    names = [f"{r['workload'][:5]}\n{r['workers']}w {r['mode']}" for r in runs]
    colors = ["C2" if r["mode"] == "single" else "C0" if r["mode"] == "plain" else "C1" for r in runs]
    axes[0].bar(range(len(runs)), [r["prefix"]["hit_rate"] or 0 for r in runs], color=colors)
    axes[0].set_xticks(range(len(runs)), names, fontsize=6)
    axes[0].set_title("pool-wide prefix hit rate")
    for j, p in enumerate(("p50", "p99")):
        xs = [i + (j - 0.5) * 0.4 for i in range(len(runs))]
        axes[1].bar(xs, [r["all"]["ttft_ms"][p] for r in runs], 0.4, label=p)
    axes[1].set_xticks(range(len(runs)), names, fontsize=6)
    axes[1].set_yscale("log")
    axes[1].set_title("TTFT ms (log)")
    axes[1].legend(fontsize=7)
    show = next((r for r in runs if r["mode"] == "affinity" and r["workload"] == "multi_turn"), runs[-1])
    tl = show["timeline"]
    if tl["t"]:
        for w in range(len(tl["held"][0])):
            axes[2].plot(tl["t"], [h[w] for h in tl["held"]], lw=0.8, label=f"worker {w}: sequences held")
        axes[2].plot(tl["t"], tl["queued"], "k:", lw=0.8, label="queued in Redis")
    axes[2].set_title(f"{show['workload']}, {show['workers']} workers, {show['mode']}")
    axes[2].set_xlabel("s into the run")
    axes[2].legend(fontsize=6)
    proj = report.get("projection", {}).get("workloads", {})
    for kind, w in proj.items():
        ns = [row["workers"] for row in w["rows"]]
        axes[3].plot(
            ns, [row["affinity_vs_plain"]["throughput"] for row in w["rows"]], "o-", label=f"{kind}: throughput"
        )
        axes[3].plot(
            ns, [row["affinity_vs_plain"]["prefilled"] for row in w["rows"]], "x--", label=f"{kind}: prefilled"
        )
    axes[3].axhline(1.0, color="k", lw=0.5)
    axes[3].set_xscale("log", base=2)
    axes[3].set_xlabel("workers (simulated)")
    axes[3].set_title("affinity / plain pull (simulation)")
    if proj:  # a partial run (one worker count) projects nothing
        axes[3].legend(fontsize=6)
    fig.suptitle(f"inflightq bench affinity: {report['model']}, {report['dtype']}, {report['date']}")
    write_figure(fig, path)


def write(report: dict[str, Any], folder: Path, tag: str = "") -> Path:
    where = stem(folder, "affinity", report["date"], tag)
    report["stem"] = where.name
    save(where, report, markdown(report), plot)
    return where


def print_targets(report: dict[str, Any]) -> None:
    for line in target_lines(report):
        print(line, flush=True)
    for line in (report.get("projection") or {}).get("limits", []):
        print(line, flush=True)
