"""What the worker's recovery thread may report as lost: a request still running here whose entry
another worker took over is dropped; a request that only waits for its final write and ack is not
(its ack lands just before the publisher's ``settled`` callback forgets the entry, so a refresh in
between finds it no longer pending: seen under load as a false "taken over by another worker")."""

from __future__ import annotations

from types import SimpleNamespace

from worker.inbox import Inbox, OwnedEntries
from worker.service import WorkerService


def worker_with(*request_ids: str) -> SimpleNamespace:
    owned = OwnedEntries()
    for i, rid in enumerate(request_ids):
        owned.add(SimpleNamespace(id=rid, stream="s", entry_id=f"{i}-0"))  # type: ignore[arg-type]
    return SimpleNamespace(owned=owned, inbox=Inbox())


def test_a_running_request_whose_entry_was_taken_over_is_dropped() -> None:
    worker = worker_with("running")
    WorkerService.lost(worker, "s", "0-0")  # type: ignore[arg-type]
    assert [(i.kind, i.request_id) for i in worker.inbox.take()] == [("lost", "running")]


def test_a_finished_request_waiting_for_its_ack_is_not_reported_lost() -> None:
    worker = worker_with("running", "finished")
    worker.owned.settling("finished")
    WorkerService.lost(worker, "s", "1-0")  # type: ignore[arg-type]
    assert worker.inbox.take() == []
    assert worker.owned.by_stream() == {"s": ["0-0", "1-0"]}  # still kept fresh until the ack has landed
    worker.owned.discard("finished")  # the publisher's settled callback
    assert worker.owned.by_stream() == {"s": ["0-0"]} and not worker.owned.is_settling("finished")


def test_only_an_owned_request_can_be_settling() -> None:
    owned = OwnedEntries()
    owned.settling("never-added")
    assert not owned.is_settling("never-added")
