"""OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models.

``models.py``: request and response bodies; ``formatting.py``: queue events -> OpenAI's chunks and
usage; ``routes.py``: the routes."""
