"""Admin pages: held locks and lock history (read-only), and a force-release action
that needs its own permission (``taskguard.force_release_lock``) and is recorded in
the history with the admin user's name. Registered only when the locks live in a
Django database (no ``TASKGUARD_DATABASE_URL``).

The action asks first, on a page listing the holders (as Django asks before
deleting). Each row's checkbox carries its key percent-encoded: a browser posts a
CR in a form value as LF, so a raw key with one would name another key.

Keys, task names, task ids, hosts and details come from whoever took a lock: they
are shown through :func:`taskguard.display.printable`, as ``taskguard``'s command
line shows them (ESC, BEL, bidi overrides such as U+202E become ``\\x1b``,
``\\x07``, ``\\u202e``), in the lists, the filters and the messages alike.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.views.main import ChangeList
from django.db.models import Count, OuterRef, Q, Subquery
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html

from taskguard import history
from taskguard.companions import ENDING, FINISHED_PREFIX
from taskguard.contrib.django import conf
from taskguard.contrib.django.models import FORCE_RELEASE_PERMISSION, HeldLock, LockEvent
from taskguard.contrib.django.release import force_release_as
from taskguard.display import phase_text, printable, slots_text
from taskguard.history import EVENTS, secs
from taskguard.lease import Holder

__all__: list[str] = []


def _column(
    field: str, render: Callable[[Any], str], label: str | None = None
) -> Callable[[Any], str | None]:
    """A list column showing ``render(field's value)`` (sortable by the field)."""

    def column(obj: Any) -> str | None:
        value = getattr(obj, field)
        return None if value is None else render(value)

    column.__name__ = field
    shown: Callable[[Any], str | None] = admin.display(
        description=label or field.replace("_", " "), ordering=field
    )(column)
    return shown


def _when(value: datetime) -> str:
    """A time to the millisecond in the current time zone, as ``taskguard`` shows
    times (Django's default stops at the minute)."""
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return f"{value:%Y-%m-%d %H:%M:%S}.{value.microsecond // 1000:03d}"


def _wrapping(value: str) -> str:
    """``value`` made printable, allowed to wrap anywhere (a long key without spaces
    would widen its column past the screen)."""
    safe: str = format_html('<span style="overflow-wrap: anywhere">{}</span>', printable(value))
    return safe


def _shown(field: str, label: str | None = None) -> Callable[[Any], str | None]:
    """A list column showing ``field`` made printable."""
    return _column(field, printable, label)


def _moment(field: str, label: str | None = None) -> Callable[[Any], str | None]:
    return _column(field, _when, label)


class _PrintableValues(admin.SimpleListFilter):
    """A filter on the distinct values of :attr:`field`, shown printable."""

    field = ""

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        # order_by(): the model's ordering would make DISTINCT run over every row.
        values = model_admin.get_queryset(request).order_by().values_list(self.field, flat=True)
        found = sorted({v for v in values.distinct() if v is not None})
        return [(v, printable(v)) for v in found]

    def queryset(self, request: Any, queryset: Any) -> Any:
        value = self.value()
        return queryset if value is None else queryset.filter(**{self.field: value})


class _ByTask(_PrintableValues):
    title = "task name"
    parameter_name = field = "task_name"


class _ByHost(_PrintableValues):
    title = "host"
    parameter_name = field = "hostname"


def _companions() -> Q:
    """The Celery glue's companion rows (:mod:`taskguard.companions`)."""
    return Q(key__startswith=FINISHED_PREFIX) | Q(key__regex=ENDING)


def _rows(queryset: Any, choice: str | None) -> Any:
    """The rows the "rows" filter's ``choice`` lists: held locks by default,
    ``companions`` (finished runs' records, pending, rate and debounce rows), ``all``."""
    if choice == "all":
        return queryset
    if choice == "companions":
        return queryset.filter(_companions())
    return queryset.exclude(_companions())


class _Rows(admin.SimpleListFilter):
    """Held locks by default; companion rows on request. The rows are chosen in
    :meth:`HeldLockAdmin.get_queryset`, so the page's "N total" counts the same kind."""

    title = "rows"
    parameter_name = "rows"
    _CHOICES = ((None, "held locks"), ("companions", "companion rows"), ("all", "every row"))

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, label) for value, label in self._CHOICES if value is not None]

    def choices(self, changelist: Any) -> Any:
        for value, label in self._CHOICES:
            yield {
                "selected": self.value() == value,
                "query_string": changelist.get_query_string(
                    {self.parameter_name: value} if value else {},
                    [] if value else [self.parameter_name],
                ),
                "display": label,
            }

    def queryset(self, request: Any, queryset: Any) -> Any:
        return queryset


