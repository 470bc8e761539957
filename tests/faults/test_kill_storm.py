"""Worker SIGKILL storms: three workers, repeated kills while requests run. Nothing accepted is
lost, nothing completes twice, and a follower sees every token once, in order."""

from __future__ import annotations

import signal
import threading
import time

from shared.request_lifecycle import RequestStatus
from shared.schemas import DoneEvent, TokenEvent
from tests.faults.conftest import scale
from tests.worker.conftest import greedy
from tests.worker.test_worker import prompt, tokens_sent, wait_for


def test_repeated_sigkills_lose_and_duplicate_nothing(spawn_worker, client, reference) -> None:
    requests, kills, n = scale(30, 200), scale(3, 8), 200
    model = client.settings.model
    # Four sequences a worker: requests queue, so every kill finds work running and more waiting.
    few = {"INFLIGHTQ_MAX_NUM_SEQS": "4", "INFLIGHTQ_PREFETCH_SEQS": "0"}
    workers = [spawn_worker(f"w{i}", env=few) for i in range(3)]
    ids = [client.submit(model, prompt(i % 4), greedy(n)) for i in range(requests)]
    followed: dict[str, list] = {rid: [] for rid in ids[:5]}
    followers = [
        threading.Thread(target=lambda r=rid: followed[r].extend(client.stream(r, timeout=600))) for rid in followed
    ]
    for thread in followers:
        thread.start()
    started = time.monotonic()
    done_kills = 0

    def total_sent() -> int:
        return sum(tokens_sent(client, rid) for rid in ids)

    for k in range(kills):
        try:
            wait_for(lambda: any(0 < tokens_sent(client, rid) < n for rid in ids), timeout=60)
        except AssertionError:
            break  # everything finished already: nothing left to kill
        done_kills += 1
        victim = workers.pop(k % len(workers))
        victim.signal(signal.SIGKILL)
        victim.wait(timeout=10)
        sent = total_sent()
        workers.append(spawn_worker(f"w{3 + k}", env=few, ready=False))
        # The next kill once the survivors have carried on generating (or there is nothing left to run).
        wait_for(lambda sent=sent: total_sent() > sent or total_sent() == requests * n, timeout=120)
    results = {rid: client.result(rid, timeout=600) for rid in ids}
    elapsed = time.monotonic() - started
    for thread in followers:
        thread.join(timeout=120)
    lost = duplicated = taken_over = 0
    for i, rid in enumerate(ids):
        info = client.status(rid)
        lost += info is None or info.status is not RequestStatus.DONE
        taken_over += bool(info and info.attempt > 0)
        assert results[rid].token_ids == reference(prompt(i % 4), n)
        log = client.redis.xrange(client.keys.replay_log(rid))
        duplicated += sum('"type":"done"' in fields["e"] for _, fields in log) != 1
    for rid, events in followed.items():
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == list(range(n)), rid
        assert isinstance(events[-1], DoneEvent)
    assert lost == 0 and duplicated == 0
    assert taken_over >= 1 and done_kills >= 1
    print(
        f"FAULTS kill storm: {requests} requests, {done_kills} SIGKILLs, {taken_over} taken over, lost {lost}, "
        f"duplicated {duplicated}, all done {elapsed:.1f} s after the first request"
    )
