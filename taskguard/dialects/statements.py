"""The statements every dialect shares, built once per dialect from its
:class:`~taskguard.dialects.base.Dialect` hooks and compiled for the engine's
SQLAlchemy dialect (no per-call compilation on the hot path)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    bindparam,
    case,
    distinct,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.engine import Dialect as SADialect
from sqlalchemy.sql import func
from sqlalchemy.sql.elements import BindParameter

from taskguard.dialects.base import (
    HOLDER_COLS,
    INFO_COLS,
    Dialect,
    Flavor,
    LockSQL,
    Statement,
    T,
    compile_for,
)
from taskguard.dialects.event_statements import event_statements
from taskguard.models import SQLITE_TOKEN_TABLE

__all__ = ["build_lock_sql"]

_t = T
_ROW_COLS = (
    _t.c.key,
    _t.c.slot,
    _t.c.owner,
    _t.c.token,
    _t.c.acquired_at,
    _t.c.expires_at,
    *(_t.c[c] for c in INFO_COLS),
)

#: The text statements' grant columns; their values end ``…, :pid, :phase, :n``.
INSERT_COLS = (
    "key, slot, owner, token, acquired_at, expires_at, task_name, task_id, hostname, pid, "
    "phase, slots"
)
TAKEOVER_SET = (
    "owner = excluded.owner, token = {token}, acquired_at = excluded.acquired_at, "
    "expires_at = excluded.expires_at, task_name = excluded.task_name, "
    "task_id = excluded.task_id, hostname = excluded.hostname, pid = excluded.pid, "
    "phase = excluded.phase, slots = excluded.slots, "
    "next_owner = {next_owner}, next_since = {next_since}, next_until = {next_until}"
)
#: The reserved waiter's grant uses its reservation up (see _used_up).
_USED_UP_SQL = (
    "CASE WHEN task_locks.next_owner = excluded.owner THEN NULL ELSE task_locks.{col} END"
)


def _free(fl: Flavor, owner: ColumnElement[Any], t: Any = _t) -> ColumnElement[bool]:
    """The row's lease ended and it is not reserved for another waiter."""
    return and_(
        t.c.expires_at <= fl.now,
        or_(
            t.c.next_owner.is_(None),
            t.c.next_owner == owner,
            t.c.next_owner == t.c.owner,  # the reserved waiter got it: used up
            t.c.next_until <= fl.now,
            t.c.expires_at <= fl.grace_ago,
        ),
    )


def _unreserved(t: Any = _t) -> ColumnElement[bool]:
    """The lean acquire's waiter condition: no waiter's reservation is on the row (a
    row whose lease ended and that no waiter announced itself on). Any row it does
    not hold for goes to :func:`_free`'s full rules, so this may be stricter than
    they are, never looser."""
    unreserved: ColumnElement[bool] = t.c.next_owner.is_(None)
    return unreserved


def _lean_free(fl: Flavor, t: Any = _t) -> ColumnElement[bool]:
    """The row's lease ended and no waiter has reserved it: implies :func:`_free`."""
    return and_(t.c.expires_at <= fl.now, _unreserved(t))


_RESERVATION = ("next_owner", "next_since", "next_until")


def _used_up(owner: ColumnElement[Any]) -> dict[str, ColumnElement[Any]]:
    """A grant to the reserved waiter ends its reservation, so later releases free
    the row for anyone at once; another waiter's reservation is kept."""
    return {col: case((_t.c.next_owner == owner, null()), else_=_t.c[col]) for col in _RESERVATION}


def free_sql(fl: Flavor, row: str, owner: str) -> str:
    """:func:`_free` as text, for the statements written as text."""
    return (
        f"{row}.expires_at <= {fl.now_sql} AND ({row}.next_owner IS NULL"
        f" OR {row}.next_owner = {owner} OR {row}.next_owner = {row}.owner"
        f" OR {row}.next_until <= {fl.now_sql} OR {row}.expires_at <= {fl.grace_ago_sql})"
    )