class _ReadOnly(admin.ModelAdmin):
    """Nothing is added, changed or deleted through these pages."""

    list_display_links = None

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).using(conf.alias())

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


def _selected(key: str) -> str:
    """A row's checkbox value: its key, percent-encoded. A browser posts a CR in a
    form value as LF (and may change other controls): ASCII comes back as it was."""
    return quote(key, safe="")


class HeldLockAdmin(_ReadOnly):
    """Live leases, as ``taskguard locks`` lists them (database clock)."""

    # Times first and one holder column: a long key wraps instead of pushing the
    # rest off the screen.
    list_display = (
        _moment("acquired_at", "since"),
        _moment("expires_at", "expires"),
        _column("key", _wrapping),
        "holder",
        "phase_shown",
        "slots_shown",
        "slot",
        "token",
    )
    search_fields = ("key", "task_name", "task_id")
    list_filter = (_Rows, _ByTask, _ByHost)
    actions = ("force_release",)
    confirmation_template = "admin/taskguard/heldlock/force_release_confirmation.html"

    def get_queryset(self, request: Any) -> Any:
        rows = _rows(super().get_queryset(request), request.GET.get(_Rows.parameter_name))
        # Each row's key's live rows (the view's), for "2 of 3".
        of_key = HeldLock.objects.using(conf.alias()).filter(key=OuterRef("key")).order_by()
        counted = of_key.values("key").annotate(n=Count("slot")).values("n")[:1]
        return rows.annotate(in_use=Subquery(counted))

    @admin.display(description="phase", ordering="phase")
    def phase_shown(self, obj: Any) -> str:
        return phase_text(obj)

    @admin.display(description="slots")
    def slots_shown(self, obj: Any) -> str:
        return slots_text(obj, {obj.key: obj.in_use or 0})

    @admin.display(description="held by", ordering="task_name")
    def holder(self, obj: Any) -> str:
        """The one holder text (:meth:`taskguard.lease.Holder.describe`), made printable."""
        return printable(Holder(obj.task_name, obj.task_id, obj.hostname, obj.pid).describe())

    # Django < 5.0 takes the column's header (the select-all box) from the description.
    @admin.display(description=getattr(admin.ModelAdmin.action_checkbox, "short_description", None))
    def action_checkbox(self, obj: Any) -> Any:
        return super().action_checkbox(_Checkbox(obj))

    def response_action(self, request: Any, queryset: Any) -> Any:
        # The selected keys, as the checkboxes and the confirmation page encode them.
        posted = request.POST.copy()
        posted.setlist(
            ACTION_CHECKBOX_NAME, [unquote(v) for v in posted.getlist(ACTION_CHECKBOX_NAME)]
        )
        request.POST = posted
        return super().response_action(request, queryset)

    @admin.action(
        description="Force-release the selected keys (the holders keep running)",
        permissions=["force_release"],
    )
    def force_release(self, request: Any, queryset: Any) -> TemplateResponse | None:
        """Asks first (a page listing the holders, as Django asks before deleting);
        then ends every live lease of each selected key and says which were no
        longer held."""
        locks = list(queryset)
        keys = sorted({lock.key for lock in locks})
        gone = sorted(set(request.POST.getlist(ACTION_CHECKBOX_NAME)) - set(keys))
        if keys and not request.POST.get("post"):
            return self._confirmation(request, locks, sorted({*keys, *gone}))
        result = force_release_as(keys, request.user.get_username()) if keys else None
        if result and result.released:
            self.message_user(
                request,
                f"force-released {len(result.released)} key(s): "
                + ", ".join(printable(k) for k in result.released),
                messages.SUCCESS,
            )
        not_held = sorted([*(result.not_held if result else []), *gone])
        if not_held:
            self.message_user(
                request,
                "no longer held: " + ", ".join(printable(k) for k in not_held),
                messages.WARNING,
            )
        return None

    def _confirmation(self, request: Any, locks: list[Any], keys: list[str]) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": "Force-release held locks?",
            "opts": self.opts,
            "locks": [
                {
                    "key": printable(lock.key),
                    "slot": lock.slot,
                    "task": printable(lock.task_name or "-"),
                    "host": printable(lock.hostname or "-"),
                    "pid": "-" if lock.pid is None else lock.pid,
                    "since": _when(lock.acquired_at),
                }
                for lock in locks
            ],
            "selected": [_selected(k) for k in keys],
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.confirmation_template, context)

    def has_force_release_permission(self, request: Any) -> bool:
        return bool(request.user.has_perm(FORCE_RELEASE_PERMISSION))


