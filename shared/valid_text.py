"""Text a tokenizer can take: valid Unicode. JSON's "\\ud800" escapes decode to lone surrogates,
which a Python str holds but no tokenizer, UTF-8 encoder or JSON writer takes; they are refused
where text enters (every request body, every batch line) with an error naming the field."""

from __future__ import annotations

import re
from typing import Any

from shared.errors import ValidationError

# A surrogate code point left in a str: JSON decoding joins every valid pair into one code point.
_SURROGATE = re.compile("[\ud800-\udfff]")


def is_valid_text(text: str) -> bool:
    """Whether ``text`` holds no lone surrogate (what JSON escapes and surrogateescape-decoded bytes leave)."""
    return _SURROGATE.search(text) is None


def invalid_text_at(value: Any, path: str = "") -> str | None:
    """The dotted path (``messages.0.content``) of the first string in ``value``, its dicts' keys
    and values and its lists' items, that is not valid Unicode (a bad key: its dict's path); None
    when every one is. Iterative: a body nested as deep as JSON allows is walked too."""
    pending: list[tuple[str, Any]] = [(path, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            if not is_valid_text(item):
                return where or "body"
        elif isinstance(item, dict):
            if any(isinstance(key, str) and not is_valid_text(key) for key in item):
                return where or "body"
            pending.extend((f"{where}.{key}" if where else str(key), v) for key, v in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend((f"{where}.{i}" if where else str(i), v) for i, v in reversed(list(enumerate(item))))
    return None


def check_text(value: Any, path: str = "") -> None:
    """A ValidationError naming the first field of ``value`` whose text is not valid Unicode."""
    field = invalid_text_at(value, path)
    if field is not None:
        raise ValidationError(f"{field}: not valid Unicode text (a lone surrogate such as \\ud800)", field=field)
