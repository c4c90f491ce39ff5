"""Incremental text for one request, and stop strings.

Owns: turning the output token ids into text deltas as they arrive, holding back characters
that could still become a stop string or an incomplete UTF-8 sequence. The engine's tensors never
see text; this is the one place that calls the tokenizer on the output.
"""

from __future__ import annotations

# Decode only a window of recent tokens; the window's start moves once its text is settled.
# A few settled tokens are decoded again in front of the window, so tokenizers that treat the
# first token specially (SentencePiece's leading space) give the same text as a full decode.
WINDOW = 8
CONTEXT = 4


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""            # all output text so far (settled part + window)
        self.sent = 0             # characters of `text` already handed out
        self._ids: list[int] = []
        self._settled = ""        # text of self._ids[:self._start]
        self._start = 0
        self._prefix = ""         # text of self._ids[self._start - CONTEXT:self._start]

    def add(self, token_ids: list[int]) -> bool:
        """Append tokens; returns True when a stop string appeared (text is cut before it)."""
        if self.tokenizer is None:
            return False
        self._ids += token_ids
        ctx = max(0, self._start - CONTEXT)
        window = self._decode(self._ids[ctx:])[len(self._prefix):]
        if len(self._ids) - self._start > 2 * WINDOW and not window.endswith("\ufffd"):
            self._settled += window
            self._start = len(self._ids)
            self._prefix = self._decode(self._ids[self._start - CONTEXT:])
            window = ""
        self.text = self._settled + window
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def delta(self, final: bool) -> str:
        """Text not handed out yet, holding back a possible stop-string prefix until final."""
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out
