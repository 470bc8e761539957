"""Following token channels: what ``QueueCore.follow`` subscribes with.

A follower needs two calls: ``subscribe(channel, timeout)``, which returns once Redis confirmed the
subscription (the replay log may only be read after that), and ``get_message(timeout)``, which
returns the next event's JSON or None (silence, or "check the log": the connection was
re-established and events may have passed meanwhile).

- ``ChannelHub`` (asyncio; the API and ``AsyncQueueClient``): ONE pub/sub connection per Redis
  node for the whole process, shared by every stream it follows; each message is handed to the
  queues of the followers of its channel: however many streams are open, one connection per node.
  On a Cluster, channels are sharded (SSUBSCRIBE on the node that owns the channel's slot,
  found by redis-py's Cluster client); when a node's connection fails (failover) or the node gives
  a channel's slot away, the hub asks the Cluster client for the current owners, subscribes there,
  and tells the channels' followers to check their logs.
- ``StreamSubscription`` (sync; ``QueueClient``): one pub/sub connection per followed stream, as
  a script or a test wants it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from shared.errors import SlowReaderError
from shared.redis_connect import is_cluster_client

log = logging.getLogger("inflightq.subscriptions")

# A message that tells a follower to check its log now (its channel was re-subscribed).
CHECK = None
# Bound on one re-subscription attempt after a node failed.
_RESUBSCRIBE_PAUSE_S = 0.2


class _Overflowed:
    """Takes the place of a follower's unread messages once they passed its byte budget."""


OVERFLOWED = _Overflowed()


class _Follower:
    """One follower's unread messages, at most ``max_bytes`` of them: past that they are dropped
    and the follower learns it fell behind (``SlowReaderError``) when it next reads."""

    def __init__(self, max_bytes: int) -> None:
        self.queue: asyncio.Queue[str | _Overflowed | None] = asyncio.Queue()
        self.max_bytes = max_bytes
        self.unread_bytes = 0
        self.overflowed = False

    def put(self, data: str) -> None:
        if self.overflowed:
            return
        self.unread_bytes += len(data)
        if self.unread_bytes <= self.max_bytes:
            self.queue.put_nowait(data)
            return
        self.overflowed = True
        self.unread_bytes = 0
        while not self.queue.empty():  # the unread messages go now, not when the reader comes back
            self.queue.get_nowait()
        self.queue.put_nowait(OVERFLOWED)

    async def get(self) -> str | None:
        item = await self.queue.get()
        if isinstance(item, _Overflowed):
            raise SlowReaderError(
                f"the client read too slowly: more than {self.max_bytes} bytes of events waited unread, "
                "so the stream was dropped"
            )
        if item is not None:
            self.unread_bytes -= len(item)
        return item


@dataclass
class _NodeListener:
    """One node's pub/sub connection and the task that reads it."""

    name: str
    pubsub: PubSub
    sharded: bool
    channels: set[str] = field(default_factory=set)
    confirmed: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    # Replies still due to our own (S)UNSUBSCRIBEs, per channel. On a Cluster, Redis also sends an
    # sunsubscribe of its own when a slot moves away; the reply to ours looks the same, and taking
    # it for a move (while a new follower subscribes to the channel again) would drop that
    # follower's confirmation: its stream would wait SUBSCRIBE_S and end early.
    unsubscribing: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    async def subscribe(self, channel: str) -> asyncio.Future[None]:
        future = self.confirmed.get(channel)
        if future is None or (future.done() and future.exception() is not None):
            future = self.confirmed[channel] = asyncio.get_running_loop().create_future()
            try:
                await (self.pubsub.ssubscribe(channel) if self.sharded else self.pubsub.subscribe(channel))
            except BaseException:
                self.confirmed.pop(channel, None)
                raise
            self.channels.add(channel)  # the reader starts once there is something to read
        return future

    async def unsubscribe(self, channel: str) -> None:
        self.channels.discard(channel)
        self.confirmed.pop(channel, None)
        # Counted before sending: the reader may see the reply as soon as the command is out.
        self.unsubscribing[channel] = self.unsubscribing.get(channel, 0) + 1
        try:
            await (self.pubsub.sunsubscribe(channel) if self.sharded else self.pubsub.unsubscribe(channel))
        except BaseException:
            self.replied(channel)  # not sent (the connection failed): no reply will come
            raise

    def replied(self, channel: str) -> bool:
        """Takes one of our unsubscriptions' replies off the count: whether an (s)unsubscribe message
        of ``channel`` was such a reply (Redis answers each channel of a command once, in order)."""
        due = self.unsubscribing.get(channel, 0)
        if due == 0:
            return False
        if due == 1:
            del self.unsubscribing[channel]
        else:
            self.unsubscribing[channel] = due - 1
        return True


