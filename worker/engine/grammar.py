"""Grammar-constrained decoding: a regular expression becomes a character DFA, and each DFA state
the generation reaches becomes a mask of the tokens whose text keeps the output inside the
language (computed on first visit, by walking every token's text through the DFA at once).

``Grammar(pattern, vocabulary)`` is immutable and shared by every request using the same pattern;
a request's progress is just a DFA state id, kept by the sampler. End-of-sequence tokens are
allowed exactly in accepting states, so a finished match ends the sequence.

Supported regex syntax: literals and escapes (``\\d \\w \\s \\D \\W \\S \\n \\t \\uXXXX \\xHH``),
``.``, classes ``[a-z]``/``[^...]``, groups ``(...)``/``(?:...)``, ``|``, ``* + ? {m} {m,} {m,n}``;
the whole output must match. Limitation: tokens that end inside a UTF-8 character (byte-level
fragments) are never allowed, so characters the vocabulary only spells in byte pieces cannot be
produced under a grammar."""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from worker.engine.json_schema import json_schema_to_regex
from worker.engine.regex_nfa import Nfa, parse_regex

DEAD = -1
UNKNOWN = -2
_CPU = torch.device("cpu")


class TokenVocabulary:
    """The text of every token, as rows of character ids; built once per tokenizer."""

    def __init__(self, token_texts: Sequence[str | None], eos_token_ids: Iterable[int]) -> None:
        self.size = len(token_texts)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.texts = list(token_texts)
        # Every token as a row of character ids (-1 past its end), so a grammar can walk the
        # whole vocabulary through its DFA one character position at a time, vectorised.
        self.chars = sorted({ch for text in token_texts if text for ch in text})
        char_id = {ch: i for i, ch in enumerate(self.chars)}
        width = max((len(t) for t in token_texts if t), default=1)
        rows = [
            [char_id[ch] for ch in text] + [-1] * (width - len(text)) if text else [-1] * width for text in token_texts
        ]
        self.char_ids = np.array(rows, dtype=np.int64).reshape(self.size, width).T.copy()  # [width, vocab]
        self.has_text = np.array([bool(t) for t in token_texts], dtype=bool)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, eos_token_ids: Iterable[int] | None = None, vocab_size: int | None = None
    ) -> TokenVocabulary:
        """Token texts as they read in running text (a SentencePiece '▁x' reads ' x'): decode each
        token after an anchor token and drop the anchor's text. Special tokens and byte fragments
        get no text, so a grammar never allows them; neither are the ids a model pads its
        embedding with (``vocab_size`` = the model's logits width, when larger)."""
        size = len(tokenizer)
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
        anchor_text = tokenizer.decode([anchor])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        pairs = [[anchor, i] for i in range(size)]
        if backend is not None:
            decoded = backend.decode_batch(pairs, skip_special_tokens=False)
        else:
            decoded = [tokenizer.decode(p) for p in pairs]
        special = set(getattr(tokenizer, "all_special_ids", ()))
        texts: list[str | None] = []
        for token_id, text in enumerate(decoded):
            ok = token_id not in special and text.startswith(anchor_text) and "\ufffd" not in text
            texts.append(text[len(anchor_text) :] if ok else None)
        texts += [None] * max(0, (vocab_size or 0) - size)
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [eos] if isinstance(eos, int) else []
        return cls(texts, eos_token_ids)


