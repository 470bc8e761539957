"""Token ids in, text deltas out, one token at a time, with stop strings matched on the text.

Decoding uses the tokenizers library's ``DecodeStream`` (Rust),
which holds back tokens that end inside a UTF-8 character. Tokenizers without a Rust backend
fall back to the prefix-offset technique: decode a short window, emit what grew.

Stop strings may span tokens. Text that could still be the beginning of a stop string is held
back until the next tokens settle it, so no part of a stop string ever reaches a client; on a
match the output ends right before it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded ahead of the output: enough for decoders whose output depends on what
# precedes (leading-space rules of SentencePiece-style vocabularies), few enough to cost nothing.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prior_output_token_ids: Sequence[int] = (),
    ) -> None:
        self._stops = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""  # everything decoded so far, stop excluded; held-back text included
        self._emitted = 0  # characters of _text already handed out
        self._stopped = False
        self._decoder = _make_decoder(tokenizer, list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens)
        # A request resumed after a crash replays its earlier tokens: what the previous worker
        # emitted is discarded here, and what it held back is held back again, exactly as before.
        for token_id in prior_output_token_ids:
            self.add(token_id)

    @property
    def text(self) -> str:
        """The whole output text so far (stop excluded), including text still held back."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string matched)."""
        if self._stopped:
            return "", True
        chunk = self._decoder.step(token_id)
        if not chunk:
            return "", False
        start = len(self._text)
        self._text += chunk
        if self._stops:
            cut = self._find_stop(start)
            if cut >= 0:
                self._text = self._text[:cut]
                self._stopped = True
                return self._take(len(self._text)), True
        return self._take(len(self._text) - self._held_back()), False

    def finish(self) -> str:
        """Text held back so far, to emit when the sequence ends for another reason than a stop."""
        if not self._stopped:
            start = len(self._text)
            self._text += self._decoder.flush()
            cut = self._find_stop(start) if self._stops else -1
            if cut >= 0:  # the flushed tail completed a stop string: it still must not leak
                self._text = self._text[:cut]
                self._stopped = True
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self, new_from: int) -> int:
        """Earliest start of a stop string that ends in the text added from ``new_from`` on;
        earlier text was checked when it arrived."""
        window_start = max(0, new_from - self._max_stop + 1)
        best = -1
        for s in self._stops:
            pos = self._text.find(s, window_start)
            if pos >= 0 and (best < 0 or pos < best):
                best = pos
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper beginning of a stop string."""
        if not self._stops:
            return 0
        text = self._text
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class _StreamDecoder:
    """tokenizers' DecodeStream, plus a flush for tokens it is still holding at the end."""

    def __init__(self, backend: Any, context: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._recent: list[int] = list(context)  # ids up to the last emitted chunk (short tail)
        self._pending: list[int] = []  # ids the stream holds, not yet turned into text

    def step(self, token_id: int) -> str:
        chunk = self._stream.step(self._backend, token_id)
        self._pending.append(token_id)
        if chunk is None:
            return ""
        self._recent = (self._recent + self._pending)[-_CONTEXT_TOKENS:]
        self._pending = []
        return chunk

    def flush(self) -> str:
        """Decodes whatever the stream held back (an incomplete character becomes U+FFFD, as in
        a full decode)."""
        if not self._pending:
            return ""
        base = self._backend.decode(self._recent, skip_special_tokens=self._skip)
        full = self._backend.decode(self._recent + self._pending, skip_special_tokens=self._skip)
        self._recent = (self._recent + self._pending)[-_CONTEXT_TOKENS:]
        self._pending = []
        return full[len(base) :] if full.startswith(base) else full


class _PrefixOffsetDecoder:
    """For tokenizers without a Rust backend: decode a window [prefix_offset:] of the ids and
    emit what it adds beyond [prefix_offset:read_offset], unless it ends inside a character."""

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True) if self._read_offset < len(self._ids) else ""

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]


def _make_decoder(tokenizer: Any, context: list[int], skip: bool) -> _StreamDecoder | _PrefixOffsetDecoder:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer  # a bare tokenizers.Tokenizer
    # A prompt that ends inside a UTF-8 character would make the first delta carry prompt text;
    # then the output decodes on its own, as tokenizer.decode(output) would.
    if context and (backend or tokenizer).decode(context, skip_special_tokens=skip).endswith("\ufffd"):
        context = []
    if backend is not None:
        try:
            from tokenizers.decoders import DecodeStream  # noqa: F401  (older tokenizers lack it)

            return _StreamDecoder(backend, context, skip)
        except ImportError:
            pass
    return _PrefixOffsetDecoder(tokenizer, context, skip)
