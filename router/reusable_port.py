"""The router's HTTP port can be bound again at once after a stop, as uvicorn's (and so `vllm serve`'s) can.

Serve's direct-ingress server (ray 2.60: `serve/_private/http_util.start_asgi_http_server`) binds its port
without SO_REUSEADDR. A server that stops while clients hold keep-alive connections closes them first, and
those sockets stay in TIME_WAIT on the port for about a minute: a `kvloom serve` restarted within it could
not bind its own port and exited. With SO_REUSEADDR the bind succeeds past TIME_WAIT and still fails where
another socket listens on the port. This sets it for the sockets Serve's HTTP servers make in this process
(the router's); nothing else in Serve or the process changes.
"""

import socket
import types

from ray.serve._private import http_util


class ReusableAddressSocket(socket.socket):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


def bind_http_with_reusable_address() -> None:
    """Serve's HTTP servers in this process set SO_REUSEADDR on their listening socket (idempotent)."""
    with_reuse = types.ModuleType("socket", "the socket module with ReusableAddressSocket as its socket class")
    with_reuse.__dict__.update({k: v for k, v in vars(socket).items() if not k.startswith("__")})
    with_reuse.socket = ReusableAddressSocket
    http_util.socket = with_reuse
