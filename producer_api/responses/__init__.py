"""OpenAI's Responses API (/v1/responses), durable on the queue.

``models.py``: the request body and what we refuse; ``store.py``: a stored response in Redis;
``objects.py``: response objects and the numbered stream events; ``routes.py``: the routes."""
