"""Workers sharing a host, each with its KV cache driven full, stay inside the memory they were
budgeted and nothing is OOM-killed.

Real worker processes on a private Redis with an append-only file, started as `inflightq up
--workers N` starts them (``workers_per_host`` = N, sizing their caches from memory: no
``--num-kv-blocks``). Each is fed more long requests than its cache holds (prompts that claim all
its blocks, outputs that overflow them), so every cache is full and sequences are preempted for
KV blocks. Measured per worker: RSS when ready (weights, runtime, an untouched cache: it is
committed lazily), peak RSS (the kernel's VmHWM) at full use, and the cache's size as it reports
it at start. Asserted: the caches together fit the budget (kv_cache_memory_fraction of the memory
free at start); no worker's peak exceeds its RSS at ready plus its cache plus a bounded allowance
for activations; the peaks together fit the host; every request completes; every worker is alive
at the end and exits 0 on SIGTERM; the kernel's OOM-kill counter did not move.

Light (CI): 2 workers of a tiny model whose KV cache is large next to its compute (head_dim 64 on
a 64-wide model, float64: 1 MiB per block), a deliberately small budget (~96 MiB each).
Heavy (``INFLIGHTQ_FAULTS_HEAVY=1``): 3 workers of the default model (smollm2-135m-instruct) at
default settings; ``INFLIGHTQ_FAULTS_KV_FRACTION`` overrides the fraction where filling the
default budget's caches (~1.8 GB each on a 24 GB host) would take too long on a small box."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from inflightq_cli.redis_server import free_port
from inflightq_cli.supervisor import worker_env as up_worker_env
from shared.client import QueueClient
from shared.request_lifecycle import RequestStatus
from shared.schemas import SamplingSpec
from shared.settings import Settings
from tests.worker.conftest import WorkerProcess
from tests.worker.test_redis_outage import persistent_redis
from worker.engine.core.memory import available_memory_bytes

MiB = 1 << 20
# What a worker may hold beyond its RSS at ready and its full cache: one step's activations
# (a 512-token prefill chunk's attention scores and MLP, the sampled rows' logits), the allocator
# keeping freed arenas, request state. Measured: 7-40 MiB (light); 210-240 MiB (heavy, default
# fraction: 512-token chunks against 2,032-token contexts), see docs/reliability.md.
ACTIVATION_ALLOWANCE = 256 * MiB
MAX_PROMPT = 2048  # tokens: well inside any model's context, quick to prefill on a CPU
KV_LINE = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens, ([\d.]+) MiB")


def status_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status figure (VmRSS, VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (any process); None where it is not exposed."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def dmesg_kills(pids: list[int]) -> list[str] | None:
    """Kernel log lines naming one of ``pids`` as OOM-killed; None where dmesg is not readable."""
    try:
        run = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if run.returncode != 0:
        return None
    return [line for line in run.stdout.splitlines() if any(f"Killed process {pid} " in line for pid in pids)]


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemTotal")


def scrape(port: int) -> tuple[int, int]:
    """(free KV blocks, preemptions for KV blocks) from a worker's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    free = preempted = 0
    for line in text.splitlines():
        if line.startswith("inflightq_worker_free_kv_blocks{"):
            free = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("inflightq_worker_engine_preemptions_by_reason_total{") and 'reason="kv_blocks"' in line:
            preempted = int(float(line.rsplit(" ", 1)[1]))
    return free, preempted


@dataclass
class Watched:
    worker: WorkerProcess
    port: int
    blocks: int = 0
    kv_bytes: int = 0
    ready_rss: int = 0  # bytes
    peak_rss: int = 0  # bytes (VmHWM)
    min_free: int = 1 << 30
    kv_preemptions: int = 0

    @property
    def pid(self) -> int:
        assert self.worker.process is not None
        return self.worker.process.pid


