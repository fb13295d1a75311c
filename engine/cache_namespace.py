"""Whose prefix cache a request reads: the root its block-hash chain starts from, computed alike by the router
(prefix affinity; it never imports torch) and the engine.

A block's hash chains every token before it from a root. Requests whose roots differ share no block, no
`cached_tokens` and no first-token timing, so the root is the isolation boundary of the prefix cache:
- a tenant's requests start from its namespace (`tenant:<name>`, or `group:<name>` for tenants of one
  `prefix_cache_group`, who trust each other); the one anonymous tenant of an open server has none, as before;
- a request's `cache_salt` (vLLM's field) roots it further inside its namespace, never outside it;
- a LoRA adapter's root (engine/lora/identity.py) is chained in last: KV computed under an adapter is its own.
"""

import hashlib

SALT_ROOT_BYTES = 16


def namespace_root(namespace: str | None, cache_salt: str | None = None) -> int | None:
    """The 128-bit root for a namespace and an optional salt within it; None when neither is given (the chain
    starts from nothing, as an open server's always did)."""
    if namespace is None and cache_salt is None:
        return None
    digest = hashlib.blake2b(b"kvloom-prefix-namespace", digest_size=SALT_ROOT_BYTES)
    for part in (namespace, cache_salt):  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        data = b"" if part is None else part.encode()
        digest.update(len(data).to_bytes(8, "little") + (b"\x01" if part is not None else b"\x00") + data)
    return int.from_bytes(digest.digest(), "little")


def chain_root(namespace: int | None, adapter_root: int | None) -> int | None:
    """The root of a request's first block: its namespace's, then its adapter's chained in."""
    if namespace is None or adapter_root is None:
        return adapter_root if namespace is None else namespace
    digest = hashlib.blake2b(namespace.to_bytes(SALT_ROOT_BYTES, "little"), digest_size=SALT_ROOT_BYTES)
    digest.update(adapter_root.to_bytes(SALT_ROOT_BYTES, "little"))
    return int.from_bytes(digest.digest(), "little")
