"""A request's lifecycle as the queue sees it: the one place its states live.

    queued ──► running ──► done
      │          │  ▲
      │          │  └── (worker died: taken over by another worker, stays running)
      │          ├─────► failed     (engine error, or dead-lettered after too many deliveries)
      ├──────────┼─────► cancelled  (DELETE /v1/jobs/{id}, client disconnect, client.cancel)
      └──────────┴─────► expired    (deadline passed before or during generation)

Who moves it: the API/client writes ``queued`` (enqueue) and may ask for ``cancelled``;
a worker writes every other state. The state is the ``status`` field of the request hash
(``keys.request``)."""

from __future__ import annotations

from enum import StrEnum


class RequestStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset({RequestStatus.DONE, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.EXPIRED})

ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.CANCELLED, RequestStatus.EXPIRED, RequestStatus.FAILED}
    ),
    RequestStatus.RUNNING: frozenset(
        {
            RequestStatus.RUNNING,  # a takeover by another worker
            RequestStatus.DONE,
            RequestStatus.FAILED,
            RequestStatus.CANCELLED,
            RequestStatus.EXPIRED,
        }
    ),
    RequestStatus.DONE: frozenset(),
    RequestStatus.FAILED: frozenset(),
    RequestStatus.CANCELLED: frozenset(),
    RequestStatus.EXPIRED: frozenset(),
}


def can_move(current: RequestStatus, new: RequestStatus) -> bool:
    return new in ALLOWED_TRANSITIONS[current]
