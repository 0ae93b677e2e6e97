"""Plain-text output of the demo: progress lines, the lock listing, the final table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from taskguard import display
from taskguard.lease import LockInfo

__all__ = ["FeedTally", "feed_name", "locks_table", "progress_line", "summary_table"]


@dataclass
class FeedTally:
    """Outcome counts for one feed."""

    feed: str
    submitted: int = 0
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    #: Max concurrent executions, from the recorded start/end times.
    max_at_once: int = 0
    #: Fencing tokens of the runs, in the order they ran.
    tokens: list[int] = field(default_factory=list)

    @property
    def finished(self) -> int:
        return self.ran + self.skipped + self.failed


def feed_name(feed_url: str) -> str:
    """``https://example.com/feeds/news.rss`` -> ``news``."""
    return feed_url.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0] or feed_url


def locks_table(infos: Sequence[LockInfo]) -> list[str]:
    """Live leases, in the columns (and with the escaping) of ``taskguard locks``."""
    if not infos:
        return ["no locks held"]
    return display.locks_table(infos)


def progress_line(
    elapsed: float,
    submitted: int,
    total: int,
    tallies: Sequence[FeedTally],
    running: dict[str, int],
) -> str:
    """One line of live progress: counts, and which feeds are being imported now."""
    ran = sum(t.ran for t in tallies)
    skipped = sum(t.skipped for t in tallies)
    failed = sum(t.failed for t in tallies)
    waiting = submitted - ran - skipped - failed
    now = [
        display.printable(feed_name(feed)) + (f" x{n} (!)" if n > 1 else "")
        for feed, n in sorted(running.items())
        if n
    ]
    parts = [
        f"[{elapsed:5.1f}s] submitted {submitted:>{len(str(total))}}/{total}",
        f"ran {ran:>3}",
        f"skipped {skipped:>3}",
    ]
    if failed:
        parts.append(f"failed {failed}")
    parts.append(f"pending {waiting:>3}")
    parts.append("importing: " + (", ".join(now) if now else "-"))
    return " | ".join(parts)


def summary_table(tallies: Sequence[FeedTally], show_tokens: bool) -> list[str]:
    """The final per-feed table with a total row (and each feed's fencing tokens)."""
    total = FeedTally(
        "total",
        submitted=sum(t.submitted for t in tallies),
        ran=sum(t.ran for t in tallies),
        skipped=sum(t.skipped for t in tallies),
        failed=sum(t.failed for t in tallies),
        max_at_once=max((t.max_at_once for t in tallies), default=0),
    )
    everything = [*tallies, total]
    headers = ["FEED", "SUBMITTED", "RAN", "SKIPPED", "FAILED", "MAX AT ONCE"]
    rows = [
        [t.feed, str(t.submitted), str(t.ran), str(t.skipped), str(t.failed), str(t.max_at_once)]
        for t in everything
    ]
    lines = display.table(headers, rows, right=5)
    if not show_tokens:
        return lines
    tokens = ["FENCING TOKENS", *(",".join(map(str, t.tokens)) for t in tallies), ""]
    return [f"{line}  {tok}".rstrip() for line, tok in zip(lines, tokens, strict=True)]
