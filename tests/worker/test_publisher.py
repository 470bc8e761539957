"""The publisher's hand-written token JSON is exactly the wire's TokenEvent."""

from __future__ import annotations

from shared.schemas import TokenEvent, TopLogprob, parse_event
from worker.engine import EngineEvent
from worker.publisher import token_json


def test_token_json_round_trips_as_a_token_event() -> None:
    plain = EngineEvent("r", 3, 42, ' hé\n"x"')
    assert parse_event(token_json("r", 3, 42, plain.text, plain, 0)) == TokenEvent(
        request_id="r", index=3, token_id=42, text=' hé\n"x"'
    )
    rich = EngineEvent("r", 4, 7, "", logprob=-0.5, top_logprobs=[(7, "a", -0.5), (8, "b", -1.0)],
                       finish_reason="length", special=True)  # fmt: skip
    assert parse_event(token_json("r", 4, 7, "", rich, 2)) == TokenEvent(
        request_id="r",
        index=4,
        token_id=7,
        special=True,
        logprob=-0.5,
        top_logprobs=[TopLogprob(token_id=7, text="a", logprob=-0.5), TopLogprob(token_id=8, text="b", logprob=-1.0)],
        finish_reason="length",
        attempt=2,
    )


def test_an_expiry_is_not_a_finish_reason_on_the_wire() -> None:
    expired = EngineEvent("r", 5, 9, "", finish_reason="expired")
    assert parse_event(token_json("r", 5, 9, "", expired, 0)).finish_reason is None  # type: ignore[union-attr]
