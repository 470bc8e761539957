"""Every Redis key and channel name, in one place.

Where a key lives on a Redis Cluster is decided here, by its hash tag (the part in braces):

- ``{iq}:...``: deployment-wide keys (worker heartbeats, the models set, the cancel channel,
  files, batches, rate limits) share one slot;
- ``{iq/q/<model>}:...``: a model's queue (its lanes and offer streams with their consumer group,
  the lanes set, the fair-share counters, the workers' held prefixes, wake-up list, dead letters)
  shares one slot per model, so every queue script is atomic on a Cluster too;
- ``{iq/r<shard>.<n>}:...``: a request's hash, replay log and token channel share the slot of
  its shard. The shard is a hash of the request id (``shard_of``), so any id, generated or
  chosen by a client, carries its shard; the ``REQUEST_SHARDS`` shards' tags are chosen so that
  shard k's slot lies in the k-th of ``REQUEST_SHARDS`` equal slot ranges, which spreads requests
  evenly over however many masters split the slots evenly.

Every Lua script names keys of one tag only (see ``shared.request_lifecycle``), so scripts stay
legal on a Cluster, and a worker's step groups its token events by slot. All names start with
``{<prefix>``, so several deployments or test runs share one Redis (or Cluster) without
touching each other."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

CONSUMER_GROUP = "workers"

# Fixed for good: shard k's tag depends on it, and readers must find what writers wrote.
REQUEST_SHARDS = 128


def tenant_tag(tenant: str) -> str:
    """A tenant as it appears in key names: short, stable, and free of characters keys avoid. The
    pull script derives it the same way (``redis.sha1hex``), so the two must stay equal."""
    return hashlib.sha1(tenant.encode()).hexdigest()[:16]


def lane_priority(lane: str) -> int:
    """The priority of a lane or offer stream, from its key (``Keys.lane``, ``Keys.offers``)."""
    return int(lane.rsplit("}:", 1)[1].split(":", 1)[0].removeprefix("p"))


def model_of_lane(lane: str) -> str:
    """The model of a lane or offer stream, from its key's tag (``{<prefix>/q/<model>}``)."""
    return lane[: lane.rindex("}:")].split("/q/", 1)[1]


def shard_of(request_id: str) -> int:
    return zlib.crc32(request_id.encode()) % REQUEST_SHARDS


@lru_cache(maxsize=64)
def shard_tags(prefix: str) -> tuple[str, ...]:
    """The hash tag of each request shard of ``prefix``: the first ``<prefix>/r<k>.<n>`` whose
    slot falls in the k-th slot range (about 128 CRC16s per shard, once per process)."""
    size = REDIS_CLUSTER_HASH_SLOTS // REQUEST_SHARDS
    tags = []
    for shard in range(REQUEST_SHARDS):
        n = 0
        while key_slot(f"{{{prefix}/r{shard}.{n}}}".encode()) // size != shard:
            n += 1
        tags.append(f"{{{prefix}/r{shard}.{n}}}")
    return tuple(tags)


