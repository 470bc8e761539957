"""How a request's events reach whoever follows it: at-least-once on the wire, exactly-once
to the reader.

A worker appends each event to the request's replay log, then publishes it on the request's
token channel (``PUBLISH_TOKENS``, and ``FINISH`` in ``shared.request_lifecycle`` for the
terminal event). A follower subscribes first, replays the log, then follows live; the
``EventSequencer`` merges both into one ordered stream without gaps or duplicates, keyed by
token index (a taken-over request may republish, pub/sub and the log overlap)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from shared.schemas import AnyEvent, DoneEvent, ErrorEvent, TokenEvent, parse_event
from shared.settings import Settings

# Field name of the one JSON event in a replay-log entry.
LOG_FIELD = "e"
# Index past any real token: following from here yields only the terminal event.
TERMINAL_ONLY = sys.maxsize
# Replay-log entries read per round trip when catching up.
CATCH_UP_COUNT = 512

# KEYS: replay log and token channel of each event, in pairs, all of one slot.
# ARGV: log maxlen, ttl, publish command (PUBLISH, or SPUBLISH on a Cluster), event JSONs.
# One call per slot per round trip (on a single Redis, one call in all): redis-py packs one
# command with many arguments far faster than many commands, and the per-token work (log first,
# then publish) runs inside Redis.
PUBLISH_TOKENS = """
local maxlen, ttl, publish = ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV do
  local log = KEYS[2 * (i - 4) + 1]
  redis.call('XADD', log, 'MAXLEN', '~', maxlen, '*', 'e', ARGV[i])
  redis.call('EXPIRE', log, ttl)
  redis.call(publish, KEYS[2 * (i - 4) + 2], ARGV[i])
end
return #ARGV - 3
"""


def publish_command(settings: Settings) -> str:
    """What the scripts publish events with: on a Cluster a sharded channel (SPUBLISH, Redis 7),
    so an event goes to the one node that owns its request's slot instead of to every node."""
    return "SPUBLISH" if settings.redis_cluster else "PUBLISH"


def log_maxlen(settings: Settings) -> int:
    """Replay logs keep every event of the longest allowed generation (resume needs them all)."""
    return settings.max_new_tokens + 16


def parse_log_entry(fields: dict[str, str]) -> AnyEvent | None:
    raw = fields.get(LOG_FIELD)
    if raw is None:
        return None
    try:
        return parse_event(raw)
    except ValueError:
        return None


def accept_log_entries(sequencer: EventSequencer, entries: list[tuple[str, dict[str, str]]]) -> list[AnyEvent]:
    """Feeds one XRANGE reply of a replay log to ``sequencer``; what it yields, in order."""
    out: list[AnyEvent] = []
    for entry_id, fields in entries:
        sequencer.last_log_id = entry_id
        event = parse_log_entry(fields)
        if event is not None:
            out += sequencer.accept(event, from_log=True)
    return out


@dataclass
class EventSequencer:
    """Puts events from the replay log and from pub/sub into one ordered, duplicate-free stream.

    Token events are keyed by index: anything below the next expected index was already
    delivered (a taken-over request may republish, pub/sub and the log overlap). A live event
    ahead of the next index means the follower missed something; ``gap`` tells the caller to
    read the log first."""

    next_index: int = 0
    last_log_id: str = "0-0"
    finished: bool = False
    gap: bool = False
    terminal: AnyEvent | None = None

    def accept(self, event: AnyEvent, *, from_log: bool) -> list[AnyEvent]:
        if self.finished:
            return []
        if isinstance(event, TokenEvent):
            if event.index < self.next_index:
                return []
            if event.index > self.next_index and not from_log:
                self.gap = True
                return []
            # A hole inside the log itself (trimmed log) cannot be filled: move on past it.
            self.next_index = event.index + 1
            return [event]
        if not from_log and self.next_index < tokens_before(event):
            self.gap = True  # the end, seen live before some of its tokens: read them first
            return []
        self.finished = True
        self.terminal = event
        return [event]


def tokens_before(event: DoneEvent | ErrorEvent) -> int:
    if isinstance(event, DoneEvent):
        return len(event.result.token_ids)
    return event.index or 0
