"""The ``inflightq`` console script: a thin layer over the library.

Each subcommand imports its part lazily, so ``inflightq status`` never loads torch. Starting and
supervising processes is this layer's own job: ``supervisor.py`` (``inflightq up``) and
``redis_server.py`` (a private Redis when none answers)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer


class _Cli(typer.Typer):
    """The console script. A user's mistake (a missing file, an unknown id, a Redis that does not answer, a
    bad setting) is one line on stderr and a non-zero exit code; only a bug shows a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import pydantic
        import redis

        try:
            return super().__call__(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            from shared.settings import get_settings

            url = _redacted(_followed_redis_url or get_settings().redis_url)
            print(f"inflightq: Redis at {url} does not answer ({err}); is it running?", file=sys.stderr)
            sys.exit(1)
        except pydantic.ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in err.errors())
            print(f"inflightq: bad setting: {problems}", file=sys.stderr)
            sys.exit(2)


# The Redis of the running `inflightq up`, once a command chose to follow it (_deployment_settings).
_followed_redis_url: str | None = None


def _redacted(url: str) -> str:
    """A Redis URL without its password."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


app = _Cli(
    help="inflightq: Redis-backed LLM serving with continuous batching.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks; each prints a ratio against an anchor run in the same process.")
app.add_typer(bench_app, name="bench")


@app.command("settings")
def settings_table() -> None:
    """Print every INFLIGHTQ_* setting with its default, as docs/settings.md's markdown table."""
    from shared.settings import Settings

    print("| variable | default | meaning |\n|---|---|---|")
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        shown = ",".join(default) if isinstance(default, list) else default
        print(f"| `INFLIGHTQ_{name.upper()}` | `{shown}` | {field.description} |")


@app.command("up")
def up(
    workers: int = typer.Option(1, min=1, help="Worker processes to start."),
    batch_workers: int = typer.Option(1, min=0, help="Batch (RQ) worker processes to start for /v1/batches."),
    host: str | None = typer.Option(None, help="API bind address (default INFLIGHTQ_API_HOST)."),
    port: int | None = typer.Option(None, help="API port (default INFLIGHTQ_API_PORT)."),
    metrics_port: int | None = typer.Option(
        None,
        help="Worker i serves Prometheus metrics on this port + i (default INFLIGHTQ_METRICS_PORT, else 9100); "
        "a taken port is replaced by a free one, printed; 0 = free ports.",
    ),
    private_redis: bool = typer.Option(
        False, "--private-redis", help="Start a private Redis even when one answers at INFLIGHTQ_REDIS_URL."
    ),
    started_at: float | None = typer.Option(
        None, help="Unix time the ready line counts from (the quick start passes its own, so its install counts)."
    ),
) -> None:
    """Run everything on this machine: Redis (a private one if none answers, or with --private-redis),
    the API, the workers and a batch worker; says "ready" once the API answers with a live worker.
    While it runs, the CLI in any other shell finds this deployment (inflightq_cli/deployment_file.py)."""
    from inflightq_cli.supervisor import run_stack
    from shared.settings import get_settings

    code = run_stack(
        get_settings(),
        workers=workers,
        batch_workers=batch_workers,
        host=host,
        port=port,
        metrics_port=metrics_port,
        private_redis=private_redis,
        started_at=started_at,
    )
    raise typer.Exit(code)


def _deployment_settings() -> Settings:
    """The settings of the deployment the CLI acts on: the environment's, pointed at the running
    ``inflightq up``'s Redis and key prefix when the environment names neither (said on stderr)."""
    from inflightq_cli.deployment_file import deployment_path, followed
    from shared.keys import Keys
    from shared.settings import get_settings

    global _followed_redis_url
    settings, deployment = followed(get_settings())
    if deployment is not None:
        _followed_redis_url = settings.redis_url
        where = Keys.for_prefix(settings.key_prefix).described()
        typer.echo(
            f"inflightq: following `inflightq up` (pid {deployment.pid}, {deployment_path()}): Redis at "
            f"{_redacted(settings.redis_url)}, keys under {where}; set INFLIGHTQ_REDIS_URL to choose another",
            err=True,
        )
    return settings


# Batches (OpenAI Batch API over RQ) ------------------------------------------------------
batch_app = typer.Typer(help="Batches of OpenAI requests, run at the lowest priority.", no_args_is_help=True)
app.add_typer(batch_app, name="batch")

if TYPE_CHECKING:
    from collections.abc import Iterator

    from producer_api.batches.store import BatchObject, BatchStore
    from shared.settings import Settings


