"""The unknown request fields the router accepted and ignored, logged once per name, with bounded memory: a
client sending a fresh random field name with every request must not grow the router or its log without end."""

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAX_NAMES = 256  # names remembered (and logged once each); past it one line says so and later ones are only counted
MAX_NAME_CHARS = 64  # a name is kept and logged cut to this (a field name may be megabytes long)


@dataclass
class UnknownFieldLog:
    limit: int = MAX_NAMES
    names: set[str] = field(default_factory=set)
    unlogged: int = 0  # accepted names past the limit: counted, neither kept nor logged
    lines: int = 0  # log lines written

    def note(self, names: list[str]) -> None:
        for name in names:
            name = name[:MAX_NAME_CHARS]
            if name in self.names:
                continue
            if len(self.names) < self.limit:
                self.names.add(name)
                self._log("accepting and ignoring the unknown request field %r (it changes no output; said once)",
                          name)
            else:
                if not self.unlogged:
                    self._log("more than %d distinct unknown request field names: later ones are accepted and "
                              "ignored without a log line each", self.limit)
                self.unlogged += 1

    def _log(self, message: str, *args) -> None:
        self.lines += 1
        logger.warning(message, *args)
