"""The mutation check: cosmic-ray on the scheduling policy, the worker's intake, acceptance and
publisher and the API's streaming code, each module against a focused, fast test subset (no model runs in them).

    python -m bench.mutation [--sample 0.5] [--seed 0] [--out bench/results] [--only worker/intake.py]

cosmic-ray mutates the files IN PLACE, one mutant at a time, and restores them: run it in a checkout
nobody else is testing in. Sampling (``--sample``) keeps the run bounded on a shared machine: a fixed-
seed random share of each module's mutants is run, the rest are marked skipped. The report lists
every surviving mutant with its diff; bench/results/mutation-<date>.md says which are equivalent."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

ROOT = Path(__file__).resolve().parents[1]
PYTEST = f"{sys.executable} -m pytest -x -q -p no:cacheprovider -o addopts= --timeout 120"
WORKER_TESTS = (
    "tests/worker/test_capacity.py tests/worker/test_capacity_edges.py tests/worker/test_publisher.py "
    "tests/worker/test_intake_in_process.py tests/engine/test_policy.py"
)
TARGETS = {
    "worker/engine/core/policy.py": WORKER_TESTS,
    "worker/intake.py": WORKER_TESTS,
    "worker/acceptance.py": WORKER_TESTS,
    "worker/publisher.py": WORKER_TESTS,
    "producer_api/streaming.py": "tests/api/test_sse_and_streaming.py",
    "producer_api/sse.py": "tests/api/test_sse_and_streaming.py",
}


def config(module: str, tests: str) -> str:
    return "\n".join(
        [
            "[cosmic-ray]",
            f'module-path = "{module}"',
            "timeout = 180.0",
            "excluded-modules = []",
            # The CPU kernel is not needed by these tests: skip loading it at session start.
            f'test-command = "env INFLIGHTQ_CPU_KERNELS=0 {PYTEST} {tests}"',
            "[cosmic-ray.distributor]",
            'name = "local"',
            "",
        ]
    )


def sample(db: WorkDB, share: float, seed: int) -> tuple[int, int]:
    items = list(db.work_items)
    keep = {item.job_id for item in random.Random(seed).sample(items, round(len(items) * share))}
    for item in items:
        if item.job_id not in keep:
            db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return len(items), len(keep)


def run(module: str, tests: str, workdir: Path, share: float, seed: int) -> dict:
    cfg = workdir / (module.replace("/", "_") + ".toml")
    session = cfg.with_suffix(".sqlite")
    cfg.write_text(config(module, tests))
    if not session.exists():  # else resume it: exec runs only what is still pending
        subprocess.run(["cosmic-ray", "init", str(cfg), str(session)], cwd=ROOT, check=True)
        with use_db(str(session)) as db:
            sample(db, share, seed)
    subprocess.run(["cosmic-ray", "exec", str(cfg), str(session)], cwd=ROOT, check=True)
    with use_db(str(session)) as db:
        total = db.num_work_items
        sampled = sum(1 for _, r in db.completed_work_items if r.worker_outcome != WorkerOutcome.SKIPPED)
    outcome: dict = {"module": module, "tests": tests, "mutants": total, "run": sampled, "killed": 0}
    outcome |= {"survived": [], "incompetent": 0, "error": 0}
    with use_db(str(session)) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.worker_outcome != WorkerOutcome.NORMAL:
                outcome["error"] += 1  # the mutant could not be run (cosmic-ray's own failure)
            elif result.test_outcome == TestOutcome.KILLED:  # a failing or a timed-out test run
                outcome["killed"] += 1
            elif result.test_outcome == TestOutcome.INCOMPETENT:
                outcome["incompetent"] += 1
            else:
                (m,) = item.mutations
                outcome["survived"].append(
                    {"operator": m.operator_name, "line": m.start_pos[0], "diff": result.diff.strip()}
                )
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample", type=float, default=1.0, help="share of each module's mutants to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", help="a module of TARGETS (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--workdir", type=Path, help="where the sessions live (an earlier run's: resumed)")
    args = parser.parse_args()
    targets = {m: t for m, t in TARGETS.items() if not args.only or m in args.only}
    started = dt.datetime.now(dt.UTC)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"mutation-{started.date().isoformat()}.json"
    doc = {"started": started.isoformat(timespec="seconds"), "argv": sys.argv[1:], "outcomes": []}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mutation-"))  # kept: cr-report can read them
    workdir.mkdir(parents=True, exist_ok=True)
    for module, tests in targets.items():
        doc["outcomes"].append(run(module, tests, workdir, args.sample, args.seed))
        path.write_text(json.dumps(doc, indent=1))  # after each module: a crash keeps what was done
    outcomes = doc["outcomes"]
    for o in outcomes:
        run_ = o["run"]
        print(f"{o['module']}: {o['mutants']} mutants, {run_} run, {o['killed']} killed, "
              f"{o['error']} not run, {o['incompetent']} incompetent, {len(o['survived'])} survived")  # fmt: skip
    print(f"written {path}")


if __name__ == "__main__":
    main()