class ChannelHub:
    """One subscriber per process (see the module's docstring)."""

    def __init__(self, client: aioredis.Redis | Any, max_unread_bytes: int = 1024 * 1024) -> None:
        self.client = client
        self.max_unread_bytes = max_unread_bytes  # per follower (``_Follower``)
        self._tasks: set[asyncio.Task[None]] = set()
        self.sharded = is_cluster_client(client)
        self._followers: dict[str, set[_Follower]] = {}
        self._nodes: dict[str, _NodeListener] = {}
        self._node_of: dict[str, str] = {}  # channel -> node name
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def connections(self) -> int:
        """Pub/sub connections held (one per node with followed channels)."""
        return len(self._nodes)

    @property
    def channels(self) -> int:
        return len(self._followers)

    def subscription(self) -> HubSubscription:
        return HubSubscription(self)

    async def add(self, channel: str, follower: _Follower, timeout: float) -> None:
        async with self._lock:
            self._followers.setdefault(channel, set()).add(follower)
            listener = await self._listener_for(channel)
            confirmed = await listener.subscribe(channel)
            self._node_of[channel] = listener.name
        await asyncio.wait_for(asyncio.shield(confirmed), timeout)

    async def remove(self, channel: str, follower: _Follower) -> None:
        async with self._lock:
            followers = self._followers.get(channel)
            if followers is None:
                return
            followers.discard(follower)
            if followers:
                return
            del self._followers[channel]
            listener = self._nodes.get(self._node_of.pop(channel, ""))
            if listener is not None:
                with contextlib.suppress(redis.RedisError, OSError):
                    await listener.unsubscribe(channel)

    async def close(self) -> None:
        self._closed = True
        for listener in list(self._nodes.values()):
            await self._drop(listener)

    # Nodes ---------------------------------------------------------------------------------
    async def _listener_for(self, channel: str) -> _NodeListener:
        if self.sharded:
            # The Cluster client learns the slots' owners on its first command; a stream may be a
            # fresh client's first use (else SlotNotCoveredError). A no-op once initialised.
            await self.client.initialize()
            node = self.client.get_node_from_key(channel)
            name, host, port = node.name, node.host, node.port
        else:
            name, host, port = "standalone", None, None
        listener = self._nodes.get(name)
        if listener is None:
            if self.sharded:
                kwargs = self.client.get_connection_kwargs()
                node_client = aioredis.Redis(host=host, port=port, **_node_kwargs(kwargs))
                pubsub = node_client.pubsub()
            else:
                pubsub = self.client.pubsub()
            listener = self._nodes[name] = _NodeListener(name, pubsub, self.sharded)
            # Read before the first subscription's confirmation can arrive.
            listener.task = asyncio.ensure_future(self._read(listener))
        return listener

    async def _read(self, listener: _NodeListener) -> None:
        while not self._closed:
            try:
                if not listener.channels:
                    await asyncio.sleep(0.05)
                    continue
                message = await listener.pubsub.get_message(timeout=None)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the node is gone, or failed over: find the channels a home
                if self._closed:
                    return
                log.warning("pub/sub connection to %s failed (%s); re-subscribing", listener.name, error)
                await self._relocate(listener)
                return
            if message is not None:
                await self._dispatch(listener, message)

    async def _dispatch(self, listener: _NodeListener, message: dict[str, Any]) -> None:
        kind, channel = message["type"], message.get("channel")
        if kind in ("message", "smessage"):
            for follower in self._followers.get(channel, ()):
                follower.put(message["data"])
        elif kind in ("subscribe", "ssubscribe"):
            future = listener.confirmed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
        elif kind in ("unsubscribe", "sunsubscribe") and listener.replied(channel):
            pass  # the reply to our own unsubscription (its follower left), not a slot move
        elif kind == "sunsubscribe" and channel in self._followers and channel in listener.channels:
            # Not ours: the node gave the channel's slot away (resharding, or it became a replica).
            listener.channels.discard(channel)
            listener.confirmed.pop(channel, None)
            task = asyncio.ensure_future(self._resubscribe([channel]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _relocate(self, listener: _NodeListener) -> None:
        """Moves a failed node's channels to whichever nodes own them now."""
        channels = [c for c in listener.channels if c in self._followers]
        await self._forget(listener)
        await self._resubscribe(channels)

    async def _forget(self, listener: _NodeListener) -> None:
        async with self._lock:
            if self._nodes.get(listener.name) is listener:
                del self._nodes[listener.name]
        await self._drop(listener)

    async def _resubscribe(self, channels: list[str]) -> None:
        while channels and not self._closed:
            if self.sharded:
                with contextlib.suppress(Exception):
                    await self.client.nodes_manager.initialize()
            left = []
            for channel in channels:
                listener = None
                try:
                    async with self._lock:
                        if channel not in self._followers:
                            continue
                        listener = await self._listener_for(channel)
                        confirmed = await listener.subscribe(channel)
                        self._node_of[channel] = listener.name
                    await asyncio.wait_for(asyncio.shield(confirmed), 5.0)
                except Exception:
                    left.append(channel)
                    if listener is not None and not listener.channels:
                        await self._forget(listener)  # a node that is not back (yet)
                    continue
                for follower in self._followers.get(channel, ()):
                    follower.queue.put_nowait(CHECK)
            channels = left
            if channels:
                await asyncio.sleep(_RESUBSCRIBE_PAUSE_S)

    async def _drop(self, listener: _NodeListener) -> None:
        if listener.task is not None and listener.task is not asyncio.current_task():
            listener.task.cancel()
            with contextlib.suppress(BaseException):
                await listener.task
        for future in listener.confirmed.values():
            if not future.done():
                future.set_exception(redis.ConnectionError(f"pub/sub connection to {listener.name} lost"))
                future.exception()  # retrieved: nobody may be waiting
        with contextlib.suppress(Exception):
            await listener.pubsub.aclose()


def _node_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A node's pub/sub connection: the Cluster client's options (its name too: CLIENT LIST counts
    it with the process's other connections), few retries (a dead node must fail fast, so its
    channels move to the promoted replica)."""
    keep = (
        "username",
        "password",
        "ssl",
        "decode_responses",
        "encoding",
        "encoding_errors",
        "socket_connect_timeout",
        "client_name",
    )
    out = {k: kwargs[k] for k in keep if k in kwargs}
    out.setdefault("socket_connect_timeout", 2.0)
    return out


class HubSubscription:
    """One follower's view of the hub: the two calls of ``QueueCore.follow``."""

    def __init__(self, hub: ChannelHub) -> None:
        self.hub = hub
        self.follower = _Follower(hub.max_unread_bytes)
        self.channels: list[str] = []

    async def subscribe(self, channel: str, timeout: float) -> None:
        self.channels.append(channel)
        await self.hub.add(channel, self.follower, timeout)

    async def get_message(self, timeout: float) -> str | None:
        try:
            return await asyncio.wait_for(self.follower.get(), timeout)
        except TimeoutError:
            return None

    async def aclose(self) -> None:
        for channel in self.channels:
            await self.hub.remove(channel, self.follower)
        self.channels = []

    async def __aenter__(self) -> HubSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class StreamSubscription:
    """A sync follower's own pub/sub connection (sharded on a Cluster, through redis-py's
    ClusterPubSub), with the same two calls as ``HubSubscription``."""

    def __init__(self, client: redis.Redis | Any) -> None:
        self.sharded = is_cluster_client(client)
        self.pubsub = client.pubsub()

    def subscribe(self, channel: str, timeout: float) -> None:
        if self.sharded:
            self.pubsub.ssubscribe(channel)
        else:
            self.pubsub.subscribe(channel)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"subscribing to {channel} was not confirmed")
            message = self._read(left)
            if message is not None and message["type"] in ("subscribe", "ssubscribe"):
                return

    def get_message(self, timeout: float) -> str | None:
        message = self._read(timeout)
        if message is not None and message["type"] in ("message", "smessage"):
            return str(message["data"])
        return None

    def _read(self, timeout: float) -> dict[str, Any] | None:
        if self.sharded:
            return self.pubsub.get_sharded_message(timeout=timeout)  # type: ignore[no-any-return]
        return self.pubsub.get_message(timeout=timeout)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.pubsub.close()

    def __enter__(self) -> StreamSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
