"""Serve handle calls that belong to no HTTP request.

A handle call made while Serve serves an HTTP request carries that request's internal id, and Serve's
request router indexes the calls waiting for a replica by it: two calls pending at once from one HTTP
request (the aborts of a request's n choices when its client goes away) overwrite each other there, one
is never assigned, and the request router's loop spins on it and stalls every later call (seen with Ray
2.60: the replica "fails" its queue-length probes and nothing is served again). The router's calls to
replicas are its own traffic (submits, aborts, output channels, KV hand-offs), so they are made outside
the request's context, each with an id of its own.
"""

import contextvars


class DetachedHandle:
    """A DeploymentHandle whose `.method.remote(...)` calls run in an empty context."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def options(self, **options) -> "DetachedHandle":
        return DetachedHandle(self._handle.options(**options))

    def __getattr__(self, method: str) -> "_DetachedMethod":
        return _DetachedMethod(getattr(self._handle, method))


class _DetachedMethod:
    def __init__(self, method) -> None:
        self._method = method

    def remote(self, *args, **kwargs):
        return contextvars.Context().run(self._method.remote, *args, **kwargs)
