"""The ``taskguard`` command line: a thin layer over :class:`taskguard.TaskGuard`
and :mod:`taskguard.schema`.

Exit codes: 0 ok; 1 not found / not owner; 2 usage or connection error. Every
error is one line on stderr; passwords in URLs are always masked.
"""

from __future__ import annotations

import sys

from taskguard.cli.db import db
from taskguard.cli.errors import EXIT_USAGE, fail
from taskguard.cli.root import main_group

__all__ = ["cli", "main"]

cli = main_group
cli.add_command(db)

# Other command groups register themselves on import.
for _module in (
    "taskguard.cli.locks",
    "taskguard.cli.demo",
    "taskguard.cli.explain",
    "taskguard.cli.check",
    "taskguard.cli.web",
):
    try:
        __import__(_module)
    except ModuleNotFoundError as _exc:  # pragma: no cover - optional pieces
        if _exc.name != _module:
            raise


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="taskguard", standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover
        fail("interrupted", EXIT_USAGE)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
