"""The thin HTTP front: validates, tokenizes, enqueues through ``shared``'s queue client and relays tokens.

It loads a tokenizer per served model (chat templates, token limits), never a model.

Where things are:

- ``app.py``: ``create_app(settings)``, the lifespan (tokenizers, Redis, queue client), wiring.
- ``state.py``: what the app holds; ``middleware.py``: request metrics and the body-size limit (413).
- ``auth.py``: API keys, priority ceilings, the shared per-key rate limit.
- ``errors.py``: the one mapping of failures to HTTP responses (TGI's and OpenAI's error bodies).
- ``models_*.py``: request and response bodies per API family; ``validation.py`` and
  ``tokenization.py``: the checks they share (priority, deadlines, stops, TGI's token limits).
- ``dispatch.py``: admission (live worker), submit, follow events, cancel what a client left;
  ``streaming.py``: merging n choices, watching for a client leaving.
- ``routes_tgi.py`` / ``tgi_format.py``, ``routes_openai.py`` / ``openai_format.py``, ``routes_jobs.py``,
  ``routes_ops.py``: the routes, and the wire shapes of their events; ``sse.py``: SSE framing and the
  stream response; ``timing.py``: TGI's timing headers; ``metrics.py``: the API's Prometheus metrics.
- ``routes_files.py``, ``routes_batches.py``, ``queue_metrics.py``: the Batch API and queue gauges.
"""