def build_lock_sql(d: Dialect, sa_dialect: SADialect) -> LockSQL:
    """Compile every statement for ``d`` on the engine's ``sa_dialect``."""
    fl = d.flavor()
    now = fl.now

    def c(stmt: Any) -> Any:
        return compile_for(stmt, sa_dialect)

    own = d.own_statements(fl)
    # A dialect that writes its own acquire need not offer the upsert hooks.
    by_hooks = "acquire" not in own
    acquire = (
        d.reading_refusal(_acquire(d, fl), fl, False, sa_dialect) if by_hooks else own["acquire"]
    )
    acquire_unless = (
        d.reading_refusal(_acquire(d, fl, True), fl, True, sa_dialect) if by_hooks else None
    )
    lean = by_hooks and d.lean_acquire
    acquire_lean = c(_acquire(d, fl, lean=True)) if lean else None
    acquire_unless_lean = c(_acquire(d, fl, True, lean=True)) if lean else None
    acquire_slots = own["acquire_slots"] if "acquire_slots" in own else _acquire_slots(d, fl)

    mine = and_(
        _t.c.key == bindparam("key"),
        _t.c.slot == bindparam("slot"),
        _t.c.owner == bindparam("owner"),
        _t.c.expires_at > now,
    )
    lease_cols = (_t.c.token, _t.c.acquired_at, _t.c.expires_at)
    # A release only ends a lease: one lost in a database crash keeps the key taken
    # until its expiry, never lets two hold it, so it need not wait for durability;
    # nor need a waiter's place in line (renewed every 0.5 s). Grants and renewals
    # always wait (they must survive a crash).
    quick = [q] if (q := d.quick_commit()) is not None else []
    held_until = fl.add(_t.c.acquired_at, "hold")
    release = update(_t).where(mine, *quick).values(expires_at=now)
    release_hold = update(_t).where(mine, *quick).values(expires_at=fl.greatest(now, held_until))
    renew = update(_t).where(mine).values(expires_at=fl.plus("ttl")).returning(*lease_cols)
    confirm = update(_t).where(mine).values(expires_at=_t.c.expires_at).returning(*lease_cols)
    renew_hold = (
        update(_t)
        .where(mine)
        .values(expires_at=fl.greatest(fl.plus("ttl"), held_until))
        .returning(*lease_cols)
    )
    # Adoption under a new owner id: once one caller has it, the handed-over owner
    # (:from_owner) no longer matches, so a second adopter of the same message fails.
    handed = and_(
        _t.c.key == bindparam("key"),
        _t.c.slot == bindparam("slot"),
        _t.c.owner == bindparam("from_owner"),
        _t.c.expires_at > now,
    )
    new_holder: dict[str, Any] = {col: bindparam(col) for col in ("owner", *HOLDER_COLS)}
    # The adopter's phase (a run adopting its enqueue's lease); NULL keeps the row's.
    new_holder["phase"] = func.coalesce(bindparam("phase", type_=_t.c.phase.type), _t.c.phase)
    handover, handover_hold = (
        update(_t).where(handed).values(expires_at=e, **new_holder).returning(*lease_cols)
        for e in (fl.plus("ttl"), fl.greatest(fl.plus("ttl"), held_until))
    )

    # Waiters: every waiter raises wanted_until (a release before it wakes them); the
    # one that has waited longest becomes next_owner (see _free).
    since = func.coalesce(fl.ts_bind("since"), now)
    until = fl.plus("wait")
    lead = or_(
        _t.c.next_owner.is_(None),
        _t.c.next_owner == bindparam("owner"),
        _t.c.next_owner == _t.c.owner,
        _t.c.next_until <= now,
        _t.c.next_since > since,
    )
    announce = (
        update(_t)
        .where(
            _t.c.key == bindparam("key"),
            _t.c.slot >= bindparam("first"),
            _t.c.slot < bindparam("n"),
            _t.c.expires_at > fl.grace_ago,
            *quick,  # a place in line lost in a crash: announced again within 0.5 s
        )
        .values(
            wanted_until=fl.greatest(func.coalesce(_t.c.wanted_until, until), until),
            next_owner=case((lead, bindparam("owner")), else_=_t.c.next_owner),
            next_since=case((lead, since), else_=_t.c.next_since),
            next_until=case((lead, until), else_=_t.c.next_until),
        )
        .returning(_t.c.slot, _t.c.owner, _t.c.expires_at, _t.c.next_owner, now)
    )
    withdraw = (
        update(_t)
        .where(
            _t.c.key == bindparam("key"),
            _t.c.next_owner == bindparam("owner"),
            _t.c.owner != bindparam("owner"),
            *quick,
        )
        .values(next_owner=null(), next_since=null(), next_until=null())
    )

    row_and_now = (*_ROW_COLS, now.label("read_at"))
    get = select(*row_and_now).where(_t.c.key == bindparam("key")).order_by(_t.c.slot)
    get_owner = select(*row_and_now).where(
        _t.c.key == bindparam("key"),
        _t.c.slot == bindparam("slot"),
        _t.c.owner == bindparam("owner"),
    )
    # substr() rather than LIKE: no wildcard escaping, and SQLite's LIKE ignores case.
    prefix: BindParameter[str] = bindparam("prefix")
    prefix_match = func.substr(_t.c.key, 1, func.length(prefix)) == prefix
    by_key = (_t.c.key, _t.c.slot)
    held = select(*row_and_now).where(prefix_match, _t.c.expires_at > now)
    held_all = select(*row_and_now).where(prefix_match)
    force_release = (
        update(_t)
        .where(_t.c.key == bindparam("key"), _t.c.expires_at > now)
        .values(expires_at=now)
        .returning(_t.c.slot, _t.c.owner, _t.c.token, *(_t.c[col] for col in HOLDER_COLS))
    )
    events = event_statements(fl)
    reaped_events = d.reaped_events_sql()
    shared: dict[str, Any] = dict(
        acquire=acquire,
        acquire_slots=acquire_slots,
        release=release,
        renew=renew,
        confirm=confirm,
        release_hold=release_hold,
        renew_hold=renew_hold,
        handover=handover,
        handover_hold=handover_hold,
        get=get,
        get_owner=get_owner,
        held=held.order_by(*by_key).limit(bindparam("limit")),
        held_all=held_all.order_by(*by_key).limit(bindparam("limit")),
        force_release=force_release,
        db_now=select(now),
        waited_for=select(func.count(distinct(_t.c.key))).where(_t.c.wanted_until > now),
        announce=announce,
        withdraw=withdraw,
        reap_batch=text(d.reap_sql(history=False)),
        reap_batch_history=text(d.reap_sql(history=True)),
        record_event=events["record_event"],
        record_ended=events["record_ended"],
        events=events["events"],
        recent_events=events["recent_events"],
        trim_events=events["trim_events"],
    )

    def compiled(name: str) -> Any:
        stmt = own.get(name, shared[name])
        if isinstance(stmt, Statement):  # compiled by the dialect
            return stmt
        if isinstance(stmt, tuple):  # (statement, the read that follows it)
            first, then = stmt
            return dataclasses.replace(c(first), then=c(then))
        return c(stmt)

    return LockSQL(
        **{name: compiled(name) for name in shared},
        reaped_events=None if reaped_events is None else c(text(reaped_events)),
        acquire_unless=acquire_unless,
        acquire_lean=acquire_lean,
        acquire_unless_lean=acquire_unless_lean,
        release_marking=dataclasses.replace(
            c(text(_with_fields(d, fl, d.release_marking_sql))), returns_rows=False
        )
        if d.release_marking_sql
        else None,
    )


