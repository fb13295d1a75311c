"""Free loopback ports, for a server that needs one no one else holds (tests, benchmarks), and whether a
server's own port is taken.

A port that bind(0) hands out comes from the kernel's ephemeral range, the same range that every later
bind(0) and every outgoing connection draws from: between the pick and the server's own bind, the Ray
cluster the server starts (GCS, raylet and its agents bind their ports that way, and open many
connections) can take it. One CI run lost a Serve deployment so (NoAvailablePortError: the router's only
direct-ingress port was in use). So ports come from between Ray's worker ports (10002-19999 by default)
and the ephemeral range, where nothing is handed out unasked.
"""

import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_QUIET_PORT = 20000  # above Ray's default max_worker_port
TRIES = 100


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return 49152  # IANA's dynamic range


def _binds(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port no one holds now and that no bind(0) or outgoing connection will be given."""
    quiet = range(FIRST_QUIET_PORT, _ephemeral_start())
    for port in random.sample(quiet, min(TRIES, len(quiet))):
        if _binds(port):
            return port
    with socket.socket() as sock:  # no quiet range on this host: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listened_on(host: str, port: int) -> bool:
    """Whether another socket listens on `port`: a bind with SO_REUSEADDR, as the router's server makes (see
    router/reusable_port.py), fails only then, not for the TIME_WAIT connections a stopped server leaves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False
