"""The batch store's tests again, on a real Redis Cluster (the session's ``redis_cluster``: 3
masters + 3 replicas): its records, files, status moves (a Lua script), outcomes and leases all
carry the deployment-wide hash tag, so each script stays in one slot. RQ itself does not run on
a Cluster: a batch worker keeps its queue on the standalone Redis named by
``INFLIGHTQ_RQ_REDIS_URL`` (docs/operations.md), which these tests do not need."""

from __future__ import annotations

import pytest

from tests.batch.test_batch_store import (  # noqa: F401 - collected here again, on the Cluster
    store,
    test_a_batch_keeps_its_input_file_alive_for_its_window,
    test_a_batch_past_its_window_expires_without_queueing_anything,
    test_a_custom_id_maps_to_one_request_id_forever,
    test_a_move_happens_only_from_an_allowed_status,
    test_an_outcome_is_written_and_counted_once,
    test_bad_lines_carry_their_error_and_good_ones_their_body,
    test_batches_list_newest_first_with_cursor,
    test_create_refuses_unknown_endpoints_and_windows,
    test_file_limits_and_purpose,
    test_files_list_newest_first_by_purpose,
    test_files_on_disk_go_when_their_record_expires,
    test_large_files_go_to_the_configured_directory,
    test_small_files_live_in_redis_with_a_ttl,
    test_the_lease_admits_one_run,
)

pytestmark = pytest.mark.timeout(120)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster
