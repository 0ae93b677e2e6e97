"""MariaDB's servers: which ones the dialect keeps locks in (MariaDB 10.6 or newer,
never MySQL: no sequences for fencing tokens, no ``RETURNING``; checked on every new
lock connection, by ``taskguard check`` and before migrations create anything), and
what their error codes mean."""

from __future__ import annotations

import re

from taskguard.dialects.base import ErrorKind
from taskguard.exceptions import ConfigurationError

__all__ = ["error_kind", "refuse_server", "server_info"]

_KINDS = {
    1054: ErrorKind.SCHEMA_OLD,  # unknown column: deployed before the upgrade
    1146: ErrorKind.SCHEMA_MISSING,  # no such table
    4091: ErrorKind.SCHEMA_MISSING,  # no such sequence
    1045: ErrorKind.LOGIN,  # access denied: wrong user or password
    1049: ErrorKind.NO_DATABASE,  # unknown database
    **dict.fromkeys((1044, 1142, 1143, 1227, 1370), ErrorKind.PERMISSION),
    # Server/connection trouble, retryable: too many connections, server shutdown,
    # lock wait timeout and deadlock (the statement was rolled back), read only
    # (failover), connection killed, MySQL's idle-session disconnect.
    **dict.fromkeys((1040, 1053, 1205, 1213, 1290, 1836, 1927, 4031), ErrorKind.OUTAGE),
}

#: Oldest MariaDB with everything the lock SQL uses (sequences, INSERT … RETURNING, JSON_TABLE).
MARIADB_MIN = (10, 6)


def refuse_server(mariadb: bool, version: tuple[int, ...]) -> None:
    """One line, a :class:`ConfigurationError`, unless the server is MariaDB 10.6+."""
    if mariadb and version >= MARIADB_MIN:
        return
    raise ConfigurationError(
        f"taskguard needs MariaDB {'.'.join(map(str, MARIADB_MIN))} or newer; this server is "
        f"{'MariaDB' if mariadb else 'MySQL'} {'.'.join(map(str, version)) or '(unknown version)'}"
        " (MySQL has no sequences for fencing tokens: keep the locks in MariaDB, "
        "PostgreSQL or SQLite)"
    )


def server_info(info: str) -> tuple[bool, tuple[int, ...]]:
    """(is MariaDB, version) from a server version string: ``10.11.6-MariaDB-0+deb12u1``,
    ``5.5.5-10.11.6-MariaDB`` (the replication prefix), ``8.0.36``."""
    mariadb = "mariadb" in info.lower()
    numbers = re.findall(r"\d+(?:\.\d+)+", info)
    if mariadb and len(numbers) > 1 and numbers[0].startswith("5.5.5"):
        numbers = numbers[1:]
    return mariadb, tuple(int(n) for n in numbers[0].split(".")) if numbers else ()


def error_kind(code: int) -> ErrorKind:
    """What a server error code means; client errors (2000-2999: cannot connect,
    server gone away, lost connection) are outages, anything else a refused statement."""
    if 2000 <= code < 3000:
        return ErrorKind.OUTAGE
    return _KINDS.get(code, ErrorKind.STATEMENT)