@contextmanager
def _batch_errors() -> Iterator[None]:
    """A refused upload or an unknown id is a one-line message, not a traceback."""
    from shared.errors import InflightqError

    try:
        yield
    except InflightqError as err:
        typer.echo(f"inflightq: {err.message}", err=True)
        raise typer.Exit(2) from None


def _batch_store() -> BatchStore:
    from producer_api.batches.store import BatchStore
    from shared.redis_connect import connect

    settings = _deployment_settings()
    return BatchStore(settings, connect(settings, decode_responses=False))  # type: ignore[arg-type]


@app.command("batch-worker")
def batch_worker(
    name: str | None = typer.Option(None, help="Worker name (default: batch-<random>)."),
    recover_every: int = typer.Option(15, min=1, help="Seconds between checks for batches whose run died."),
    burst: bool = typer.Option(False, help="Exit once the queue is empty (tests, one-off runs)."),
) -> None:
    """Run batch jobs from RQ (JSON serializer): feed lines to the queue, collect results, write files."""
    import logging

    from producer_api.batches.queue import run_batch_worker
    from shared.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise typer.Exit(run_batch_worker(get_settings(), name=name, recover_every_s=recover_every, burst=burst))


@batch_app.command("submit")
def batch_submit(
    file: str = typer.Argument(..., help="JSONL file: one OpenAI request per line (custom_id, method, url, body)."),
    endpoint: str | None = typer.Option(
        None, help="/v1/chat/completions or /v1/completions (default: the url of the file's first line)."
    ),
    model: str | None = typer.Option(None, help="Run every line on this model, whatever the line names."),
    wait: bool = typer.Option(False, "--wait", help="Show progress and wait until the batch ends."),
    output: str | None = typer.Option(None, help="With --wait: write the output file here."),
) -> None:
    """Upload FILE and create a batch; prints its id (and, with --wait, the finished batch)."""
    from pathlib import Path

    from producer_api.batches.lines import endpoint_of
    from producer_api.batches.queue import create_batch

    path = Path(file)
    if not path.is_file():
        typer.echo(f"inflightq: no such file: {file}", err=True)
        raise typer.Exit(2)
    store = _batch_store()
    content = path.read_bytes()
    endpoint = endpoint or endpoint_of(content) or "/v1/chat/completions"
    with _batch_errors():
        uploaded = store.files.put(content, filename=path.name, purpose="batch")
        batch = create_batch(store.settings, store, input_file_id=uploaded.id, endpoint=endpoint, model=model)
    print(batch.id, flush=True)
    if not wait:
        return
    batch = _follow(store, batch.id)
    print(batch.model_dump_json(indent=2, exclude_none=True))
    if output and batch.output_file_id:
        Path(output).write_bytes(store.files.content(batch.output_file_id))
    raise typer.Exit(0 if batch.status == "completed" else 1)


def _follow(store: BatchStore, batch_id: str) -> BatchObject:
    """A progress bar over the batch's request counts until it is final."""
    import time

    from tqdm import tqdm

    batch = store.get(batch_id)
    with tqdm(total=batch.request_counts.total or None, unit="req", desc=batch_id[:18]) as bar:
        while True:
            batch = store.get(batch_id)
            counts = batch.request_counts
            bar.total = counts.total or bar.total
            bar.n = counts.completed + counts.failed
            bar.set_postfix(status=batch.status.value, failed=counts.failed, refresh=False)
            bar.refresh()
            if batch.status.is_final:
                return batch
            time.sleep(0.5)


@batch_app.command("status")
def batch_status(batch_id: str = typer.Argument(..., help="The batch id (batch_...).")) -> None:
    """Print a batch as /v1/batches/{id} shows it."""
    store = _batch_store()
    with _batch_errors():
        print(store.get(batch_id).model_dump_json(indent=2, exclude_none=True))


@batch_app.command("cancel")
def batch_cancel(batch_id: str = typer.Argument(..., help="The batch id (batch_...).")) -> None:
    """Cancel a batch: its queued requests are dropped, finished ones stay in the output file."""
    from producer_api.batches.queue import cancel_batch

    store = _batch_store()
    with _batch_errors():
        print(cancel_batch(store.settings, store, batch_id).model_dump_json(indent=2, exclude_none=True))


class _HealthyChecksQuiet:
    """Leaves successful /health polls (``inflightq up`` waiting for a worker, load balancers, probes)
    out of the access log; everything else, failed health checks included, is logged."""

    def filter(self, record: object) -> bool:
        args = getattr(record, "args", None)
        return not (isinstance(args, tuple) and len(args) >= 5 and args[2] == "/health" and args[4] == 200)


