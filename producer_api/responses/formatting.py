"""A response's SSE stream (``relay.Formatter``): its numbered events (``objects.EventLog``) after
sequence number ``after``, each framed ``id: <sequence_number>``, ``event: <type>``, ``data: <event>``,
so a client resumes with ``starting_after``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from producer_api import sse
from producer_api.responses.objects import EventLog
from shared.errors import InflightqError
from shared.schemas import ErrorEvent, FinalResult, TokenEvent


class ResponseStream:
    def __init__(
        self,
        record: dict[str, Any],
        after: int,
        first_status: str,
        final: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        """``final``: the response object once the request has ended (read back from Redis)."""
        self.log = EventLog(record)
        self.after = after
        self.first_status = first_status
        self.final = final
        self.last = after  # the last sequence number sent
        self.n_tokens: int | None = None  # known once the request is done

    @property
    def resume_index(self) -> int:
        """The first token whose events this stream needs."""
        return self.log.resume_index(self.after)

    def _frames(self, events: list[dict[str, Any]]) -> list[str]:
        frames = []
        for event in events:
            if event["sequence_number"] > self.after:
                self.last = event["sequence_number"]
                frames.append(sse.event(event, event_id=event["sequence_number"], name=event["type"]))
        return frames

    def opening(self) -> list[str]:
        frames = self._frames(self.log.opening(self.first_status))
        self.last = max(self.after, self.log.seq - 1)
        return frames

    def token(self, choice: int, event: TokenEvent) -> list[str]:
        return self._frames(self.log.token(event.index, event.text))

    def done(self, choice: int, result: FinalResult) -> list[str]:
        self.n_tokens = len(result.token_ids)
        return []

    def failed(self, choice: int, event: ErrorEvent) -> list[str]:
        return []  # the response failed or was cancelled: its closing events say so

    async def closing(self) -> list[str]:
        final = await self.final()
        # Cancelled or failed: as many deltas as the replay log holds tokens.
        n_tokens = self.n_tokens if self.n_tokens is not None else (final.get("usage") or {}).get("output_tokens", 0)
        return self._frames(self.log.closing(n_tokens, final))

    def error(self, error: InflightqError) -> list[str]:
        event = {
            "type": "error",
            "sequence_number": self.last + 1,
            "code": error.error_type,
            "message": error.message,
            "param": error.field,
        }
        return [sse.event(event, name="error")]
