"""Text that is not valid Unicode: JSON may escape a lone UTF-16 surrogate (`"\\ud83d"`) and Python strings
may hold one, but no tokenizer or UTF-8 encoder takes it (a tokenizer raises a TypeError naming nothing), nor
an error message quoting it. Shared by the router (request bodies) and the engine (prompts, chat messages)."""

from typing import Any


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def not_unicode_field(body: Any, path: str = "") -> str | None:
    """The first field (dotted path; its parent's, or "body", for a field name) holding a string that is not
    valid Unicode, or None."""
    if isinstance(body, str):
        return None if _is_unicode(body) else path
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list | tuple) else ()
    for key, value in items:
        if isinstance(key, str) and not _is_unicode(key):
            return path or "body"
        if (found := not_unicode_field(value, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None
