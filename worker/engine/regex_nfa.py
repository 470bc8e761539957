r"""A small regular-expression parser that builds a Thompson NFA over Unicode characters, for
grammar-constrained decoding (grammar.py). Character sets are sorted code-point intervals, so
negated classes cost nothing however large the alphabet. ``\d \w \s`` have their ASCII meaning
(Python's ``re.ASCII``), as JSON-schema patterns expect."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_CODE_POINT = 0x10FFFF
MAX_REPEAT = 1000  # {m,n} expands copies of its operand: bound the NFA size

Intervals = tuple[tuple[int, int], ...]


def _normalise(ranges: Iterable[tuple[int, int]]) -> Intervals:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _negate(ranges: Intervals) -> Intervals:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return tuple(out)


def _contains(ranges: Intervals, code: int) -> bool:
    i = bisect_right(ranges, (code, MAX_CODE_POINT + 1)) - 1
    return i >= 0 and ranges[i][0] <= code <= ranges[i][1]


DIGIT: Intervals = ((48, 57),)
WORD: Intervals = _normalise([(48, 57), (65, 90), (95, 95), (97, 122)])
SPACE: Intervals = _normalise([(9, 13), (32, 32)])
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": _negate(DIGIT), "W": _negate(WORD), "S": _negate(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
ANY_BUT_NEWLINE: Intervals = _negate(((10, 10),))


@dataclass
class Nfa:
    start: int = 0
    accept: int = 0
    epsilon: list[list[int]] = field(default_factory=list)
    edges: list[list[tuple[Intervals, int]]] = field(default_factory=list)

    def new_state(self) -> int:
        self.epsilon.append([])
        self.edges.append([])
        return len(self.epsilon) - 1

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        seen = set(states)
        stack = list(seen)
        while stack:
            for nxt in self.epsilon[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)

    def move(self, states: frozenset[int], ch: str) -> set[int]:
        code = ord(ch)
        return {target for s in states for ranges, target in self.edges[s] if _contains(ranges, code)}


# AST: ("set", Intervals) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max or None)
Node = tuple


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.src = pattern
        self.pos = 0

    def error(self, message: str) -> ValueError:
        return ValueError(f"regex {self.src!r} at {self.pos}: {message}")

    def peek(self) -> str | None:
        return self.src[self.pos] if self.pos < len(self.src) else None

    def take(self) -> str:
        if self.pos >= len(self.src):
            raise self.error("unexpected end")
        ch = self.src[self.pos]
        self.pos += 1
        return ch

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos != len(self.src):
            raise self.error("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.take()
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self) -> Node:
        items: list[Node] = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repetition())
        return ("cat", items)

    def repetition(self) -> Node:
        node = self.atom()
        while True:
            ch = self.peek()
            if ch in ("*", "+", "?"):
                self.take()
                node = ("rep", node, 1 if ch == "+" else 0, None if ch != "?" else 1)
            elif ch == "{" and self._looks_like_count():
                low, high = self._count()
                node = ("rep", node, low, high)
            else:
                return node
            if self.peek() == "?":  # lazy quantifiers match the same language
                self.take()

    def _looks_like_count(self) -> bool:
        end = self.src.find("}", self.pos)
        body = self.src[self.pos + 1 : end] if end > 0 else ""
        return bool(body) and all(c.isdigit() or c == "," for c in body) and body[0].isdigit()

    def _count(self) -> tuple[int, int | None]:
        end = self.src.index("}", self.pos)
        body = self.src[self.pos + 1 : end]
        self.pos = end + 1
        low_s, _, high_s = body.partition(",")
        low = int(low_s)
        high = low if "," not in body else (int(high_s) if high_s else None)
        if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
            raise self.error(f"bad repetition {{{body}}}")
        return low, high

    def atom(self) -> Node:
        ch = self.take()
        if ch == "(":
            if self.src.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                raise self.error("only (?:...) groups are supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.take()
            return node
        if ch == "[":
            return ("set", self._class())
        if ch == ".":
            return ("set", ANY_BUT_NEWLINE)
        if ch in "^$":
            return ("cat", [])  # the whole output is matched anyway
        if ch == "\\":
            escaped = self._escape()
            return ("set", escaped if isinstance(escaped, tuple) else ((ord(escaped), ord(escaped)),))
        if ch in "*+?)":
            raise self.error(f"nothing to repeat before {ch!r}")
        return ("set", ((ord(ch), ord(ch)),))

    def _escape(self) -> Intervals | str:
        ch = self.take()
        if ch in CLASS_ESCAPES:
            return CLASS_ESCAPES[ch]
        if ch in CHAR_ESCAPES:
            return CHAR_ESCAPES[ch]
        if ch in "ux":
            width = 4 if ch == "u" else 2
            digits = self.src[self.pos : self.pos + width]
            if len(digits) != width:
                raise self.error(f"bad \\{ch} escape")
            self.pos += width
            return chr(int(digits, 16))
        if ch.isalnum():
            raise self.error(f"unsupported escape \\{ch}")
        return ch

    def _class(self) -> Intervals:
        negate = self.peek() == "^"
        if negate:
            self.take()
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            ch = self.take()
            if ch == "]" and not first:
                break
            first = False
            item: Intervals | str = self._escape() if ch == "\\" else ch
            if isinstance(item, tuple):
                ranges.extend(item)
                continue
            low = ord(item)
            if self.peek() == "-" and self.src[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.take()
                end = self.take()
                high_item = self._escape() if end == "\\" else end
                if isinstance(high_item, tuple) or ord(high_item) < low:
                    raise self.error("bad class range")
                ranges.append((low, ord(high_item)))
            else:
                ranges.append((low, low))
        result = _normalise(ranges)
        return _negate(result) if negate else result


def _build(nfa: Nfa, node: Node) -> tuple[int, int]:
    """Thompson construction: a fragment with one entry and one exit state."""
    kind = node[0]
    start, end = nfa.new_state(), nfa.new_state()
    if kind == "set":
        nfa.edges[start].append((node[1], end))
    elif kind == "cat":
        at = start
        for item in node[1]:
            s, e = _build(nfa, item)
            nfa.epsilon[at].append(s)
            at = e
        nfa.epsilon[at].append(end)
    elif kind == "alt":
        for item in node[1]:
            s, e = _build(nfa, item)
            nfa.epsilon[start].append(s)
            nfa.epsilon[e].append(end)
    else:  # rep
        _, item, low, high = node
        at = start
        for _ in range(low):
            s, e = _build(nfa, item)
            nfa.epsilon[at].append(s)
            at = e
        if high is None:
            s, e = _build(nfa, item)
            nfa.epsilon[at].extend([s, end])
            nfa.epsilon[e].extend([s, end])
        else:
            for _ in range(high - low):
                s, e = _build(nfa, item)
                nfa.epsilon[at].extend([s, end])
                at = e
            nfa.epsilon[at].append(end)
    return start, end


def parse_regex(pattern: str) -> Nfa:
    nfa = Nfa()
    nfa.start, nfa.accept = _build(nfa, _Parser(pattern).parse())
    return nfa
