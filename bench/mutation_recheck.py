"""Re-runs the surviving mutants of a bench.mutation report against the current tests: each diff is
applied to a scratch copy of the checkout (never this one), the module's test subset is run, and the
mutant is reported killed or surviving.

    python -m bench.mutation_recheck bench/results/mutation-<date>.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.mutation import PYTEST, ROOT, TARGETS


def main() -> None:
    report = json.loads(Path(sys.argv[1]).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "checkout"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "mutants"))
        env = {**os.environ, "PYTHONPATH": str(copy), "INFLIGHTQ_CPU_KERNELS": "0"}
        still = 0
        for outcome in report["outcomes"]:
            module, tests = outcome["module"], TARGETS[outcome["module"]]
            original = (copy / module).read_text()
            for mutant in outcome["survived"]:
                patch = "\n".join(mutant["diff"].splitlines()[1:]) + "\n"  # drop "--- mutation diff ---"
                applied = subprocess.run(["patch", "-p1", "-s", "-r", "-"], input=patch, text=True, cwd=copy)
                if applied.returncode:
                    (copy / module).write_text(original)
                    print(f"not applied (recheck by hand): {module}:{mutant['line']} {mutant['operator']}")
                    continue
                try:
                    run = subprocess.run(f"{PYTEST} {tests}", shell=True, cwd=copy, env=env, capture_output=True)
                finally:
                    (copy / module).write_text(original)
                verdict = "killed" if run.returncode else "SURVIVES"
                still += run.returncode == 0
                print(f"{verdict}: {module}:{mutant['line']} {mutant['operator']}")
        print(f"{still} still survive")


if __name__ == "__main__":
    main()
