"""The thin HTTP front: validates, tokenizes, enqueues through ``shared``'s queue client and relays tokens.

It loads a tokenizer per served model (chat templates, token limits), never a model.

Where things are:

- ``tgi/``, ``openai/``, ``responses/``, ``jobs/``: one package per API dialect, each with its request
  models (``models.py``), routes (``routes.py``) and, where it has its own wire shapes, ``formatting.py``
  (its SSE formatter).
- ``batches/``: OpenAI's Files and Batch APIs: files, the batch store, line parsing, the RQ job, routes.
- ``app.py``: ``create_app(settings)``, the lifespan (tokenizers, Redis, queue client), wiring.
- ``state.py``: what the app holds; ``middleware.py``: request metrics and the body-size limit (413).
- ``api_keys.py``: API keys, priority ceilings, the shared per-key rate limit; ``auth.py``: the
  dependency that authenticates a request.
- ``errors.py``: the one mapping of failures to HTTP responses, in the dialect (TGI's or OpenAI's)
  that each router declares by its route class.
- ``models_common.py``: what every request body accepts; ``validation.py`` and ``tokenization.py``:
  the checks the dialects share (priority, deadlines, stops, TGI's token limits).
- ``dispatch.py``: dispatch (to a live worker), follow events, cancel what a client left;
  ``streaming.py``: merging n choices, watching for a client leaving.
- ``relay.py``: the one SSE relay, events -> a dialect formatter's frames; ``sse.py``: SSE framing and
  the stream response (keep-alive, the client leaving).
- ``routes_ops.py``: /health and /metrics;
  ``timing.py``: TGI's timing headers; ``metrics.py``, ``queue_metrics.py``: Prometheus metrics
  of the API and gauges of the queues.
"""