def fill_and_measure(
    *,
    model: str,
    extra_args: list[str],
    workers: int,
    fraction: float | None,
    worker_env: dict[str, str],
    settings: Settings,
    tmp_path: Path,
    ready_timeout: float,
    fill_timeout: float,
) -> str:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    kills_before = oom_kills()
    # Prompts enter at the full step budget: with the default cap on prefill beside decodes (128
    # tokens a step), 2,048-token prompts enter one per 16 steps and finish before many are in the
    # cache at once, so the caches would take hours to fill. What is under test is the memory a
    # full cache takes, not how fast it fills.
    env = {**worker_env, "INFLIGHTQ_REDIS_URL": url, "INFLIGHTQ_MAX_PREFILL_TOKENS_BESIDE_DECODES": "0"}
    if fraction is not None:
        env["INFLIGHTQ_KV_CACHE_MEMORY_FRACTION"] = str(fraction)
    env = up_worker_env(env, workers)  # what `inflightq up --workers N` gives each worker
    assert env["INFLIGHTQ_WORKERS_PER_HOST"] == str(workers)
    budget_fraction = fraction if fraction is not None else Settings.model_fields["kv_cache_memory_fraction"].default
    free_at_start = available_memory_bytes(torch.device("cpu"))
    # The most memory any worker can have seen free when it sized its cache: other jobs on a shared
    # box free memory while the workers load (once by 10% in a minute), so one look is not enough.
    free_seen = [free_at_start]
    sampling = threading.Event()

    def sample_free() -> None:
        while not sampling.wait(0.05):
            free_seen.append(available_memory_bytes(torch.device("cpu")))

    sampler = threading.Thread(target=sample_free, daemon=True)
    sampler.start()
    client_settings = settings.model_copy(update={"redis_url": url, "model": model})
    watched: list[Watched] = []
    with persistent_redis(port, tmp_path), QueueClient(client_settings) as client:
        try:
            for i in range(workers):
                metrics = free_port()
                args = ["--model", model, "--device", "cpu", "--metrics-port", str(metrics), *extra_args]
                worker = WorkerProcess(f"oom-{i}", args, env, tmp_path / f"oom-{i}.log").start()
                watched.append(Watched(worker, metrics))
            try:
                for w in watched:
                    w.worker.wait_ready(client, timeout=ready_timeout)
            finally:
                sampling.set()
                sampler.join()
            for w in watched:  # past start-up's last allocations: the first heartbeat was seen, the metrics answer
                scrape(w.port)
            for w in watched:
                found = KV_LINE.search(w.worker.log_path.read_text(errors="replace"))
                assert found, w.worker.log()
                w.blocks, w.kv_bytes = int(found[1]), int(float(found[3]) * MiB)
                w.ready_rss = status_kib(w.pid, "VmRSS") * 1024
            kv_total = sum(w.kv_bytes for w in watched)
            budget = budget_fraction * max(free_seen)
            # 2%: memory freed and taken again between two samples.
            assert kv_total <= 1.02 * budget, (kv_total, budget, free_at_start, max(free_seen))

            # Requests of `per` to a cache: their prompts claim it whole (the capacity check counts a
            # prompt plus one block), their outputs then need more blocks each. At least 8, and
            # enough that a prompt stays within MAX_PROMPT (a default-budget cache of the default
            # model holds ~80k tokens: 8 prompts would pass its 8,192-token context).
            blocks, block_size = min(w.blocks for w in watched), 16
            per = max(8, -(-blocks // (MAX_PROMPT // block_size + 2)))
            prompt_len = (blocks // per - 2) * block_size
            # Outputs long enough that all `per` are in the cache at once: prompts enter at most
            # max_num_batched_tokens a step, so the last one is in after per x (steps per prompt)
            # steps, and the first must still be decoding then. At least 4 blocks, which overflow it.
            step_budget = Settings.model_fields["max_num_batched_tokens"].default
            new_tokens = max(4 * block_size, 2 * per * -(-prompt_len // step_budget))
            assert prompt_len >= block_size, blocks
            rng = random.Random(17)
            ids: list[str] = []

            def submit(count: int) -> None:
                for _ in range(count):
                    prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
                    ids.append(client.submit(model, prompt, SamplingSpec(max_new_tokens=new_tokens, ignore_eos=True)))

            submit(per * workers)
            started = time.monotonic()
            pending = set(ids)
            while time.monotonic() - started < fill_timeout:
                for w in watched:
                    assert w.worker.process is not None and w.worker.process.poll() is None, (
                        f"worker {w.worker.name} died ({w.worker.process.returncode}):\n{w.worker.log()}"
                    )
                    free, preempted = scrape(w.port)
                    w.min_free, w.kv_preemptions = min(w.min_free, free), max(w.kv_preemptions, preempted)
                # Full: a sequence was preempted because the cache had no blocks left for it (a chunk
                # may need several, so the free count it ran out at need not be 0; and 0 can fall
                # between two samples).
                filled = all(w.kv_preemptions > 0 for w in watched)
                # Until every cache has been full, work stays queued: whichever worker has blocks
                # free takes more (one worker may otherwise drain the queue while another idles).
                if not filled and sum(client.queue_depth(model).values()) < workers and len(ids) < 6 * per * workers:
                    before = len(ids)
                    submit(workers)
                    pending.update(ids[before:])
                for rid in list(pending):
                    info = client.status(rid)
                    if info is not None and info.status.is_final:
                        pending.discard(rid)
                if filled and not pending:
                    break
                time.sleep(0.25)
            elapsed = time.monotonic() - started
            for w in watched:
                w.peak_rss = status_kib(w.pid, "VmHWM") * 1024
            lost = [rid for rid in ids if (info := client.status(rid)) is None or info.status is not RequestStatus.DONE]
            assert not lost, f"{len(lost)} of {len(ids)} requests not done after {elapsed:.0f} s"
            for rid in ids:
                assert len(client.result(rid, timeout=10).token_ids) == new_tokens

            pids = [w.pid for w in watched]
            for w in watched:
                w.worker.signal(signal.SIGTERM)
            codes = [w.worker.wait(timeout=60) for w in watched]
        finally:
            # Every worker killed before any is waited for: on a starved CPU one wait can time out.
            for w in watched:
                if w.worker.process is not None and w.worker.process.poll() is None:
                    w.worker.process.kill()
            for w in watched:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.worker.stop()

    kills_after = oom_kills()
    for w in watched:
        # Full: sequences preempted because the cache had no blocks left for them; nearly every
        # block seen in use (min_free is sampled every 0.25 s, so it is an upper bound).
        assert w.kv_preemptions > 0, (w.worker.name, w.min_free, w.kv_preemptions)
        assert w.min_free <= w.blocks // per, (w.worker.name, w.min_free, w.blocks)
        assert w.peak_rss <= w.ready_rss + w.kv_bytes + ACTIVATION_ALLOWANCE, (
            w.worker.name,
            w.peak_rss / MiB,
            w.ready_rss / MiB,
            w.kv_bytes / MiB,
        )
    assert sum(w.peak_rss for w in watched) < mem_total()
    assert codes == [0] * workers, codes  # a drain's exit, not a kill (-9)
    if kills_before is not None and kills_after is not None:
        assert kills_after == kills_before, "the kernel OOM-killed a process during the test"
    logged = dmesg_kills(pids)
    assert not logged, logged

    rows = "; ".join(
        f"{w.worker.name}: {w.blocks} blocks = {w.kv_bytes / MiB:.0f} MiB, RSS ready {w.ready_rss / MiB:.0f} MiB, "
        f"peak {w.peak_rss / MiB:.0f} MiB (+{(w.peak_rss - w.ready_rss) / MiB:.0f}, "
        f"beyond the cache {(w.peak_rss - w.ready_rss - w.kv_bytes) / MiB:+.0f}), "
        f"{w.kv_preemptions} kv preemptions"
        for w in watched
    )
    return (
        f"{workers} workers, budget {budget_fraction:g} x {free_at_start / MiB:.0f} MiB free at start "
        f"(at most {max(free_seen) / MiB:.0f} MiB while they started) = {budget / MiB:.0f} MiB, "
        f"caches {kv_total / MiB:.0f} MiB; "
        f"peaks together {sum(w.peak_rss for w in watched) / MiB:.0f} MiB of {mem_total() / MiB:.0f} MiB; "
        f"{len(ids)} requests x {prompt_len}+{new_tokens} tokens, all done in {elapsed:.0f} s; exit codes {codes}; "
        f"OOM kills {kills_before}->{kills_after}; dmesg {'unreadable' if logged is None else 'clean'}; {rows}"
    )


def test_two_workers_with_full_small_caches_stay_in_budget(
    worker_env: dict[str, str], settings: Settings, tmp_path: Path
) -> None:
    from worker.engine.model.tiny_model import make_tiny_llama

    # 8 layers x 8 KV heads x head_dim 64, float64: 1 MiB of cache per 16-token block, little compute.
    model = make_tiny_llama(tmp_path / "kv-heavy", num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64)
    per_worker = 96 * MiB
    fraction = round(2 * per_worker / available_memory_bytes(torch.device("cpu")), 6)
    report = fill_and_measure(
        model=str(model),
        extra_args=["--dtype", "float64"],
        workers=2,
        fraction=fraction,
        worker_env=worker_env,
        settings=settings,
        tmp_path=tmp_path,
        ready_timeout=300,  # two workers importing torch on a CPU shared with other jobs
        fill_timeout=240,
    )
    print(f"FAULTS oom light: {report}")


@pytest.mark.heavy_only  # collected only with INFLIGHTQ_FAULTS_HEAVY=1 (tests/faults/conftest.py)
def test_three_workers_of_the_default_model_with_full_caches_stay_in_budget(
    worker_env: dict[str, str], settings: Settings, tmp_path: Path
) -> None:
    fraction = os.environ.get("INFLIGHTQ_FAULTS_KV_FRACTION")
    env = {k: v for k, v in worker_env.items() if k != "OMP_NUM_THREADS"}  # `up` sets each worker's threads
    report = fill_and_measure(
        model=Settings.model_fields["model"].default,
        extra_args=[],
        workers=3,
        fraction=float(fraction) if fraction else None,
        worker_env=env,
        settings=settings,
        tmp_path=tmp_path,
        ready_timeout=900,
        fill_timeout=7200,
    )
    print(f"FAULTS oom heavy: {report}")