@app.command("api")
def api(
    host: str | None = typer.Option(None, help="Address to bind; default INFLIGHTQ_API_HOST."),
    port: int | None = typer.Option(None, help="Port to bind; default INFLIGHTQ_API_PORT."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve the HTTP API (TGI- and OpenAI-compatible routes, async jobs) over the Redis queue."""
    import logging

    import uvicorn

    from producer_api.app import create_app
    from shared.settings import get_settings

    settings = get_settings()
    logging.getLogger("uvicorn.access").addFilter(_HealthyChecksQuiet())
    uvicorn.run(
        create_app(settings, freeze_startup=True),
        host=host or settings.api_host,
        port=settings.api_port if port is None else port,
        log_level=log_level,
        # Our own middleware caps bodies; uvicorn's access log never sees credentials (headers are not logged).
        timeout_graceful_shutdown=10,
    )


# Worker and queue status ------------------------------------------------------------------
@app.command("worker")
def worker(
    model: str | None = typer.Option(None, help="Model to serve; default INFLIGHTQ_MODEL."),
    device: str | None = typer.Option(None, help="auto, cpu, cuda, cuda:N; default INFLIGHTQ_DEVICE."),
    dtype: str | None = typer.Option(None, help="auto, float32, bfloat16, float16, float64; default INFLIGHTQ_DTYPE."),
    name: str | None = typer.Option(None, help="Worker name (default: host-pid-random)."),
    metrics_port: int | None = typer.Option(None, help="Serve Prometheus metrics on this port."),
    max_num_seqs: int | None = typer.Option(None, min=1, help="Sequences run at once."),
    max_num_batched_tokens: int | None = typer.Option(None, min=1, help="Tokens per engine step."),
    num_kv_blocks: int | None = typer.Option(None, min=1, help="KV cache blocks (default: sized from memory)."),
    block_size: int | None = typer.Option(None, min=1, help="Tokens per KV cache block."),
) -> None:
    """Serve one model from the Redis queue until SIGTERM (then drain and exit 0)."""
    from shared.settings import get_settings
    from worker.serve import run_worker

    overrides = {
        "model": model,
        "device": device,
        "dtype": dtype,
        "metrics_port": metrics_port,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "num_kv_blocks": num_kv_blocks,
        "block_size": block_size,
    }
    settings = get_settings().model_copy(update={k: v for k, v in overrides.items() if v is not None})
    raise typer.Exit(run_worker(settings, name=name))


@app.command("status")
def status(model: list[str] | None = typer.Option(None, help="Only these models (default: every model seen).")) -> None:
    """Print live workers and queue depth per model and priority (of the running `inflightq up`'s
    deployment unless INFLIGHTQ_REDIS_URL names one)."""
    from shared.client import QueueClient

    with QueueClient(_deployment_settings()) as client:
        if not client.ping():
            typer.echo(f"inflightq: Redis at {_redacted(client.settings.redis_url)} does not answer", err=True)
            raise typer.Exit(1)
        workers = client.live_workers()
        print(f"{len(workers)} live worker(s)")
        for w in sorted(workers, key=lambda w: (w.model, w.name)):
            state = " draining" if w.draining else ""
            print(
                f"  {w.name}  model={w.model} device={w.device} dtype={w.dtype} threads={w.threads}"
                f" running={w.running}/{w.max_num_seqs} waiting={w.waiting}"
                f" free_kv_blocks={w.free_kv_blocks}/{w.num_kv_blocks}{state}"
            )
        for name in model or sorted(set(client.models()) | {w.model for w in workers}):
            depth = client.queue_depth(name)
            shown = " ".join(f"p{p}={n}" for p, n in depth.items())
            dead = client.redis.xlen(client.keys.dead_letters(name))
            age = client.oldest_waiting_age_s(name)
            print(f"queue {name}: {shown} (total {sum(depth.values())}, oldest {age:.1f}s, dead letters {dead})")


@app.command("purge")
def purge(
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
    force: bool = typer.Option(False, "--force", help="Delete even while workers of this deployment are live."),
) -> None:
    """Delete every key of this deployment (everything under INFLIGHTQ_KEY_PREFIX, RQ's keys included) and
    nothing else: queued work, results, files and batches are gone. Stop the deployment first."""
    from shared.client import QueueClient

    with QueueClient(_deployment_settings()) as client:
        if not client.ping():
            typer.echo(f"inflightq: Redis at {_redacted(client.settings.redis_url)} does not answer", err=True)
            raise typer.Exit(1)
        live = client.live_workers()
        if live and not force:
            names = ", ".join(sorted(w.name for w in live))
            typer.echo(f"inflightq: {len(live)} worker(s) still live ({names}); stop them first, or --force", err=True)
            raise typer.Exit(1)
        # Where the keys live: the deployment's Redis (every master of a Cluster: scan_iter and unlink
        # go to each), and RQ's own Redis where it has one (rq_redis_url: RQ does not run on a Cluster).
        targets: list[tuple[Any, str, str]] = [
            (
                client.redis,
                client.keys.pattern(),
                f"{_redacted(client.settings.redis_url)} under {client.keys.described()}",
            )
        ]
        rq_url = client.settings.rq_redis_url
        if rq_url and rq_url != client.settings.redis_url:
            import redis

            rq = redis.Redis.from_url(rq_url, decode_responses=True, encoding_errors="replace")
            targets.append((rq, client.keys.rq_pattern(), f"{_redacted(rq_url)} under {client.keys.rq()}:"))
        found = [sum(1 for _ in target.scan_iter(match=pattern, count=1000)) for target, pattern, _ in targets]
        where = " and ".join(w for (_, _, w), n in zip(targets, found, strict=True) if n) or targets[0][2]
        if not sum(found):
            print(f"inflightq: no keys at {where}")
            return
        if not yes:
            if not sys.stdin.isatty():
                typer.echo(f"inflightq: {sum(found)} keys at {where}; add --yes to delete them", err=True)
                raise typer.Exit(2)
            typer.confirm(f"Delete {sum(found)} keys at {where}?", abort=True)
        deleted = 0
        for target, pattern, _ in targets:
            batch: list[str] = []
            for key in target.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += target.unlink(*batch)
                    batch.clear()
            if batch:
                deleted += target.unlink(*batch)
        print(f"inflightq: deleted {deleted} keys at {where}")


# The benchmarks live in the source checkout's bench/, which uses the product and is not part of the
# installed package: each command runs ``python -m bench.<name>`` with the arguments given.
BENCHMARKS = {
    "engine": "Our engine vs transformers' continuous batching on the default model, same run.",
    "transport": "Token events/s one worker publishes (tiny random model) vs raw pipelined PUBLISH, same Redis, "
    "same run.",
    "structured": "32 requests, half with a JSON schema, vs the same 32 unconstrained, same run; mask time per "
    "step and per row beside the forward.",
    "serve": "Load generator in the manner of `vllm bench serve` through the API and the queue, beside the "
    "offline engine and transformers' continuous batching on the same prompts.",
    "priority": "Urgent requests while background work saturates the pool: TTFT vs the idle stack, FCFS and "
    "transformers' continuous batching, same run.",
    "fairness": "A tenant flooding the pool beside a light one, and weights 3:1: the light tenant's TTFT vs the "
    "idle stack and throughput vs FCFS, same run, on one and two workers and a Redis Cluster.",
    "affinity": "Prefix affinity against plain pull on 2 and 4 workers (multi-turn chat, shared system prompts): "
    "prefix hit rate vs one worker, prefilled tokens, TTFT, throughput, same run; a simulation projects 16-64 workers.",
    "lora": "LoRA adapters in the batch: tokens/s and TPOT at 1, 8 and 32 streams with 0, 1, 4 and 16 distinct "
    "adapters, each against the base model in the same run.",
    "speculative": "n-gram speculative decoding: our engine with and without it on copying (extraction, quoting, "
    "code edit) and chat prompts at 1 and 8 streams, same run: tokens/s ratio, draft tokens kept, tokens per step.",
    "streams": "What idle-waiting streams cost one API process: Redis connections, RSS and CPU at 100 / 1,000 / "
    "10,000 open streams, on Redis and on a private Redis Cluster.",
}


def _run_benchmark(name: str, args: list[str]) -> None:
    """Replaces this process with ``python -m bench.<name> ARGS`` from the checkout this package lives in."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / f"{name}.py").is_file():
        typer.echo(
            f"inflightq: the benchmarks run from a source checkout; there is no bench/ beside {root / 'inflightq_cli'} "
            "(installed from a wheel?): clone the repository and run `inflightq bench` there",
            err=True,
        )
        raise typer.Exit(2)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", f"bench.{name}", *args], os.environ | {"PYTHONPATH": path})


def _bench_command(name: str) -> Any:
    def command(ctx: typer.Context) -> None:
        _run_benchmark(name, list(ctx.args))

    return command


for _name, _help in BENCHMARKS.items():
    bench_app.command(
        _name,
        help=f"{_help} Arguments: `inflightq bench {_name} --help`.",
        add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(_bench_command(_name))
