"""`kvloom serve --log-format json`: the console carries one JSON object a line, for a log shipper.

Ray prints the workers' JSON lines on the driver's console without its "(pid=...)" prefix (each process's own
side: replicas/serve_logs.py). What is still text by the time it reaches the driver's console (Serve's
controller and proxy, errors Ray relays from the cluster as "(raylet) ...") is wrapped here as {"message": line}.
"""

import io
import json
import re

from kvloom.replicas.serve_logs import json_logs


class JSONConsole(io.TextIOBase):
    """The driver's stdout or stderr in JSON mode: every line out is a JSON object (text lines get wrapped)."""

    ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                self.stream.write(self._json(line) + "\n")
        return len(text)

    def _json(self, line: str) -> str:
        try:
            if isinstance(json.loads(line), dict):
                return line
        except json.JSONDecodeError:
            pass
        return json.dumps({"message": self.ANSI_COLOURS.sub("", line)})

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


def say(message: str, **fields) -> None:
    """A line for the operator on the console: text, or a JSON object with `fields` beside the message."""
    print(json.dumps({"message": message, **fields}) if json_logs() else message, flush=True)
