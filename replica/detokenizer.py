"""Incremental detokenization and stop-string matching: token ids in, stable text out.

Decoding each new token alone splits multi-byte characters (a byte-level BPE emits an
emoji as several tokens, each undecodable alone) and loses the spaces and merges a
tokenizer makes across token boundaries. IncrementalDetokenizer does what vLLM does:
it keeps two offsets into the ids seen so far (prompt included, for context), decodes
the window [prefix_offset:] and [prefix_offset:read_offset], and emits only the text the
new ids added; while that text ends in U+FFFD (an incomplete character) it emits nothing
and waits for the next token.

StopMatcher matches stop strings on that text, across token boundaries: the output ends
before the first stop string, and while the text's tail could still grow into one it is
held back, so a stream never shows text that a stop string later takes back.

TextStream joins the two for one request. Pure: it needs only a tokenizer (anything with
`decode(ids, skip_special_tokens=...)`), no engine, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Prompt ids decoded before the first output id: enough context for the tokenizer's
# merges and leading-space rules at the boundary (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output ids into text, a delta per add().

    Invariant: the text returned so far is the decode of ids[:read_offset] past the
    prompt; ids[prefix_offset:read_offset] is the context decoded again with each new id.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - PROMPT_CONTEXT_TOKENS, 0)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text that token_ids add; "" while the tail is an incomplete character."""
        self.ids += token_ids
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the request's end: the text still held back (a character its last ids left
        incomplete decodes as U+FFFD, as a full decode would show it)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


class StopMatcher:
    """Finds the first stop string in a growing text and holds back a tail that may
    still become one.

    add(text) returns (the text now safe to show, whether a stop string was found); once
    found, the shown text ends right before it and nothing more is shown.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything added, stop string included once found
        self.num_shown = 0  # chars of text already returned
        self.stopped = False

    def add(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        # A stop string that ends in the new text starts at most max_stop_len - 1 chars
        # before it.
        start = max(len(self.text) - self.max_stop_len + 1, 0)
        self.text += text
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            end = min(found)
            self.stopped = True
        else:
            end = len(self.text) - self._held_back()
        shown = self.text[self.num_shown : max(end, self.num_shown)]
        self.num_shown = max(end, self.num_shown)
        return shown, self.stopped

    def flush(self) -> str:
        """At the request's end without a stop string: the held-back tail."""
        if self.stopped:
            return ""
        shown = self.text[self.num_shown :]
        self.num_shown = len(self.text)
        return shown

    def _held_back(self) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one add() of a request's new ids shows.

    num_token_ids: how many of the added ids the request keeps (fewer than added when a
    stop string ended it on an earlier one); stopped: a stop string ended it.
    """

    text: str
    num_token_ids: int
    stopped: bool = False


class TextStream:
    """One request's output text: incremental detokenization, then stop strings.

    Without stop strings a delta's ids are decoded together; with them, one at a time,
    so the request ends on the id that completed the stop string.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.matcher = StopMatcher(stop) if stop else None

    def add(self, token_ids: Sequence[int], finished: bool = False) -> TextDelta:
        """The text token_ids add; finished: they are the request's last, flush all."""
        if self.matcher is None:
            text = self.detokenizer.add(token_ids)
            return TextDelta(text + self.detokenizer.flush() if finished else text, len(token_ids))
        parts = []
        for i, token_id in enumerate(token_ids):
            shown, stopped = self.matcher.add(self.detokenizer.add([token_id]))
            parts.append(shown)
            if stopped:
                return TextDelta("".join(parts), i + 1, True)
        if finished:
            shown, stopped = self.matcher.add(self.detokenizer.flush())
            parts.append(shown if stopped else shown + self.matcher.flush())
            return TextDelta("".join(parts), len(token_ids), stopped)
        return TextDelta("".join(parts), len(token_ids))
