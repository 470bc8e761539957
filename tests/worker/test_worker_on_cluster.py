"""The worker's key tests again, on a real Redis Cluster: 3 masters and 3
replicas started by the session's ``redis_cluster`` fixture. The same test functions run on the
standalone Redis in their own modules; here ``redis_backend`` points every client and worker
process at the Cluster (INFLIGHTQ_REDIS_CLUSTER=true, INFLIGHTQ_REDIS_URL = one node).

Chosen to cover each path whose keys meet in a script or a pipeline: submit and the depth check,
stream (log replay + sharded pub/sub), cancel, priorities, deadlines, crash takeover with SIGKILL (the
dead worker's heartbeat stops: its entries are claimed in the model's slot), a reused request id
(CREATE refuses it in the request's slot, the queue entry lives in the model's)."""

from __future__ import annotations

import pytest

from tests.faults.test_drain_and_ids import (  # noqa: F401
    test_a_reused_request_id_is_refused_and_the_original_is_untouched,
)
from tests.faults.test_worker_death import (  # noqa: F401
    test_a_killed_workers_stream_continues_within_5_s_at_the_defaults,
)
from tests.worker.test_priority import test_a_full_worker_takes_an_urgent_request_within_a_few_steps  # noqa: F401
from tests.worker.test_worker import (  # noqa: F401
    test_a_late_subscriber_gets_the_whole_stream,
    test_a_worker_serves_a_request_and_stores_its_result,
    test_cancel_mid_generation_frees_the_slot_and_acknowledges,
    test_deadlines_expire_queued_and_running_requests,
    test_kill_9_mid_generation_is_taken_over_with_identical_output,
)

pytestmark = pytest.mark.timeout(300)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster
