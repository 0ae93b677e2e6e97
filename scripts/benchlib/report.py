"""Ratios, targets and the printed table, all computed from one run's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchlib.common import Row


def compute_ratios(rows: Sequence[Row]) -> None:
    """Fill ``row.ratio`` from the row's reference in the same run."""
    by_id = {r.id: r for r in rows}
    for row in rows:
        if row.ref is None:
            continue  # a row without a reference may carry its own ratio (see its note)
        ref = by_id.get(row.ref)
        row.ratio = None
        if ref is None or row.status != "ok" or ref.status != "ok":
            continue
        if row.ratio_kind in ("cost", "rate") and row.rate and ref.rate:
            row.ratio = ref.rate / row.rate if row.ratio_kind == "cost" else row.rate / ref.rate
        elif row.ratio_kind == "p50" and row.p50_ms and ref.p50_ms:
            row.ratio = row.p50_ms / ref.p50_ms
        elif row.ratio_kind == "p99" and row.p99_ms and ref.p99_ms:
            row.ratio = row.p99_ms / ref.p99_ms


def _extra_ratio(by_id: dict[str, Row], row_id: str, ref_id: str, name: str) -> float | None:
    """``row.extra[name] / ref.extra[name]`` for two measured rows of one run."""
    mine, theirs = _extra(by_id, row_id, name), _extra(by_id, ref_id, name)
    return mine / theirs if mine is not None and theirs else None


def _rate(by_id: dict[str, Row], row_id: str) -> float | None:
    row = by_id.get(row_id)
    return row.rate if row is not None and row.status == "ok" else None


def targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue 35's targets (its numbering), then the guarantees every run checks: each
    met / missed (with the figure) / not measured; then
    figures shown for information (``limit`` None: no verdict)."""
    by_id = {r.id: r for r in rows}
    out: list[dict[str, Any]] = []

    def add(name: str, figure: float | None, limit: float | None, op: str, how: str) -> None:
        met = None
        if figure is not None and limit is not None:
            met = figure <= limit if op == "<=" else figure >= limit
        out.append(
            {"target": name, "figure": figure, "limit": limit, "op": op, "met": met, "how": how}
        )

    def ratio(row_id: str) -> float | None:
        row = by_id.get(row_id)
        return row.ratio if row is not None else None

    def rates(row_id: str, over: str) -> float | None:
        """One row's rate over another's (rows of one run), if both were measured."""
        a, b = _rate(by_id, row_id), _rate(by_id, over)
        return a / b if a and b else None

    def split(row_id: str, ref_id: str, name: str) -> float | None:
        return _extra_ratio(by_id, f"split.{row_id}", f"split.{ref_id}", name)

    client = "client CPU (publisher + worker main + pool processes) added per task over the plain"
    add(
        "1. split topology: guarded >= celery-once tasks/s",
        rates("split.guarded", "split.once"),
        1.0,
        ">=",
        "tasks/s, @guarded_task / celery-once, servers on one core, clients on the other "
        "(section 7)",
    )
    add(
        "2. client CPU per guarded task <= celery-once's",
        split("guarded", "once", "client_added_us"),
        1.0,
        "<=",
        f'{client} task, @guarded_task(lock="run") / celery-once (section 7)',
    )
    add(
        "3. PostgreSQL CPU per guarded task <= 1.15 x the minimal lock",
        split("guarded", "minimal", "postgres_added_us"),
        1.15,
        "<=",
        "CPU of the private cluster's processes per task, @guarded_task / the minimal lock "
        "by hand, finished records on (section 7)",
    )
    add(
        '4. lock="queue_and_run" client CPU <= 1.2 x celery-once\'s',
        split("queue_and_run", "once", "client_added_us"),
        1.2,
        "<=",
        f'{client} task, lock="queue_and_run" / celery-once (section 7)',
    )
    add(
        '4. lock="queue_and_run" PostgreSQL CPU <= 1.5 x the minimal lock',
        split("queue_and_run", "minimal", "postgres_added_us"),
        1.5,
        "<=",
        'CPU of the private cluster\'s processes per task, lock="queue_and_run" / the minimal '
        "lock by hand (section 7)",
    )
    add(
        "5. pair time <= 1.10 x the minimal lock",
        ratio("pair.taskguard"),
        1.10,
        "<=",
        "time per acquire+release pair, taskguard / the minimal lock by hand (durable)",
    )
    add(
        "5. pair client CPU <= 1.25 x the minimal lock",
        _extra_ratio(by_id, "pair.taskguard", "pair.minimal", "client_cpu_us_per_pair"),
        1.25,
        "<=",
        "client CPU per pair, taskguard / the minimal lock by hand",
    )
    add(
        "6. behind a pooler: pair PostgreSQL CPU <= 1.5 x direct",
        _extra_ratio(by_id, "pair.taskguard_unnamed", "pair.taskguard", "server_cpu_us_per_pair"),
        1.5,
        "<=",
        "PostgreSQL CPU per pair, taskguard with unnamed statements (as behind a transaction "
        "pooler) / taskguard direct",
    )
    add(
        "7. compat: singleton duplicate <= celery-singleton's",
        ratio("compat.singleton_dup"),
        1.0,
        "<=",
        "p50 time per duplicate (lock refused, then get of the holder's task id), taskguard's "
        "celery-singleton backend / celery-singleton's Redis backend (section 9)",
    )
    for mode in ("durable", "relaxed"):
        add(
            f"scale: acquire p50 at 1M rows <= 1.2 x at 1k rows ({mode})",
            ratio(f"scale.acquire_large_{mode}"),
            1.2,
            "<=",
            "acquire p50 latency ratio",
        )
    add(
        "scale: reaper >= 100k rows/s",
        _rate(by_id, "scale.reaper"),
        100_000.0,
        ">=",
        "rows deleted / s",
    )
    overlaps = [
        r.extra.get("overlaps") for r in rows if r.id.startswith("contention.") and r.status == "ok"
    ]
    add(
        "contention: 0 overlapping grants",
        float(sum(overlaps)) if overlaps else None,
        0.0,
        "<=",
        "grants seen held by two processes at once (shared counter per key)",
    )
    add(
        "refusal: a refused acquire <= celery-once's",
        ratio("refusal.taskguard"),
        1.0,
        "<=",
        "time per refusal with the holder reported, taskguard / celery-once raise_or_lock",
    )
    peaks = [
        _extra(by_id, f"storm.{m}", "max_at_once") for m in ("run", "queue_and_run", "coalesce")
    ]
    add(
        "storm: taskguard runs one feed at most once at a time",
        None if None in peaks else float(max(p for p in peaks if p is not None)),
        1.0,
        "<=",
        'most runs of one feed at once, lock="run", "queue_and_run" and on_conflict="coalesce", '
        "from run start/end times",
    )
    add(
        "storm: same when runs outlive the ttl (renewed)",
        _extra(by_id, "storm.overrun_run", "max_at_once"),
        1.0,
        "<=",
        "most runs of one feed at once, 1.5 s runs under a 1 s ttl",
    )
    # -- for information ----------------------------------------------------------------
    add(
        "same box: guarded tasks/s / celery-once's",
        rates("e2e.guarded", "e2e.once"),
        None,
        ">=",
        "tasks/s, everything on the same 2 cores (section 4)",
    )
    add(
        "pair PostgreSQL CPU / the minimal lock's",
        _extra_ratio(by_id, "pair.taskguard", "pair.minimal", "server_cpu_us_per_pair"),
        None,
        "<=",
        "CPU of the pair's PostgreSQL backend, taskguard / the minimal lock by hand",
    )
    add(
        "MariaDB: pair time / the same SQL by hand",
        ratio("pair.maria_taskguard"),
        None,
        "<=",
        "time per pair, taskguard / its own SQL by hand on mysqlclient (durable)",
    )
    add(
        "behind PgBouncer (transaction pooling): pair PostgreSQL CPU / direct",
        _extra_ratio(
            by_id, "pair.taskguard_pgbouncer_tx", "pair.taskguard", "server_cpu_us_per_pair"
        ),
        None,
        "<=",
        "PostgreSQL CPU per pair through the system's PgBouncer (unnamed statements) / direct",
    )
    add(
        "behind PgBouncer >= 1.21 (max_prepared_statements), named: pair PostgreSQL CPU / direct",
        _extra_ratio(
            by_id, "pair.taskguard_pgbouncer_prepared", "pair.taskguard", "server_cpu_us_per_pair"
        ),
        None,
        "<=",
        "PostgreSQL CPU per pair through the PgBouncer TASKGUARD_BENCH_PGBOUNCER_PREPARED_BIN "
        "names, prepare_threshold=5 / direct",
    )
    for name, field in (("client CPU", "client_added_us"), ("PostgreSQL CPU", "postgres_added_us")):
        add(
            f"without finished records: guarded {name} / the minimal lock's",
            split("guarded_no_records", "minimal", field),
            None,
            "<=",
            "the same with taskguard_finished_retention=0 (a second worker, section 7): "
            "what the records cost",
        )
    return out


def _extra(by_id: dict[str, Row], row_id: str, name: str) -> float | None:
    row = by_id.get(row_id)
    if row is None or row.status != "ok" or row.extra.get(name) is None:
        return None
    return float(row.extra[name])


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def format_table(rows: Sequence[Row]) -> str:
    """Markdown table of every row (status instead of figures where a row did not run)."""
    by_id = {r.id: r for r in rows}
    lines = [
        "| section | row | rate | p50 ms | p99 ms | ratio | vs | notes |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ref = by_id.get(r.ref or "")
        vs = ""
        if ref is not None:
            vs = {
                "cost": "x time of ",
                "rate": "x rate of ",
                "p50": "x p50 of ",
                "p99": "x p99 of ",
            }[r.ratio_kind] + ref.label
        if r.status != "ok":
            lines.append(f"| {r.section} | {r.label} | {r.status} | | | | {vs} | {r.note} |")
            continue
        digits = 2 if r.unit == "x" else 1 if r.rate is not None and r.rate < 100 else 0
        rate = f"{_num(r.rate, digits)} {r.unit}"
        lines.append(
            f"| {r.section} | {r.label} | {rate} | {_num(r.p50_ms, 3)} | {_num(r.p99_ms, 3)} "
            f"| {_num(r.ratio, 2)} | {vs} | {r.note} |"
        )
    return "\n".join(lines)


def format_targets(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| target | figure | verdict | measured as |", "|---|---:|---|---|"]
    for t in results:
        fig = t["figure"]
        if fig is None:
            verdict, shown = "not measured", "-"
        elif t["limit"] is None:
            verdict, shown = "(information)", _num(fig, 3)
        else:
            shown = _num(fig, 0 if t["limit"] >= 1000 else 3)
            if t["met"]:
                verdict = "met"
            elif t["limit"]:
                miss = (fig / t["limit"] - 1.0) if t["op"] == "<=" else (1.0 - fig / t["limit"])
                verdict = f"MISSED by {miss:.1%}"
            else:
                verdict = "MISSED"
        lines.append(f"| {t['target']} | {shown} | {verdict} | {t['how']} |")
    return "\n".join(lines)


def format_storm(rows: Sequence[Row]) -> str:
    """The storm section's own table (its figures are counts, not rates); "" without it."""
    storm = [r for r in rows if r.id.startswith("storm.")]
    if not storm:
        return ""
    lines = [
        "| storm variant | drained in s | submitting s | runs | refused at submit "
        "| skipped at worker | max runs of one feed at once | runs overlapping another |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in storm:
        if r.status != "ok":
            lines.append(f"| {r.label} | {r.status} | | | | | | |")
            continue
        x = r.extra
        lines.append(
            f"| {r.label} | {x['wall_s']:.2f} | {x['submit_s']:.2f} | {x['runs']:,} "
            f"| {x['refused_at_submit']:,} | {x['skipped_at_worker']:,} | {x['max_at_once']} "
            f"| {x['overlapping_runs']:,} |"
        )
    return "\n".join(lines)
