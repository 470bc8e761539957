"""Who is charged a delivery when an engine step raises: the batch mates of a poison request
must not be walked into the dead letters with it, whatever order the takeovers come in."""

from __future__ import annotations

from shared.schemas import QueuedRequest
from worker.active import ActiveRequest, failure_suspects


def active(request_id: str, *, survived: int = 0, prior: int = 0) -> ActiveRequest:
    request = QueuedRequest(id=request_id, model="m", prompt_token_ids=[1, 2])
    return ActiveRequest(request, "stream", "1-0", steps_survived=survived, prior_token_ids=list(range(prior)))


def test_a_newcomer_is_the_suspect_beside_requests_that_ran_steps_here() -> None:
    assert failure_suspects([active("old", survived=5), active("new")]) == {"new"}


def test_a_resumed_request_that_produced_tokens_is_cleared_when_taken_over_with_the_poison() -> None:
    # The failure CI saw: the innocent, handed back uncharged, was taken over in the same pass as
    # the poison and joined the same first step; both were newcomers, and both were charged.
    batch = [active("innocent", prior=4), active("poison")]
    assert failure_suspects(batch) == {"poison"}


def test_resumed_newcomers_are_suspects_when_no_fresh_one_is_in_the_batch() -> None:
    batch = [active("a", prior=4), active("b", prior=9), active("c", survived=3)]
    assert failure_suspects(batch) == {"a", "b"}


def test_everyone_is_a_suspect_when_no_request_is_new() -> None:
    assert failure_suspects([active("a", survived=1), active("b", survived=7)]) == {"a", "b"}
