"""Strict object schemas, as vLLM's default structured-output backend (xgrammar's strict mode) and
OpenAI's ``strict: true`` read them: an object schema that lists its properties and says nothing
about ``additionalProperties`` admits no other key. Plain JSON Schema admits any extra key there,
and a small model given that room keeps writing keys until its length limit.

An explicit ``additionalProperties`` (``true`` or a schema) is kept, and an object that lists no
properties (``{"type": "object"}``, a free-form mapping) stays open. The members of an ``allOf``
(and of ``if``, ``then``, ``else``, ``not``) are left open themselves: closing one part of an
intersection would forbid the other parts' keys."""

from __future__ import annotations

from typing import Any

# Keywords whose schemas (one, a list, or a mapping by name) describe values nested in the
# instance, or the instance itself as alternatives (anyOf, oneOf): each is closed.
_NESTED = frozenset(
    {
        *("items", "prefixItems", "additionalItems", "unevaluatedItems", "contains"),
        *("additionalProperties", "unevaluatedProperties", "propertyNames", "anyOf", "oneOf"),
    }
)
_NESTED_MAP = frozenset(("properties", "patternProperties", "$defs", "definitions"))
# Keywords whose schemas apply to the parent's instance itself, as an intersection: walked, not closed.
_SAME_INSTANCE = frozenset(("allOf", "not", "if", "then", "else", "dependentSchemas"))


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas that list properties, nested ones included, admit
    only those (``additionalProperties: false``) unless they say otherwise."""
    return _strict(schema, close=True)


def _strict(schema: Any, *, close: bool) -> Any:
    if isinstance(schema, list):
        return [_strict(sub, close=close) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _NESTED_MAP and isinstance(value, dict):
            out[key] = {name: _strict(sub, close=True) for name, sub in value.items()}
        elif key in _NESTED:
            out[key] = _strict(value, close=True)
        elif key == "dependentSchemas" and isinstance(value, dict):
            out[key] = {name: _strict(sub, close=False) for name, sub in value.items()}
        elif key in _SAME_INSTANCE:
            out[key] = _strict(value, close=False)
        else:
            out[key] = value
    lists_keys = "properties" in schema or "patternProperties" in schema
    says = "additionalProperties" in schema or "unevaluatedProperties" in schema
    if close and lists_keys and not says:
        out["additionalProperties"] = False
    return out
