"""Redis work written as plans, so that one piece of logic serves a sync and an asyncio client.

A plan is a generator that yields ops (``Call``, ``Pipeline``, ``RunScript``, ``Pause``, or
``Emit`` for events to hand out), receives each op's reply at its ``yield`` (or the error the op
raised, as an exception there, which it may catch), and returns its result. A plan does no I/O:
a front steps it with ``Plan`` and issues each op with ``start``, awaiting the reply or not."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from shared.event_delivery import AnyEvent

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One command: ``redis.<method>(*args, **kwargs)``, or on the follower's pub/sub."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    on_pubsub: bool = False


def call(method: str, *args: Any, **kwargs: Any) -> Call:
    return Call(method, args, kwargs)


def pubsub_call(method: str, *args: Any, **kwargs: Any) -> Call:
    return Call(method, args, kwargs, on_pubsub=True)


@dataclass(frozen=True)
class Pipeline:
    """Several commands in one round trip (no transaction); the reply is the list of theirs."""

    calls: list[Call]
    raise_on_error: bool = True


@dataclass(frozen=True)
class RunScript:
    lua: str
    keys: list[str]
    args: list[Any]


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Emit:
    """Events for the caller of ``stream``, in order."""

    events: list[AnyEvent]


Op = Call | Pipeline | RunScript | Pause | Emit
Steps = Generator[Op, Any, T]


def start(
    op: Call | Pipeline | RunScript | Pause,
    redis_client: Any,
    pubsub: Any,
    scripts: dict[str, Any],
    sleep: Callable[[float], Any],
) -> Any:
    """Issues ``op`` on a front's objects: its reply from redis-py's sync client, an awaitable
    of it from redis.asyncio."""
    if isinstance(op, Call):
        return getattr(pubsub if op.on_pubsub else redis_client, op.method)(*op.args, **op.kwargs)
    if isinstance(op, Pipeline):
        pipe = redis_client.pipeline(transaction=False)
        for queued in op.calls:
            getattr(pipe, queued.method)(*queued.args, **queued.kwargs)
        return pipe.execute(raise_on_error=op.raise_on_error)
    if isinstance(op, RunScript):
        return scripts[op.lua](keys=op.keys, args=op.args)
    return sleep(op.seconds)


class Plan(Generic[T]):
    """Steps one plan for a front: ``next()`` gives the next op (None once it returned, its
    result in ``value``); the front hands back the op's reply (``reply``) or error (``fail``)."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._reply: Any = None
        self._error: Exception | None = None
        self.value: T | None = None

    def next(self) -> Op | None:
        reply, error = self._reply, self._error
        self._reply = self._error = None
        try:
            return self._steps.throw(error) if error is not None else self._steps.send(reply)
        except StopIteration as stop:
            self.value = stop.value
            return None

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, error: Exception) -> None:
        self._error = error
