"""Celery task ids as the lock table stores them.

Celery accepts any string as a task id (300 characters, NUL, lone surrogates);
the ``task_id`` column holds at most 255 characters of valid text without NUL.
An id that fits is stored as it is; any other becomes a bounded form,
``<first 64 characters, escaped>...#<sha256 digest>``, the same in every process.
Logs, skipped markers and errors show the full id; only rows read back from the
table carry the bounded one.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["MAX_STORED_ID", "is_shortened", "stored_task_id"]

#: Width of the ``task_id`` column.
MAX_STORED_ID = 255
_PREFIX_CHARS = 64
_DIGEST_CHARS = 32
_SHORTENED = re.compile(rf"\.\.\.#[0-9a-f]{{{_DIGEST_CHARS}}}\Z")


def _fits(task_id: str) -> bool:
    if task_id.isascii():  # a uuid, the common case
        return len(task_id) <= MAX_STORED_ID and "\x00" not in task_id
    if len(task_id) > MAX_STORED_ID or "\x00" in task_id:
        return False
    try:
        task_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stored_task_id(task_id: str | None) -> str | None:
    """``task_id`` as stored in the lock table (see the module docstring)."""
    if task_id is None or _fits(task_id):
        return task_id
    raw = task_id.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).hexdigest()[:_DIGEST_CHARS]
    prefix = task_id[:_PREFIX_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
    prefix = prefix.replace("\x00", "\\x00")[:_PREFIX_CHARS]
    return f"{prefix}...#{digest}"


def is_shortened(stored: str | None) -> bool:
    """Whether a stored id is the bounded form of a longer one (not usable as an id)."""
    return stored is not None and bool(_SHORTENED.search(stored))
