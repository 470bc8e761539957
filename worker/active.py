"""One request while this worker runs it: where it came from and what it has produced so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.schemas import FinalResult, QueuedRequest, Timings, Usage


@dataclass
class ActiveRequest:
    request: QueuedRequest
    stream: str  # the lane or offer stream holding its entry
    entry_id: str
    attempt: int = 0
    started_at: float = field(default_factory=time.time)
    # What earlier attempts already sent (from the replay log); a takeover continues after it.
    prior_token_ids: list[int] = field(default_factory=list)
    prior_text: str = ""
    prior_finish: str | None = None  # the log already holds the last token: only the final write is missing
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None
    share: float = 0.0  # its tenant's virtual time when pulled (the fair part of its urgency)
    steps_survived: int = 0  # engine steps since it was added; 0 makes it a suspect if a step fails

    @property
    def id(self) -> str:
        return self.request.id

    def add(self, token_id: int, text: str) -> None:
        if token_id >= 0:
            self.token_ids.append(token_id)
            if self.first_token_at is None:
                self.first_token_at = time.time()
        self.text += text

    def result(self, finish_reason: str, worker: str) -> FinalResult:
        token_ids = self.prior_token_ids + self.token_ids
        prompt = len(self.request.prompt_token_ids)
        return FinalResult(
            request_id=self.id,
            model=self.request.model,
            text=self.prior_text + self.text,
            token_ids=token_ids,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=prompt, completion_tokens=len(token_ids), total_tokens=prompt + len(token_ids)),
            timings=Timings(
                submitted_at=self.request.submitted_at,
                started_at=self.started_at,
                first_token_at=self.first_token_at,
                finished_at=time.time(),
            ),
            worker=worker,
        )


def failure_suspects(batch: list[ActiveRequest]) -> set[str]:
    """Which requests of a batch whose step raised are charged a delivery for it.

    A poison request usually fails its first step, so the suspects are those that had not yet
    survived a step here. Among them, one resumed with tokens an earlier delivery produced has
    already run fine (typically the batch mate of an earlier failure, handed back uncharged and
    taken over together with the poison): when the batch also holds a newcomer with nothing
    produced yet, only those are charged. With no newcomer at all, everyone is a suspect."""
    newcomers = [a for a in batch if a.steps_survived == 0]
    fresh = {a.id for a in newcomers if not a.prior_token_ids}
    return fresh or {a.id for a in newcomers} or {a.id for a in batch}
