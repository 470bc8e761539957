"""JSON Schema -> regular expression, for grammar-constrained decoding (grammar.py).

Covers what structured-output requests use: object (properties in the declared order, required
ones mandatory, no extra properties), array (items, minItems, maxItems), string (minLength,
maxLength, pattern, enum, the formats date, time, date-time and uuid), integer, number, boolean,
null, enum, const, anyOf / oneOf, a type list, allOf of one schema, and local $ref to $defs /
definitions (not recursive). Numeric bounds are not enforced by the grammar. Anything else raises
ValueError naming the construct, rather than silently allowing more than the schema does."""

from __future__ import annotations

import json
import re
from typing import Any

WHITESPACE = r"[ ]?"  # as compact JSON with ", " / ": " separators writes it
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
FORMATS = {
    "date": r'"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"',
    "time": r'"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})?"',
    "date-time": (
        r'"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]'
        r'(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})?"'
    ),
    "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
}
_IGNORED = {"title", "description", "examples", "default", "$schema", "$id", "$comment", "$defs", "definitions"}
_NUMERIC_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "format"}


def json_schema_to_regex(schema: dict[str, Any] | bool, whitespace: str = WHITESPACE) -> str:
    return _Converter(schema if isinstance(schema, dict) else {}, whitespace).convert(schema, depth=0)


def _literal(value: Any) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


class _Converter:
    def __init__(self, root: dict[str, Any], whitespace: str) -> None:
        self.root = root
        self.ws = whitespace

    def convert(self, schema: dict[str, Any] | bool, depth: int) -> str:
        if depth > 32:
            raise ValueError("json schema nests too deeply (recursive $ref?)")
        if schema is True or schema == {}:
            raise ValueError("json schema allows any value here; give it a type")
        if schema is False or not isinstance(schema, dict):
            raise ValueError(f"unsupported json schema {schema!r}")
        if "$ref" in schema:
            return self.convert(self._resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            return "(?:" + "|".join(_literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(?:" + "|".join(self.convert(s, depth + 1) for s in schema[key]) + ")"
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise ValueError("allOf with more than one schema is not supported")
            return self.convert(schema["allOf"][0], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(?:" + "|".join(self.convert({**schema, "type": t}, depth + 1) for t in kind) + ")"
        if kind is None:
            kind = "object" if "properties" in schema else None
        handler = {
            "object": self._object,
            "array": self._array,
            "string": self._string,
            "integer": lambda s, d: self._scalar(s, INTEGER),
            "number": lambda s, d: self._scalar(s, NUMBER),
            "boolean": lambda s, d: self._scalar(s, "(?:true|false)"),
            "null": lambda s, d: self._scalar(s, "null"),
        }.get(kind or "")
        if handler is None:
            raise ValueError(f"unsupported json schema type {kind!r}")
        return handler(schema, depth)

    def _resolve(self, ref: str) -> dict[str, Any]:
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if ref.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"only local $ref to $defs or definitions is supported, got {ref!r}")
        found = self.root.get(prefix[2:-1], {}).get(ref[len(prefix) :])
        if found is None:
            raise ValueError(f"unresolved $ref {ref!r}")
        return found

    def _check(self, schema: dict[str, Any], allowed: set[str]) -> None:
        unknown = set(schema) - allowed - _IGNORED - {"type"}
        if unknown:
            raise ValueError(f"unsupported json schema keywords: {', '.join(sorted(unknown))}")

    def _scalar(self, schema: dict[str, Any], pattern: str) -> str:
        self._check(schema, _NUMERIC_BOUNDS)
        return pattern

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        self._check(schema, {"minLength", "maxLength", "pattern", "format"})
        if "pattern" in schema:
            return '"(?:' + schema["pattern"].removeprefix("^").removesuffix("$") + ')"'
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise ValueError(f"unsupported string format {schema['format']!r}")
            return FORMATS[schema["format"]]
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        count = "*" if low == 0 and high is None else f"{{{low},{'' if high is None else high}}}"
        return '"' + STRING_CHAR + count + '"'

    def _array(self, schema: dict[str, Any], depth: int) -> str:
        self._check(schema, {"items", "minItems", "maxItems"})
        item = self.convert(schema.get("items", {}), depth + 1)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        sep = self.ws + "," + self.ws
        if high == 0:
            return r"\[" + self.ws + r"\]"
        more = f"(?:{sep}{item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        body = f"{item}{more}"
        return r"\[" + self.ws + (f"(?:{body})?" if low == 0 else body) + self.ws + r"\]"

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        self._check(schema, {"properties", "required", "additionalProperties"})
        if schema.get("additionalProperties") not in (None, False) and not schema.get("properties"):
            raise ValueError("objects need declared properties (free-form additionalProperties is not supported)")
        required = set(schema.get("required", []))
        props = [
            (self.ws + _literal(name) + self.ws + ":" + self.ws + self.convert(sub, depth + 1), name in required)
            for name, sub in schema.get("properties", {}).items()
        ]
        sep = self.ws + ","

        def after_first(i: int) -> str:
            # A property has been written, so every later one is "comma + property", optional or not.
            return "".join(f"{sep}{p}" if req else f"(?:{sep}{p})?" for p, req in props[i:])

        def from_start(i: int) -> str:
            # Nothing written yet: the first property present carries no comma.
            if i == len(props):
                return ""
            prop, req = props[i]
            if req:
                return prop + after_first(i + 1)
            rest = from_start(i + 1)
            return f"(?:{prop}{after_first(i + 1)}" + (f"|{rest})" if rest else ")?")

        return r"\{" + from_start(0) + self.ws + r"\}"
