"""OpenAI's Batch API on the producer side: files, batches and the RQ job that runs them.

- ``files.py``: uploaded inputs and generated outputs (Redis, or a directory for large ones).
- ``store.py``: batches and their statuses, the one place their state lives.
- ``lines.py``: input lines parsed, and the output and error lines they become.
- ``runner.py``: one run of a batch (lines -> lowest-priority queue requests -> files), safe to repeat.
- ``job.py``: the RQ job around a run, checking lines with the API's own request code.
- ``queue.py``: RQ's part: enqueueing runs, the batch worker, recovering runs that died; create and cancel.
- ``models.py`` / ``routes.py``: the HTTP bodies and routes (/v1/files, /v1/batches).
"""
