"""The one typed settings object. Every field is read from ``INFLIGHTQ_<NAME>``.

docs/settings.md's table is generated from this class (``inflightq settings``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.schemas import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRIORITY

# Lists come from the environment as comma-separated strings, not JSON.
CommaList = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INFLIGHTQ_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server every process talks to.")
    redis_cluster: bool = Field(
        False,
        description="Redis is a Redis Cluster (>= 7): redis_url names any one node, the client finds the rest; "
        "token channels are sharded (SPUBLISH/SSUBSCRIBE).",
    )
    redis_max_connections: int = Field(
        10_000,
        ge=8,
        description="Redis connections one process with a sync client (a worker, the CLI) may open (per node on a "
        "Cluster); the API's asyncio pool is api_redis_max_connections.",
    )
    rq_redis_url: str | None = Field(
        None,
        description="Standalone Redis for the batch worker's RQ queue (RQ does not run on a Cluster); "
        "unset = redis_url.",
    )
    key_prefix: str = Field(
        "iq",
        description="Namespace for every key (each starts with {iq); one Redis (or Cluster) serves several "
        "deployments or test runs.",
    )
    model: str = Field(
        "smollm2-135m-instruct",
        description="Model served: an alias, a local Hugging Face directory, a .gguf file or a hub id.",
    )
    models: CommaList = Field(
        default_factory=list,
        description="Extra model names the API accepts besides `model` (comma-separated).",
    )

    # Limits, as TGI's router enforces them.
    max_input_tokens: int = Field(4096, ge=1, description="Longest prompt, in tokens.")
    max_total_tokens: int = Field(8192, ge=2, description="Prompt plus new tokens, at most.")
    max_new_tokens: int = Field(2048, ge=1, description="Cap on max_new_tokens a request may ask for.")
    default_max_new_tokens: int = Field(
        DEFAULT_MAX_NEW_TOKENS, ge=1, description="max_new_tokens when a request names none."
    )
    max_stop_sequences: int = Field(8, ge=0, description="Most stop strings one request may give.")
    max_queue_depth: int = Field(1024, ge=1, description="Queued requests per model before 429 overloaded.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest HTTP request body (413 past it).")
    priority_levels: int = Field(4, ge=1, le=16, description="Priority streams per model (0 = most urgent).")
    default_priority: int = Field(DEFAULT_PRIORITY, ge=0, description="Priority of a request that names none.")

    # Queue and recovery.
    reclaim_after_s: float = Field(
        30.0,
        gt=0,
        description="Idle time before a pending request is taken over although its worker still beats (a stuck "
        "worker's); a dead worker's are taken over once its heartbeat stops (heartbeat_stale_s).",
    )
    fair_share: bool = Field(
        True,
        description="Fair share between tenants inside each priority (a lane per tenant, token-counted, weighted); "
        "off, every priority is one first-come first-served stream.",
    )
    max_deliveries: int = Field(3, ge=1, description="Deliveries before a request goes to the dead-letter stream.")
    result_ttl_s: int = Field(86_400, ge=1, description="How long results, request hashes and replay logs live.")
    replay_log_ttl_s: int = Field(
        3600,
        ge=1,
        description="How long a finished request's replay log (every token event: SSE Last-Event-ID resume) "
        "outlives it; its result and status stay result_ttl_s.",
    )
    idempotency_window_s: int = Field(
        86_400,
        ge=1,
        description="How long an Idempotency-Key (per API key) keeps answering with the object its first "
        "request created (POST /v1/jobs, /v1/responses, /v1/batches, /v1/files).",
    )
    response_ttl_s: int = Field(
        86_400,
        ge=1,
        description="How long a stored /v1/responses response (input, parameters, output) lives in Redis; its "
        "event stream (retrieve with stream=true, starting_after) is its request's replay log, which outlives "
        "the end of generation by replay_log_ttl_s.",
    )
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="A worker's heartbeat document expires after this long.")
    heartbeat_stale_s: float = Field(
        3.0,
        gt=0,
        description="/health, `inflightq status` and the API's dispatch count a worker live while its last "
        "heartbeat is at most this old (workers beat every second, or every heartbeat_ttl_s / 3 if shorter); "
        "a killed worker stops counting within it, and another worker takes its requests over once its "
        "heartbeat has not moved for this long (and at least 3 beats).",
    )
    engine_stall_s: float = Field(
        300.0,
        ge=0,
        description="A worker whose engine loop makes no progress this long exits (exit code 70) "
        "so its requests are taken over; 0 = never.",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, time a worker gives running requests to finish."
    )
    redis_outage_grace_s: float = Field(
        30.0,
        ge=0,
        description="How long a followed stream waits out an unreachable Redis (a restart, a failover) before "
        "it ends with 503; shorter outages are only a pause, and the stream resumes from the replay log.",
    )
    no_worker_wait_s: float = Field(
        5.0, ge=0, description="How long the API waits for a live worker before answering 503."
    )

    # API.
    api_host: str = Field("127.0.0.1", description="Address the API binds.")
    api_port: int = Field(8000, ge=0, le=65535, description="Port the API binds.")
    api_keys: CommaList = Field(
        default_factory=list,
        description="Accepted API keys (comma-separated); empty means no auth. A key may carry its tenant, weight "
        "and limits: key[:max_priority[:rpm]][:name=value]..., names tenant, weight, rpm, tpm, max_queued, "
        "max_priority (README: Tenants, weights and limits).",
    )
    api_keys_file: str | None = Field(None, description="File with one API key (and limits) per line.")
    tenant_source: Literal["key", "header", "user"] = Field(
        "key",
        description="Who a request's tenant is when it presents no API key (with a key it is the key's tenant): "
        "key = none (POST /v1/jobs' `tenant` field still names one); header = the tenant_header's value; user = "
        "the body's `user` field (OpenAI's routes; `tenant` on /v1/jobs).",
    )
    tenant_header: str = Field("X-Tenant", min_length=1, description="The header tenant_source=header reads.")
    tenant_max_queued: int | None = Field(
        None,
        ge=1,
        description="Requests one tenant may have waiting per model before its next is refused (429 "
        "tenant_overloaded, for that tenant only), unless its key names its own max_queued; unset = no per-tenant "
        "limit (max_queue_depth still holds).",
    )
    tenant_metrics: CommaList = Field(
        default_factory=list,
        description="Tenants the Prometheus metrics label by name (comma-separated; a key's tenant name or key id).",
    )
    tenant_metrics_max: int = Field(
        10,
        ge=0,
        description="Further tenants a process labels by name as it meets them, beyond tenant_metrics; the rest "
        'count as tenant="other" (bounded label cardinality).',
    )
    api_redis_max_connections: int = Field(
        64,
        ge=2,
        description="Redis command connections one API process (or AsyncQueueClient) keeps, per node on a Cluster "
        "(on a standalone Redis its one pub/sub connection is one of them); more commands at once wait for a "
        "free connection instead of opening another. Its streams share one pub/sub connection per node.",
    )
    api_redis_pool_wait_s: float = Field(
        5.0,
        gt=0,
        description="How long a command waits for a free connection of the API's pool; past it the request answers "
        "503 (a followed stream pauses, as for an unreachable Redis).",
    )

    stream_buffer_bytes: int = Field(
        1024 * 1024,
        ge=64 * 1024,
        description="Bytes of events (counted as JSON) the API holds for a stream whose client reads slower than "
        "they come (each choice's unread messages, and a multi-choice stream's merged events, at most this); past "
        "it that client is dropped with a slow_reader error event (others are unaffected).",
    )
    stream_buffer_events: int = Field(
        4096,
        ge=16,
        description="Events a multi-choice stream (n > 1) may hold for a client that reads slower than they "
        "come; past it that client is dropped with a slow_reader error (others are unaffected).",
    )

    # Worker engine.
    device: str = Field("auto", description="Worker device: auto, cpu, cuda, cuda:N.")
    dtype: str = Field(
        "auto",
        description="Worker dtype: auto, float32, bfloat16, float16, float64. auto: bfloat16 on a GPU that has it "
        "(else float16); on a CPU bfloat16 where it beats float32 (AVX512-BF16 or AMX, or AVX-512 or AVX2 with "
        "the CPU kernels built), else float32.",
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences one worker runs at once.")
    lora_adapters: CommaList = Field(
        default_factory=list,
        description="LoRA adapters (PEFT's format) of the worker's model, name=path comma-separated: the worker "
        "registers them in Redis at start, where every worker and API replica finds them; requests name one "
        "as the OpenAI model or TGI's adapter_id. More are registered at run time (POST /v1/load_lora_adapter).",
    )
    max_loras: int = Field(
        4,
        ge=0,
        description="LoRA adapters a worker holds loaded at once (least recently used dropped beyond; one a running "
        "request uses is kept); 0 = the worker serves no adapters.",
    )
    max_num_batched_tokens: int = Field(512, ge=1, description="Tokens one engine step processes at most.")
    max_prefill_tokens_beside_decodes: int = Field(
        128,
        ge=0,
        description="Prompt tokens a step that also decodes processes at most (0 = up to max_num_batched_tokens). "
        "Keeps a loaded step short: each stream's time between tokens, and an urgent arrival's wait for the "
        "step in progress; a worker with nothing decoding still prefills at the full budget.",
    )
    speculative_tokens: int = Field(
        4,
        ge=0,
        le=16,
        description="Tokens a decoding sequence proposes at most per step from its own prompt and output (n-gram "
        "lookup), checked by the step beside its next token: greedy output is unchanged, a sampled one keeps its "
        "distribution and seeded draws. 0 = the worker never speculates.",
    )
    speculative_ngram_max: int = Field(
        3, ge=1, description="Longest run of a sequence's latest tokens looked up for a proposal."
    )
    speculative_ngram_min: int = Field(
        2, ge=1, description="Shortest run of a sequence's latest tokens whose earlier occurrence is proposed from."
    )
    speculate_by_default: bool = Field(
        False,
        description="Whether a request that does not say (`speculate`) speculates. Copying traffic (extraction, "
        "quoting, code edits) gains; other traffic pays a little for probes (docs/benchmarks.md).",
    )
    prefetch_seqs: int | None = Field(
        None,
        ge=0,
        description="Requests a worker takes beyond max_num_seqs; they wait in its engine so a slot that frees "
        "is refilled by the next step, not the one after. Unset = max_num_seqs // 16.",
    )
    urgent_poll_s: float = Field(
        0.05,
        gt=0,
        description="How often a full worker looks for queued work more urgent than what it runs (and takes "
        "it, preempting the least urgent sequence).",
    )
    urgent_handoff_s: float = Field(
        0.5,
        ge=0,
        description="How long a full worker leaves an urgent entry to another worker that advertises a free slot.",
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV cache blocks; unset sizes it from memory (kv_cache_memory_fraction)."
    )
    kv_cache_memory_fraction: float = Field(
        0.25,
        gt=0,
        le=0.9,
        description="Share of the memory free at start that the KV caches of all workers on one host may take "
        "together (an unset num_kv_blocks); each worker takes its part, this / workers_per_host. Free memory "
        "is the host's, or what the worker's memory cgroup (a container's limit) leaves, if that is less.",
    )
    workers_per_host: int = Field(
        1,
        ge=1,
        description="Workers sharing this host's memory (or GPU) and CPUs; their KV caches together fit "
        "kv_cache_memory_fraction, and each runs its share of the CPUs (torch_threads 0). `inflightq up --workers N` "
        "sets it to N.",
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    affinity: bool = Field(
        True,
        description="Prefix affinity: the API offers a request to the worker whose prefix cache holds the longest "
        "prefix of it (a conversation's history, a shared system prompt); any worker takes it once the offer has "
        "waited affinity_steal_after_ms longer than that worker's own work, an idle worker sooner, and any at once "
        "when that worker is gone. false: every "
        "request goes to whichever worker pulls first. The API's block_size must be the workers'.",
    )
    affinity_steal_after_ms: int = Field(
        500,
        ge=0,
        description="How much longer than a busy worker's own oldest queued work a request offered to the worker "
        "holding its prefix waits for it before that worker may take it, plus the time that worker would take to "
        "prefill again what the holder holds of it (it measures its own prefill rate); an idle worker takes it once "
        "it waited that prefill time, this long at most, and work nobody holds that waited this long goes before a "
        "worker's own younger offers.",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description="Intra-op CPU threads per worker; 0 = as many as the CPUs the worker may use (its affinity and "
        "cgroup CPU quota; divided among workers_per_host, which `inflightq up --workers N` sets), fewer while "
        "other processes take some of them (looked at every second); N = exactly N.",
    )
    cpu_kernels: bool = Field(
        True,
        description="On CPU, the worker's attention, norms, Llama-style decoder layers and (with AVX-512 or "
        "AVX2) small bf16 matmuls run in C++ kernels built on first use; 0 keeps transformers' layers, plain-torch "
        "attention and oneDNN matmuls (same results up to rounding order, slower) without trying a build, "
        "and dtype auto then picks float32 on a CPU without bf16 units.",
    )
    amx_linear: bool = Field(
        True,
        description="On a CPU with AMX (and the CPU kernels built), bf16 matmuls of 5-64 rows (decode steps of a "
        "few dozen sequences) run on AMX tiles in the engine's own kernel instead of oneDNN's; 0 keeps oneDNN.",
    )
    kernel_cache: str | None = Field(
        None, description="Directory the CPU kernels are built into; unset = ~/.cache/inflightq/kernels."
    )
    compile: bool = Field(
        False,
        description="Worker runs its model's forward compiled (torch.compile, padded token-count buckets, all "
        "compiled at start before it takes work; minutes on a small CPU, cached across restarts).",
    )
    compile_dynamic: bool = Field(
        False,
        description="With compile: one symbolic-size graph for 2+ tokens and one for 1, instead of one per "
        "bucket (two compiles at start instead of nine, for a smaller gain).",
    )
    compile_cache: str | None = Field(
        None, description="Directory for the compiled forward's caches; unset = ~/.cache/inflightq/inductor."
    )
    cuda_graphs: Literal["auto", "on", "off", "eager"] = Field(
        "auto",
        description="Decode steps replayed from CUDA graphs, one per padded batch-size bucket, captured at start "
        "before the worker takes work. auto: on a CUDA device (not with compile; a capture that fails leaves "
        "decode steps eager); on: a failed capture stops the worker; eager: the same padded step uncaptured.",
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Worker Prometheus port; unset = none.")
    batch_file_dir: str | None = Field(
        None, description="Directory for large batch files; unset keeps them in Redis with a TTL."
    )

    @field_validator("models", "api_keys", "tenant_metrics", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("lora_adapters", mode="before")
    @classmethod
    def _split_adapters(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def served_models(self) -> list[str]:
        return [self.model, *[m for m in self.models if m != self.model]]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
