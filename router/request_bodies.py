"""A request's JSON body, read and checked before any model sees it: a 413 as soon as it passes the router's
`max_request_bytes` (not read whole first); a 400 when it is not JSON, not an object, or holds a lone UTF-16
surrogate escape in a string (no text the tokenizer takes can carry one)."""

import json

from fastapi import Request

from kvloom.engine.unicode_text import not_unicode_field
from kvloom.router.errors import APIError
from kvloom.router.protocol import SURROGATE_ESCAPE


async def read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"request body is over {limit} bytes (router.max_request_bytes)", None,
                         "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, limit: int) -> dict:
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", None, "invalid_json") from exc
    except RecursionError as exc:
        raise APIError(400, "malformed JSON body: nested too deeply", None, "invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", None, "invalid_json")
    if SURROGATE_ESCAPE.search(raw) and (field := not_unicode_field(body)) is not None:
        raise APIError(400, f"{field}: not valid Unicode text (a lone UTF-16 surrogate escape)", field,
                       "invalid_value")
    return body
