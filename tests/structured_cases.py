"""JSON schemas and regexes the structured-output tests generate against: one per feature of JSON
Schema that a constraint must honour. Strings and arrays are bounded and the recursion is
optional, so even the tiny random model's outputs end (a constraint forces what is valid, not
that it is short)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

_POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_with_bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "numbers_with_bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "string_pattern_and_format": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "day": {"type": "string", "format": "date"},
        },
        "required": ["code", "day"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"s": {"type": "string", "maxLength": 5}},
                "required": ["s"],
                "additionalProperties": False,
            },
        ]
    },
    "refs_and_defs": {
        "$defs": {"point": _POINT},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "recursive_list": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 4},
                    "next": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]},
                },
                "required": ["name", "next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/item",
    },
}

REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    r"\+?[0-9]{1,3}\.[0-9]{2}",
    r"(ab|cd)+x",
]

PROMPTS = ["Give me JSON.", "hello", "The answer is", "data:", "Once upon a time"]


def validate(text: str, schema: dict[str, Any]) -> None:
    """Raises unless ``text`` is JSON valid under ``schema`` (formats checked too)."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.validate(json.loads(text), schema, format_checker=checker)


def full_match(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None
