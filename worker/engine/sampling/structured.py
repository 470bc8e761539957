"""Structured output: a request's constraint (JSON schema, any JSON object, regex, Lark grammar)
becomes an llguidance matcher that says, before each draw, which tokens keep the output valid.

Per model, one llguidance view of the tokenizer (built once). Per constraint, one compiled
matcher kept as a template and cloned for each request that uses it (a clone is far cheaper than
a compile). Per constrained sequence, one matcher, kept in step with the sequence's
output tokens: it consumes each sampled token, and a request resumed after a crash replays the
tokens it already has into a fresh one. The batch's masks are filled by llguidance's executor,
which drops the GIL, on a helper thread while the model's forward runs."""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import torch

ConstraintKind = Literal["json_schema", "json_object", "regex", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark")
_TEMPLATES = 256  # compiled constraints kept per engine
# Compact JSON (", " and ": " only): with free whitespace a weak model can pad forever. A schema
# may still ask for it with {"x-guidance": {"whitespace_flexible": true}}.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What the output must match. ``value``: a schema (dict or JSON text), a regex, a Lark grammar;
    nothing for ``json_object``."""

    type: ConstraintKind
    value: Any = None

    @classmethod
    def coerce(cls, raw: Constraint | dict[str, Any] | None) -> Constraint | None:
        if raw is None or isinstance(raw, Constraint):
            return raw
        if not isinstance(raw, dict) or raw.get("type") not in KINDS:
            raise ValueError(f"constraint must be {{'type': one of {', '.join(KINDS)}, 'value': ...}}, got {raw!r}")
        return cls(raw["type"], raw.get("value"))

    @property
    def key(self) -> str:
        """The same constraint, however its schema's keys were ordered, gives the same key."""
        return json.dumps([self.type, self.value], sort_keys=True, separators=(",", ":"))

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (compiled and checked by ``LLMatcher``)."""
        return grammar_text(self.type, self.value)


def grammar_text(kind: str, value: Any) -> str:
    matcher = llguidance.LLMatcher
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        if not isinstance(value, dict | str):
            raise ValueError("a json_schema constraint's value must be a schema object")
        return matcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} constraint's value must be a non-empty string")
    return matcher.grammar_from_regex(value) if kind == "regex" else matcher.grammar_from_lark(value)


_TOKENIZER_VIEWS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = weakref.WeakKeyDictionary()
_VIEWS_LOCK = threading.Lock()


def tokenizer_view(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """llguidance's view of a Hugging Face tokenizer: every token's bytes (byte-level pieces
    included, so any character is producible), built once per tokenizer and vocabulary width."""
    eos = tuple(sorted(eos_token_ids))
    with _VIEWS_LOCK:
        views = _TOKENIZER_VIEWS.setdefault(tokenizer, {})
        view = views.get((vocab_size, eos))
        if view is None:
            view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
            views[(vocab_size, eos)] = view
        return view


@dataclass
class MaskFill:
    """One step's masks: a row of bit words per constrained sequence (bit t of row i: token t allowed)."""

    bitmask: torch.Tensor
    fill_time_s: float


class StructuredOutput:
    """The engine's structured-output state: the tokenizer view, compiled constraints, the mask filler."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._view: Any = None
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._executor: Any = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def view(self) -> Any:
        if self._view is None:  # on first use: engines that never see a constraint never pay for it
            self._view = tokenizer_view(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._view

    def matcher(self, constraint: Constraint, prior_output_token_ids: Sequence[int] = ()) -> Any:
        """A fresh matcher for one sequence, caught up with the tokens it already generated
        (a resumed request). Raises ValueError naming the problem."""
        template = self._templates.get(constraint.key)
        if template is None:
            template = llguidance.LLMatcher(self.view, constraint.grammar(), log_level=0)
            if template.is_error():
                raise ValueError(f"invalid {constraint.type} constraint: {template.get_error()}")
            self._templates[constraint.key] = template
            if len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(constraint.key)
        matcher = template.deep_copy()
        if prior_output_token_ids and not matcher.consume_tokens(list(prior_output_token_ids)):
            raise ValueError(f"the output so far does not match the constraint: {matcher.get_error()}")
        return matcher

    def fill(self, matchers: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None) -> MaskFill:
        """One mask row per matcher; with ``drafts`` (tokens proposed to follow each matcher's state,
        all of them allowed: ``allowed_prefix``), 1 + len(draft) rows per matcher: the mask at its
        state, then after each draft token (the matchers end where they started)."""
        started = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # llguidance.torch wraps the same call but imports torch.compile's machinery (seconds) for a
        # kernel we do not use.
        words = (self.vocab_size + 31) // 32
        if drafts is None or not any(drafts):
            bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
            targets = [(m, i) for i, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(targets, bitmask.data_ptr(), words * 4, len(matchers))
            return MaskFill(bitmask, time.perf_counter() - started)
        rows = sum(1 + len(d) for d in drafts)
        bitmask = torch.full((rows, words), -1, dtype=torch.int32)
        drafted, first = [], 0
        for m, d in zip(matchers, drafts, strict=True):
            drafted.append((m, first, list(d)))
            first += 1 + len(d)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, rows)
        return MaskFill(bitmask, time.perf_counter() - started)

    def fill_async(self, matchers: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None) -> Future[MaskFill]:
        """Fills the masks on a helper thread (llguidance drops the GIL), so the caller can run
        the model's forward meanwhile."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inflightq-masks")
        return self._pool.submit(self.fill, list(matchers), drafts)


def allowed_prefix(matcher: Any, tokens: list[int]) -> list[int]:
    """The longest prefix of ``tokens`` that ``matcher`` accepts from its state (which it keeps)."""
    return tokens[: matcher.validate_tokens(tokens)] if tokens else tokens


def banned_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 bit words -> [rows, V] bool, True where a token is NOT allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.view(words.shape[0], -1)[:, :vocab_size] == 0
