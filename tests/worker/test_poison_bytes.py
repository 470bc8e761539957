"""A stream entry that is not even text (non-UTF-8 bytes, as a buggy producer or a corrupted
copy could write) must cost the worker that entry only: it is dead-lettered and every valid
request, in that stream and in the others, is served. (Valid-UTF-8 garbage is covered by
test_worker.py's poison test.)"""

from __future__ import annotations

import pytest
import redis

from shared.keys import CONSUMER_GROUP
from shared.request_lifecycle import RequestStatus
from shared.work_queue import STREAM_FIELD
from tests.worker.conftest import greedy
from tests.worker.test_worker import PROMPT, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_a_non_utf8_entry_in_the_most_urgent_stream_is_dead_lettered_and_the_worker_keeps_serving(
    spawn_worker, client, redis_url, reference
) -> None:
    model = client.settings.model
    client.ensure_groups(model)
    raw = redis.Redis.from_url(redis_url)  # no decoding: the bytes go in as they are
    urgent = client.keys.stream(model, 0)
    raw.xadd(urgent, {STREAM_FIELD: b"\xff\xfe{\x80 not text"})
    raw.xadd(urgent, {b"\xc3\x28": b"\xa0\xa1"})  # a field name that is not UTF-8 either
    raw.close()
    spawn_worker("sturdy")
    p0 = client.submit(model, PROMPT, greedy(3), priority=0)
    p2 = client.submit(model, PROMPT[:3], greedy(4), priority=2)
    assert client.result(p0, timeout=45).token_ids == reference(PROMPT, 3)
    assert client.result(p2, timeout=45).token_ids == reference(PROMPT[:3], 4)
    assert client.status(p0).status is RequestStatus.DONE  # type: ignore[union-attr]
    # Both bad entries end in the dead letters (with a reason), none stays pending in the stream.
    wait_for(lambda: len(client.dead_letters(model)) == 2, timeout=30)
    assert all(fields.get("letter") for fields in client.dead_letters(model))
    assert client.redis.xpending(urgent, CONSUMER_GROUP)["pending"] == 0
    assert client.redis.xlen(urgent) == 0
