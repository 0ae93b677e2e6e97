"""What every private server the tests and scripts start has in common: used as a
context manager it is started on entry and destroyed (stopped, its directory
deleted) on exit, also when its start fails half-way."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class PrivateServer:
    """Base of :class:`~chaoslib.cluster.ThrowawayCluster`,
    :class:`~chaoslib.pgbouncer.PgBouncer` and
    :class:`~chaoslib.mariadb_server.ThrowawayMariaDB`."""

    def start(self) -> object:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.destroy()
