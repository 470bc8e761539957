"""Workers sharing a host size their KV caches so the sum fits the budget
(kv_cache_memory_fraction of the memory free at start, divided by workers_per_host, which
`inflightq up --workers N` sets), and each reports its size at start."""

from __future__ import annotations

from pathlib import Path

from inflightq_cli.supervisor import worker_env as up_worker_env
from shared.client import QueueClient
from tests.worker.conftest import WorkerProcess

# Small enough that the budget, not the engine's own cap (max_num_seqs x max_model_len), decides.
FRACTION = "0.0004"


def start(name: str, per_host: int, worker_env: dict[str, str], model_dir: Path, tmp_path: Path) -> WorkerProcess:
    env = {**worker_env, "INFLIGHTQ_KV_CACHE_MEMORY_FRACTION": FRACTION, "INFLIGHTQ_WORKERS_PER_HOST": str(per_host)}
    args = ["--model", str(model_dir), "--dtype", "float64", "--device", "cpu"]
    return WorkerProcess(name, args, env, tmp_path / f"{name}.log").start()


def test_workers_sharing_a_host_split_the_kv_budget(
    worker_env: dict[str, str], tiny_model_dir: Path, tmp_path: Path, client: QueueClient
) -> None:
    assert up_worker_env({}, 3)["INFLIGHTQ_WORKERS_PER_HOST"] == "3"
    assert "INFLIGHTQ_WORKERS_PER_HOST" not in up_worker_env({}, 1)
    workers = [start("alone", 1, worker_env, tiny_model_dir, tmp_path)]
    try:
        workers[0].wait_ready(client)
        workers += [start(f"shared-{i}", 2, worker_env, tiny_model_dir, tmp_path) for i in range(2)]
        for worker in workers[1:]:
            worker.wait_ready(client)
        blocks = {beat.name: beat.num_kv_blocks for beat in client.live_workers()}
        alone = blocks["alone"]
        for name in ("shared-0", "shared-1"):
            # Free memory moves a little between starts; the split itself is exact.
            assert 0.35 * alone <= blocks[name] <= 0.65 * alone, blocks
        assert blocks["shared-0"] + blocks["shared-1"] <= 1.1 * alone
        for worker in workers:
            assert "KV cache: " in worker.log() and " MiB " in worker.log()
        print(f"FAULTS kv sizing: alone {alone} blocks; two sharing a host {blocks['shared-0']} + {blocks['shared-1']}")
    finally:
        for worker in workers:
            worker.stop()