class _Checkbox:
    """What the admin's checkbox column renders for a row: its key, encoded
    (:func:`_selected`), labelled with the key made printable."""

    def __init__(self, lock: Any) -> None:
        self.pk = _selected(lock.key)
        self._label = printable(str(lock))

    def __str__(self) -> str:
        return self._label


#: At most this many events are read to tell the story of the keys on one page.
_STORY_EVENTS = 10_000


def _event(row: Any) -> history.LockEvent:
    return history.LockEvent(
        id=row.id,
        at=row.at,
        key=row.key,
        slot=row.slot,
        event=row.event,
        owner=row.owner,
        token=row.token,
        duration=row.duration,
        holder=Holder(row.task_name, row.task_id, row.hostname, row.pid),
        detail=row.detail,
    )


class _Told(ChangeList):
    """The history's list, each row worded by the read model: the story
    (:func:`taskguard.history.story`) of the keys on the page, from their events
    since the page's oldest, as ``taskguard explain`` tells it."""

    result_list: Any

    def get_results(self, request: Any) -> None:
        super().get_results(request)
        rows = list(self.result_list)
        if rows:
            recorded = (
                LockEvent.objects.using(conf.alias())
                .filter(key__in={r.key for r in rows}, at__gte=min(r.at for r in rows))
                .order_by("at", "id")[:_STORY_EVENTS]
            )
            by_key: dict[str, list[history.LockEvent]] = {}
            for e in recorded:
                by_key.setdefault(e.key, []).append(_event(e))
            ends = {k: history.endings(history.story(events)) for k, events in by_key.items()}
            for row in rows:
                row.what = history.what(_event(row), ends.get(row.key, {}))
        self.result_list = rows


class _ByEvent(_PrintableValues):
    """Events by the words the rows (and ``taskguard explain``) use."""

    title = "event"
    parameter_name = field = "event"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [(v, EVENTS.get(v, label)) for v, label in super().lookups(request, model_admin)]


class _ByTime(admin.DateFieldListFilter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.title = "time"


class LockEventAdmin(_ReadOnly):
    """The lock history (``task_lock_events``): grants, conflicts, releases, ...
    each worded by the read model (:class:`_Told`): a grant that was taken over
    says so, as ``taskguard explain`` does."""

    list_display = (
        _moment("at"),
        "what",
        _shown("key"),
        "slot",
        _shown("owner"),
        "token",
        # Held for (ending events) or waited (grants, conflicts), as `explain` says it.
        _column("duration", secs),
        _shown("task_name"),
        _shown("hostname"),
        "pid",
        _shown("detail"),
    )
    search_fields = ("key", "task_name", "task_id")
    list_filter = (_ByEvent, _ByTask, ("at", _ByTime))
    actions = None

    def get_changelist(self, request: Any, **kwargs: Any) -> type[ChangeList]:
        return _Told

    @admin.display(description="event", ordering="event")
    def what(self, obj: Any) -> str:
        return printable(getattr(obj, "what", None) or EVENTS.get(obj.event, obj.event))


# With TASKGUARD_DATABASE_URL the locks are outside Django's databases, where these
# models cannot read them: no pages rather than pages that fail.
if not getattr(settings, conf.URL_SETTING, None):
    admin.site.register(HeldLock, HeldLockAdmin)
    admin.site.register(LockEvent, LockEventAdmin)
