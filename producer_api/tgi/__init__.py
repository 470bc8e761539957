"""TGI's API: POST /, /generate, /generate_stream, /tokenize, /info (and /health's body).

``models.py``: request and response bodies; ``formatting.py``: queue events -> TGI's wire shapes
(the jobs stream uses them too); ``routes.py``: the routes."""
