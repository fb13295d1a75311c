"""Tool calls written as JSON objects, `{"name": ..., "<arguments key>": {...}}`: Hermes, Llama 3's JSON and
Mistral's formats differ only in what opens a block of calls, the arguments' key and what follows a call.

The arguments stream out as the model writes them: a scanner follows the JSON value (strings, escapes, nesting)
to find where it ends, so no end tag has to be waited for and nothing is held back inside the arguments.
"""

import json
import re
from dataclasses import dataclass

from kvloom.engine.tool_calls.call_stream import CallStream, Piece, literal_opener

NAME = r'((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'  # from the name's first character
CALL = r'\s*\{\s*"name"\s*:\s*"' + NAME  # a whole call's header
LITERAL_CHARACTERS = frozenset("+-.0123456789eEtrufalsn")  # numbers, true, false, null


@dataclass(frozen=True)
class JsonCallSyntax:
    opener: str  # opens a block of calls
    header: re.Pattern  # from the opener (or a previous call's `after`) to the arguments; group 1: the name
    after: re.Pattern  # from the arguments' end; group `more` set where another call follows in the block
    separators: str = ""  # characters between blocks that are not content


class JsonValueScanner:
    """Where one JSON value ends, fed a piece at a time."""

    def __init__(self) -> None:
        self.done = False
        self._depth = 0
        self._in_string = self._escaped = self._started = self._literal = False

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them, unless it ends inside `text`)."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return self._end(i + 1)
            elif self._literal and char not in LITERAL_CHARACTERS:
                return self._end(i)
            elif char == '"':
                self._in_string, self._started = True, True
            elif char in "{[":
                self._depth, self._started = self._depth + 1, True
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._end(i + 1)
            elif not self._started and not char.isspace():
                self._literal = self._started = True
        return len(text)

    def _end(self, at: int) -> int:
        self.done = True
        return at


class JsonCallStream(CallStream):
    def __init__(self, syntax: JsonCallSyntax) -> None:
        super().__init__()
        self.syntax = syntax
        self.opener, self.partial_opener = literal_opener(syntax.opener)
        self.separators = syntax.separators
        self._arguments: JsonValueScanner | None = None

    def _advance(self, pieces: list[Piece]) -> bool:
        if self._arguments is None:
            header = self.syntax.header.match(self._pending)
            if header is None:
                return False  # the name is not all here yet
            pieces.append(Piece(call_index=self.calls, name=json.loads(f'"{header.group(1)}"')))
            self._pending, self._arguments = self._pending[header.end():], JsonValueScanner()
            return True
        if not self._arguments.done:
            taken = self._arguments.scan(self._pending)
            if taken:
                pieces.append(Piece(call_index=self.calls, arguments=self._pending[:taken]))
                self._pending = self._pending[taken:]
            return self._arguments.done
        after = self.syntax.after.match(self._pending)
        if after is None:
            return False
        self._pending, self._arguments, self.calls = self._pending[after.end():], None, self.calls + 1
        self._inside = after.groupdict().get("more") is not None
        return True
