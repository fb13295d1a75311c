"""A model's output split into content and tool calls as its text arrives, for every format.

Outside a call, text is content, except what could still be the start of the format's opener (held back, so no
markup leaks into content). Once the opener appears, the format's stream takes over until its block of calls
ends, handing out `Piece`s: a call's name first, then its arguments' JSON in pieces. A call cut short (the output
ended inside it) is not counted in `calls`, and `parse` leaves it out.
"""

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class Piece:
    """A part of a streamed output: content text, or (with `call_index`) a call's name or a piece of its arguments."""

    content: str = ""
    call_index: int | None = None
    name: str | None = None  # set in a call's first piece
    arguments: str = ""


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


class CallStream(ABC):
    opener: re.Pattern  # where a block of calls begins
    partial_opener: re.Pattern  # a tail of the text that may still become an opener (anchored at its end)
    separators: str = ""  # besides whitespace, characters between calls that are not content

    def __init__(self) -> None:
        self.calls = 0  # calls completed
        self._pending = ""
        self._inside = False

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while self._pending:
            if self._inside:
                if not self._advance(pieces):
                    break
                continue
            found = self.opener.search(self._pending)
            if found is None:
                tail = self.partial_opener.search(self._pending)
                keep = len(self._pending) - tail.start() if tail else 0
                self._emit_content(pieces, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            self._emit_content(pieces, self._pending[: found.start()])
            self._pending, self._inside = self._pending[found.end():], True
            self._open()
        return pieces

    def finish(self) -> list[Piece]:
        """The rest once the output ended: held-back text is content (a call cut short stays unfinished)."""
        pieces: list[Piece] = []
        if not self._inside:
            self._emit_content(pieces, self._pending)
        self._pending = ""
        return pieces

    def _open(self) -> None:
        """A block of calls begins (its opener consumed)."""

    @abstractmethod
    def _advance(self, pieces: list[Piece]) -> bool:
        """Consume what it can of `_pending` inside a block, appending pieces; set `_inside` False where the block
        ends. False when it needs more text."""

    def _emit_content(self, pieces: list[Piece], text: str) -> None:
        if text.strip(" \t\r\n" + self.separators) or (text and not self.calls):  # what separates calls is not content
            pieces.append(Piece(content=text))


def literal_opener(opener: str) -> tuple[re.Pattern, re.Pattern]:
    """`opener` and `partial_opener` for an opener that is a fixed string."""
    prefixes = "|".join(re.escape(opener[:n]) for n in range(len(opener) - 1, 0, -1))
    return re.compile(re.escape(opener)), re.compile(f"(?:{prefixes})$")


def parse(stream: CallStream, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output's content (None when empty) and completed calls."""
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p.content for p in pieces if p.content)
    calls: dict[int, ParsedCall] = {}
    for piece in pieces:
        if piece.call_index is not None and piece.call_index < stream.calls:
            call = calls.setdefault(piece.call_index, ParsedCall(piece.name or "", ""))
            call.arguments += piece.arguments
    return content.strip() or None, list(calls.values())