@dataclass(frozen=True)
class Keys:
    prefix: str  # the deployment's name, without braces

    @classmethod
    def for_prefix(cls, prefix: str) -> Keys:
        return cls(prefix.removeprefix("{").removesuffix("}"))

    def described(self) -> str:
        """Where this prefix's keys live, for messages: every key starts with one of these tags."""
        return f"{{{self.prefix}}}: and {{{self.prefix}/...}}:"

    def _k(self, *parts: object) -> str:
        return ":".join(["{" + self.prefix + "}", *map(str, parts)])

    def _model_k(self, model: str, *parts: object) -> str:
        return ":".join(["{" + self.prefix + "/q/" + model + "}", *map(str, parts)])

    def _request_k(self, request_id: str, *parts: object) -> str:
        return ":".join([shard_tags(self.prefix)[shard_of(request_id)], *map(str, parts)])

    # Per model ---------------------------------------------------------------------
    def stream(self, model: str, priority: int) -> str:
        """Priority stream of a model; priority 0 is the most urgent. The lane of requests without a
        tenant, so a deployment without tenants has one stream per priority."""
        return self._model_k(model, f"p{priority}")

    def lane(self, model: str, priority: int, tenant: str | None) -> str:
        """Stream of one tenant's requests at one priority (the fair pick chooses between lanes)."""
        if not tenant:
            return self.stream(model, priority)
        return self._model_k(model, f"p{priority}", "t", tenant_tag(tenant))

    def lane_prefix(self, model: str, priority: int) -> str:
        """What every tenant lane's key of ``priority`` starts with (the pull script appends the tag)."""
        return self._model_k(model, f"p{priority}", "t", "")

    def offers(self, model: str, priority: int, worker: str) -> str:
        """Stream of entries offered to ``worker`` (it holds their prefix); others steal them after the bound."""
        return self._model_k(model, f"p{priority}", "o", worker)

    def offers_prefix(self, model: str, priority: int) -> str:
        return self._model_k(model, f"p{priority}", "o", "")

    def offered(self, model: str, priority: int) -> str:
        """Set of the workers that have an offer stream at ``priority``."""
        return self._model_k(model, f"p{priority}", "offered")

    def lanes(self, model: str) -> str:
        """Set of every lane and offer stream key of the model, every priority (the default streams
        too): recovery, reclaim, depth and purge iterate it."""
        return self._model_k(model, "lanes")

    def share(self, model: str, priority: int) -> str:
        """Hash: tenant -> virtual time at ``priority`` (tokens served / weight; the fair pick's counter)."""
        return self._model_k(model, f"p{priority}", "share")

    def clock(self, model: str, priority: int) -> str:
        """String: the virtual time of the last pick at ``priority``; a tenant that becomes backlogged
        while no other is starts there (no credit banked while idle)."""
        return self._model_k(model, f"p{priority}", "clock")

    def backlog(self, model: str, priority: int) -> str:
        """Sorted set: tenants with waiting entries at ``priority``, scored by their virtual time."""
        return self._model_k(model, f"p{priority}", "backlog")

    def waiting(self, model: str, priority: int) -> str:
        """Hash: tenant -> entries waiting at ``priority`` (not yet pulled): the backlog and the
        per-tenant queued limit read it."""
        return self._model_k(model, f"p{priority}", "waiting")

    def held(self, model: str, worker: str) -> str:
        """Set: the prefix block hashes (hex) ``worker`` has cached, with a TTL the heartbeat
        refreshes; while it exists the worker is live (its offers are not stealable at once)."""
        return self._model_k(model, "held", worker)

    def held_prefix(self, model: str) -> str:
        return self._model_k(model, "held", "")

    def notify(self, model: str) -> str:
        """A list idle workers block on; every enqueue pushes one wake-up token."""
        return self._model_k(model, "notify")

    def light_arrivals(self, model: str) -> str:
        """A list full workers block on: a token per request of a tenant that had none waiting at its priority
        (a light tenant's), which may displace work there, so they look at once instead of at their next poll."""
        return self._model_k(model, "light")

    def notify_worker(self, model: str, worker: str) -> str:
        """A list only ``worker`` blocks on (beside ``notify``): an offer to it while it is idle wakes it
        alone, so no other idle worker steals what it holds the prefix of."""
        return self._model_k(model, "notify", worker)

    def dead_letters(self, model: str) -> str:
        return self._model_k(model, "dead")

    def models(self) -> str:
        """Set of model names that ever had a queue (for status and /v1/models)."""
        return self._k("models")

    def adapters(self) -> str:
        """Hash: LoRA adapter name -> its record (JSON: base model, path), the deployment's adapters
        (``shared.adapters``)."""
        return self._k("adapters")

    # Per request -------------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """Hash: status, model, priority, timestamps, worker, result (JSON) when final."""
        return self._request_k(request_id, "req", request_id)

    def tokens_channel(self, request_id: str) -> str:
        """Pub/sub channel with every event of the request, live."""
        return self._request_k(request_id, "tokens", request_id)

    def replay_log(self, request_id: str) -> str:
        """Stream holding the same events, for late subscribers, SSE resume and takeover."""
        return self._request_k(request_id, "log", request_id)

    def idempotency(self, scope: str, key: str) -> str:
        """Maps a client-chosen key (a batch line's custom_id) to the request id it created."""
        return self._k("idem", scope, key)

    def idempotency_key(self, owner: str, digest: str) -> str:
        """String (JSON): what an HTTP ``Idempotency-Key`` created; ``digest`` (a hash of the key) picks
        its shard, so these spread over a Cluster's slots."""
        return self._request_k(digest, "idem-http", owner, digest)

    # Responses API -------------------------------------------------------------------
    def response(self, response_id: str) -> str:
        """String (JSON): a stored /v1/responses response: its input, parameters, conversation context and,
        once final, its output; lives response_ttl_s. Its events are its request's replay log (same id)."""
        return self._k("resp", response_id)

    # Batch API (files and batches) ------------------------------------------------------
    def file(self, file_id: str) -> str:
        """Hash: an uploaded or generated file's metadata (and where its bytes are)."""
        return self._k("file", file_id)

    def file_content(self, file_id: str) -> str:
        """String: the bytes of a file kept in Redis (small files; large ones live on disk)."""
        return self._k("filedata", file_id)

    def files(self) -> str:
        """Sorted set of file ids scored by creation time (GET /v1/files pages over it)."""
        return self._k("files")

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's OpenAI-shaped fields (status, counts, file ids, timestamps)."""
        return self._k("batch", batch_id)

    def batches(self) -> str:
        """Sorted set of batch ids scored by creation time (GET /v1/batches pages over it)."""
        return self._k("batches")

    def batch_outcomes(self, batch_id: str) -> str:
        """Hash: input line number -> its output or error line, written once per line."""
        return self._k("batch", batch_id, "outcomes")

    def batch_requests(self, batch_id: str) -> str:
        """Hash: custom_id -> queue request id, for cancel and status."""
        return self._k("batch", batch_id, "requests")

    def batch_lease(self, batch_id: str) -> str:
        """String with a short TTL held by the one job run processing the batch."""
        return self._k("batch", batch_id, "lease")

    # API keys ----------------------------------------------------------------------
    def rate_limits(self) -> str:
        """Prefix of the ``limits`` library's counters of API keys' requests and tokens per minute
        (every API replica shares them); the library appends its own names."""
        return self._k("ratelimit")

    # Workers -----------------------------------------------------------------------
    def cancel_channel(self) -> str:
        """Pub/sub channel every worker listens on; the message is a request id."""
        return self._k("cancel")

    def worker(self, name: str) -> str:
        """Heartbeat hash of a live worker, with a TTL."""
        return self._k("worker", name)

    def workers(self) -> str:
        """Sorted set of worker names scored by last heartbeat time."""
        return self._k("workers")

    # RQ (the batch worker) ----------------------------------------------------------
    def rq(self) -> str:
        """RQ's own key prefix (RQ_KEY_PREFIX): its queues, jobs, workers and registries live under ours."""
        return self._k("rq")

    def rq_pattern(self) -> str:
        """Glob over RQ's keys alone: ``inflightq purge`` scans the RQ Redis with it where RQ has its own
        (``rq_redis_url``, as on a Cluster)."""
        return glob_escape(self.rq()) + ":*"

    def request_pattern(self) -> str:
        """Glob over every request hash of this prefix, whatever its shard."""
        return "\\{" + glob_escape(self.prefix) + "/r*}:req:*"

    def pattern(self) -> str:
        """Glob over every key of this prefix, whatever its tag, RQ's included where RQ shares this Redis
        (``inflightq purge``, cleanup of a test run); on a Cluster, scan every master with it."""
        return "\\{" + glob_escape(self.prefix) + "[}/]*"


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]{}\\" else c for c in text)
