"""Every Redis key and channel name, in one place.

All names start with ``{prefix}:`` where the prefix is wrapped in a hash tag, so every
key of a deployment lands in one Cluster slot (multi-key commands and Lua stay legal)
and several deployments or test runs share one Redis without touching each other."""

from __future__ import annotations

from dataclasses import dataclass

CONSUMER_GROUP = "workers"


@dataclass(frozen=True)
class Keys:
    prefix: str

    @classmethod
    def for_prefix(cls, prefix: str) -> Keys:
        tagged = prefix if prefix.startswith("{") and prefix.endswith("}") else "{" + prefix + "}"
        return cls(tagged)

    def _k(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    # Per model ---------------------------------------------------------------------
    def stream(self, model: str, priority: int) -> str:
        """Priority stream of a model; priority 0 is the most urgent."""
        return self._k("q", model, f"p{priority}")

    def notify(self, model: str) -> str:
        """A list idle workers block on; every enqueue pushes one wake-up token."""
        return self._k("notify", model)

    def dead_letters(self, model: str) -> str:
        return self._k("dead", model)

    def models(self) -> str:
        """Set of model names that ever had a queue (for status and /v1/models)."""
        return self._k("models")

    # Per request -------------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """Hash: status, model, priority, timestamps, worker, result (JSON) when final."""
        return self._k("req", request_id)

    def tokens_channel(self, request_id: str) -> str:
        """Pub/sub channel with every event of the request, live."""
        return self._k("tokens", request_id)

    def replay_log(self, request_id: str) -> str:
        """Stream holding the same events, for late subscribers, SSE resume and takeover."""
        return self._k("log", request_id)

    def idempotency(self, scope: str, key: str) -> str:
        """Maps a client-chosen key (a batch line's custom_id) to the request id it created."""
        return self._k("idem", scope, key)

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
    def rate_limit(self, key_id: str, window: int) -> str:
        """Counter of an API key's requests in one one-minute window (every API replica shares it)."""
        return self._k("ratelimit", key_id, window)

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

    def pattern(self) -> str:
        """Glob over every key of this prefix, RQ's included (``inflightq purge``, cleanup of a test run)."""
        return "".join("\\" + c if c in "{}*?[]\\" else c for c in self.prefix) + ":*"