def _acquire(d: Dialect, fl: Flavor, unless: bool = False, lean: bool = False) -> Any:
    """The shared ``INSERT … SELECT … ON CONFLICT DO UPDATE … WHERE <free>``;
    ``unless``: no row to insert (so no takeover either) while key ``:unless`` is held.

    ``lean``: the common case's statement, which grants only a row no waiter has
    reserved (:func:`_lean_free`) and so needs no reservation bookkeeping; it
    returns nothing wherever the full one might decide otherwise (then the full one
    is sent: :meth:`Store.grant <taskguard.store.Store.grant>`)."""
    now = fl.now
    grant_cols = {
        "key": bindparam("key"),
        "slot": bindparam("slot"),
        "owner": bindparam("owner"),
        "token": d.token_insert(),
        "acquired_at": now,
        "expires_at": fl.plus("ttl"),
        **{col: bindparam(col) for col in HOLDER_COLS},
        "phase": bindparam("phase", type_=_t.c.phase.type),
        "slots": bindparam("n", type_=_t.c.slots.type),
    }
    refusals = []
    if not lean:
        # A key someone holds is refused by a read: without this pre-check the upsert
        # would lock the live row to evaluate its takeover condition, which makes every
        # refusal a write transaction (PostgreSQL: an xid, a commit record and a WAL
        # flush per refused duplicate). The takeover condition below still decides
        # every grant; the pre-check can only refuse a row that was live or reserved
        # at the statement's start.
        cur = _t.alias("cur")
        taken: Select[Any] = (
            select(literal_column("1"))
            .select_from(cur)
            .where(
                cur.c.key == bindparam("key"),
                cur.c.slot == bindparam("slot"),
                ~_free(fl, bindparam("owner"), cur),
            )
        )
        refusals.append(~taken.exists())
    if unless:
        marker = _t.alias("marker")
        refusals.append(
            ~select(literal_column("1"))
            .select_from(marker)
            .where(marker.c.key == bindparam("unless"), marker.c.expires_at > now)
            .exists()
        )
    ins = (
        d.insert(_t).from_select(list(grant_cols), select(*grant_cols.values()).where(*refusals))
        if refusals
        else d.insert(_t).values(**grant_cols)
    )
    takeover = {
        "owner": ins.excluded.owner,
        "token": d.token_takeover(ins),
        "acquired_at": ins.excluded.acquired_at,
        "expires_at": ins.excluded.expires_at,
        **{col: getattr(ins.excluded, col) for col in INFO_COLS},
    }
    if lean:
        # No pre-check (setting up its subquery cost a grant more than a third of the
        # statement's server time): a refusal locks the live row, so it is a write
        # transaction, committed without waiting for the WAL flush (nothing of it
        # needs to survive a crash). A key once refused goes to the full statement
        # first (Store.grant), so a duplicate storm is refused by its reads.
        q = d.quick_commit()
        condition: ColumnElement[bool] = (
            _lean_free(fl) if q is None else case((_lean_free(fl), true()), else_=~q)
        )
    else:
        takeover.update(_used_up(ins.excluded.owner))
        condition = _free(fl, ins.excluded.owner)
    return ins.on_conflict_do_update(
        index_elements=[_t.c.key, _t.c.slot],
        set_=takeover,
        # The takeover condition. NOT index_where (that is the arbiter index predicate).
        where=condition,
    ).returning(_t.c.token, _t.c.acquired_at, _t.c.expires_at)


def _acquire_slots(d: Dialect, fl: Flavor) -> Any:
    return text(_with_fields(d, fl, d.acquire_slots_sql))


def _with_fields(d: Dialect, fl: Flavor, sql: str) -> str:
    """A dialect's text statement with the shared fragments filled in."""
    return sql.format(
        cols=INSERT_COLS,
        counter=SQLITE_TOKEN_TABLE,
        now=fl.now_sql,
        plus_ttl=fl.plus_sql("ttl"),
        plus_mark_ttl=fl.plus_sql("mark_ttl"),
        free_t=free_sql(fl, "t", ":owner"),
        free_row=free_sql(fl, "task_locks", "excluded.owner"),
        takeover=TAKEOVER_SET.format(
            token=d.takeover_token_sql,
            **{c: _USED_UP_SQL.format(col=c) for c in _RESERVATION},
        ),
    )