class Grammar:
    def __init__(self, pattern: str, vocabulary: TokenVocabulary) -> None:
        self.pattern = pattern
        self.vocabulary = vocabulary
        self._nfa: Nfa = parse_regex(pattern)
        self._states: list[frozenset[int]] = []
        self._ids: dict[frozenset[int], int] = {}
        self._accepting: list[bool] = []
        self._steps: dict[tuple[int, str], int] = {}
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._classes: np.ndarray | None = None  # [width, vocab] class ids, built on first walk
        self._class_chars: list[str] = []  # a representative character per class
        self._table = np.empty((0, 0), dtype=np.int64)  # DFA state x class -> state, filled lazily
        self.initial_state = self._intern(self._nfa.closure({self._nfa.start}))

    def is_accepting(self, state: int) -> bool:
        return state != DEAD and self._accepting[state]

    def step(self, state: int, ch: str) -> int:
        """The DFA state after reading one character (built on first use)."""
        key = (state, ch)
        found = self._steps.get(key)
        if found is None:
            moved = self._nfa.move(self._states[state], ch)
            found = self._intern(self._nfa.closure(moved)) if moved else DEAD
            self._steps[key] = found
        return found

    def advance(self, state: int, token_id: int) -> int:
        """The state after a whole token; DEAD if the token leaves the language."""
        if state == DEAD:
            return DEAD
        if token_id in self.vocabulary.eos_token_ids:
            return state if self.is_accepting(state) else DEAD
        text = self.vocabulary.texts[token_id] if token_id < self.vocabulary.size else None
        if not text:
            return DEAD
        for ch in text:
            state = self.step(state, ch)
            if state == DEAD:
                return DEAD
        return state

    def allowed(self, state: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool mask [vocab] of the tokens allowed in ``state``; EOS only where the match is
        complete, and only EOS when nothing else can follow (or the state is dead)."""
        device = torch.device(device)
        mask = self._masks.get((state, device))
        if mask is None:
            mask = self._masks.get((state, _CPU))
            if mask is None:
                mask = torch.zeros(self.vocabulary.size, dtype=torch.bool)
                if state != DEAD:
                    mask[torch.from_numpy(self._walk(state))] = True
                if state == DEAD or self._accepting[state] or not mask.any():
                    mask[self.vocabulary.eos_token_ids] = True
                self._masks[(state, _CPU)] = mask
            mask = self._masks[(state, device)] = mask.to(device)  # one copy per device, not per step
        return mask

    def _walk(self, state: int) -> np.ndarray:
        """Ids of every token whose text the DFA can read from ``state``: all tokens advance one
        character position per iteration through a transition table over character classes, and
        a token drops out at its end or at the first character the DFA refuses. (numpy: its
        fancy indexing costs a hundredth of torch's on a busy CPU.)"""
        if self._classes is None:
            self._build_classes()
        assert self._classes is not None
        num_classes = len(self._class_chars)
        alive = self.vocabulary.has_text.copy()
        live = np.flatnonzero(alive)  # tokens with characters left to read
        at = np.full(len(live), state, dtype=np.int64)
        for position_classes in self._classes:
            cls = position_classes[live]
            more = cls >= 0
            live, at, cls = live[more], at[more], cls[more]
            if len(live) == 0:
                break
            self._grow_table()
            nxt = self._table[at, cls]
            unknown = nxt == UNKNOWN
            if unknown.any():
                for pair in np.unique(at[unknown] * num_classes + cls[unknown]).tolist():
                    src, c = divmod(pair, num_classes)
                    dst = self.step(src, self._class_chars[c])
                    self._grow_table()
                    self._table[src, c] = dst
                nxt = self._table[at, cls]
            refused = nxt == DEAD
            alive[live[refused]] = False
            live, at = live[~refused], nxt[~refused]
        return np.flatnonzero(alive)

    def _build_classes(self) -> None:
        """Characters the NFA never tells apart share a class; tokens become rows of class ids."""
        edges = self._nfa.edges
        bounds = sorted({b for out in edges for ranges, _ in out for lo, hi in ranges for b in (lo, hi + 1)})
        char_class: list[int] = []
        first_of_class: dict[int, int] = {}
        for ch in self.vocabulary.chars:
            slot = bisect_right(bounds, ord(ch))
            if slot not in first_of_class:
                first_of_class[slot] = len(self._class_chars)
                self._class_chars.append(ch)
            char_class.append(first_of_class[slot])
        lookup = np.array([*char_class, -1], dtype=np.int64)  # index -1 (padding) stays -1
        self._classes = lookup[self.vocabulary.char_ids]
        self._table = np.full((0, len(self._class_chars)), UNKNOWN, dtype=np.int64)

    def _grow_table(self) -> None:
        missing = len(self._states) - self._table.shape[0]
        if missing > 0:
            pad = np.full((max(missing, 16), self._table.shape[1]), UNKNOWN, dtype=np.int64)
            self._table = np.concatenate([self._table, pad])

    def _intern(self, states: frozenset[int]) -> int:
        found = self._ids.get(states)
        if found is None:
            found = len(self._states)
            self._ids[states] = found
            self._states.append(states)
            self._accepting.append(self._nfa.accept in states)
        return found


class GrammarCache:
    """Compiled grammars by pattern, sharing one vocabulary per tokenizer (about a second to
    build): an engine keeps one and hands ``SamplingRow.grammar`` from it."""

    def __init__(
        self, tokenizer: Any, eos_token_ids: Iterable[int] | None = None, vocab_size: int | None = None, size: int = 64
    ) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._vocab_size = vocab_size
        self._vocabulary: TokenVocabulary | None = None
        self._size = size
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()

    @property
    def vocabulary(self) -> TokenVocabulary:
        if self._vocabulary is None:
            self._vocabulary = TokenVocabulary.from_tokenizer(self._tokenizer, self._eos, self._vocab_size)
        return self._vocabulary

    def regex(self, pattern: str) -> Grammar:
        grammar = self._grammars.get(pattern)
        if grammar is None:
            grammar = Grammar(pattern, self.vocabulary)  # raises ValueError on a bad pattern
            self._grammars[pattern] = grammar
            if len(self._grammars) > self._size:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(pattern)
        return grammar

    def json_schema(self, schema: dict[str, Any]) -> Grammar:
        return self.regex(json_schema_to_regex(schema))
