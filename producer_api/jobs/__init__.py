"""Async jobs (/v1/jobs): submit now, poll, stream with Last-Event-ID resume, cancel.

``models.py``: request and response bodies; ``routes.py``: the routes (their stream has TGI's shape)."""
