"""Joining a Ray cluster by its address when the cluster asks for a token.

Ray 2.60 starts clusters with token authentication on (`ray start --head`, and the local cluster
`kvloom serve` starts), saving the token in ~/.ray/auth_token. A client that finds a local cluster
itself uses that token, but one given an explicit address does not unless RAY_AUTH_MODE=token, and
fails with "Authentication token is missing": `kvloom status --address` (the command `kvloom serve`
prints) and `kvloom serve --address` on a `ray start` head did. With a token at hand (that file, or
RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH as Ray reads them) we ask for token mode; a cluster without
authentication accepts such a client too (measured). An explicit RAY_AUTH_MODE is left as it is.
"""

import os
from pathlib import Path

AUTH_MODE = "RAY_AUTH_MODE"


def has_ray_token() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or (Path.home() / ".ray" / "auth_token").is_file())


def use_token_for_address(address: str | None) -> None:
    """Before `ray.init(address=...)`: token mode where a token is at hand and nobody chose a mode."""
    if address in (None, "auto") or AUTH_MODE in os.environ or not has_ray_token():
        return
    os.environ[AUTH_MODE] = "token"
    try:  # Ray caches its config when imported; re-read it (what Ray does when it turns token mode on itself)
        from ray._raylet import Config
    except ImportError:
        return
    Config.initialize("")
