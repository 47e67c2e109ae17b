"""Incremental detokenization: a sequence's text grows by decoding only its newest tokens beside the few before
them (so byte-level pieces and a tokenizer's leading-space rules decode as they do in the whole text), rather than
the whole output again at every token; text ending in half a UTF-8 character waits for the next token."""
from __future__ import annotations


class Detokenizer:
    """The text of a growing list of token ids (`codec`: train.data.tokenizer.Codec)."""

    def __init__(self, codec):
        self.codec = codec
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # ids[_prefix:_read] decode to the context before the unread ids

    def add(self, token: int) -> str:
        """Take one more token; returns the text it completes ("" while it ends mid-character)."""
        self.ids.append(token)
        before = self.codec.decode(self.ids[self._prefix:self._read])
        now = self.codec.decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        return self._advance(now[len(before):])

    def flush(self) -> str:
        """The text of ids not yet decoded (a trailing half character as U+FFFD), once no token follows."""
        if self._read == len(self.ids):
            return ""
        before = self.codec.decode(self.ids[self._prefix:self._read])
        return self._advance(self.codec.decode(self.ids[self._prefix:])[len(before):])

    def _advance(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
