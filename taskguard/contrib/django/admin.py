"""Admin pages: held locks and lock history (read-only), and a force-release action
that needs its own permission (``taskguard.force_release_lock``) and is recorded in
the history with the admin user's name. Registered only when the locks live in a
Django database (no ``TASKGUARD_DATABASE_URL``).

Keys, task names, task ids, hosts and details come from whoever took a lock: they
are shown through :func:`taskguard.display.printable`, as ``taskguard``'s command
line shows them (ESC, BEL, bidi overrides such as U+202E become ``\\x1b``,
``\\x07``, ``\\u202e``), in the lists, the filters and the messages alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.db.models import BooleanField, Exists, ExpressionWrapper, OuterRef, Q

from taskguard.companions import ENDING, FINISHED_PREFIX
from taskguard.contrib.django import conf
from taskguard.contrib.django.models import FORCE_RELEASE_PERMISSION, HeldLock, LockEvent
from taskguard.contrib.django.release import force_release_as
from taskguard.display import printable
from taskguard.history import EVENTS, RELEASED

__all__ = ["HeldLockAdmin", "LockEventAdmin"]


def _shown(field: str, label: str | None = None) -> Callable[[Any], str | None]:
    """A list column showing ``field`` made printable (sortable by the field)."""

    def column(obj: Any) -> str | None:
        value = getattr(obj, field)
        return None if value is None else printable(value)

    column.__name__ = field
    shown: Callable[[Any], str | None] = admin.display(
        description=label or field.replace("_", " "), ordering=field
    )(column)
    return shown


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


class _Rows(admin.SimpleListFilter):
    """Held locks by default; companion rows (finished runs' records, pending, rate
    and debounce rows) on request."""

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
        if self.value() == "all":
            return queryset
        if self.value() == "companions":
            return queryset.filter(_companions())
        return queryset.exclude(_companions())


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


class HeldLockAdmin(_ReadOnly):
    """Live leases, as ``taskguard locks`` lists them (database clock)."""

    list_display = (
        _shown("key"),
        "slot",
        _shown("task_name"),
        _shown("task_id"),
        _shown("hostname"),
        "pid",
        "token",
        "acquired_at",
        "expires_at",
    )
    search_fields = ("key", "task_name", "task_id")
    list_filter = (_Rows, _ByTask, _ByHost)
    actions = ("force_release",)

    @admin.action(
        description="Force-release the selected keys (the holders keep running)",
        permissions=["force_release"],
    )
    def force_release(self, request: Any, queryset: Any) -> None:
        keys = sorted(set(queryset.values_list("key", flat=True)))
        result = force_release_as(keys, request.user.get_username())
        if result.released:
            self.message_user(
                request,
                f"force-released {len(result.released)} key(s): "
                + ", ".join(printable(k) for k in result.released),
                messages.SUCCESS,
            )
        if result.not_held:
            self.message_user(
                request,
                "no longer held: " + ", ".join(printable(k) for k in result.not_held),
                messages.WARNING,
            )

    def has_force_release_permission(self, request: Any) -> bool:
        return bool(request.user.has_perm(FORCE_RELEASE_PERMISSION))


class LockEventAdmin(_ReadOnly):
    """The lock history (``task_lock_events``): grants, conflicts, releases, ...
    A grant that was taken over (see :func:`taskguard.history.story`) says so."""

    list_display = (
        "at",
        "what",
        _shown("key"),
        "slot",
        _shown("owner"),
        "token",
        "duration",
        _shown("task_name"),
        _shown("hostname"),
        "pid",
        _shown("detail"),
    )
    search_fields = ("key", "task_name", "task_id")
    list_filter = ("event", _ByTask, "at")
    actions = None

    def get_queryset(self, request: Any) -> Any:
        same_slot = {"key": OuterRef("key"), "slot": OuterRef("slot")}
        released = LockEvent.objects.filter(
            **same_slot, owner=OuterRef("owner"), event__in=RELEASED
        )
        later = LockEvent.objects.filter(**same_slot, event="acquired", token__gt=OuterRef("token"))
        taken_over = Q(event="acquired") & Q(Exists(later)) & ~Q(Exists(released))
        return (
            super()
            .get_queryset(request)
            .annotate(taken_over=ExpressionWrapper(taken_over, output_field=BooleanField()))
        )

    @admin.display(description="event", ordering="event")
    def what(self, obj: Any) -> str:
        name = EVENTS.get(obj.event, printable(obj.event))
        if getattr(obj, "taken_over", False):
            return f"{name}; then taken over (lease expired without release)"
        return name


# With TASKGUARD_DATABASE_URL the locks are outside Django's databases, where these
# models cannot read them: no pages rather than pages that fail.
if not getattr(settings, conf.URL_SETTING, None):
    admin.site.register(HeldLock, HeldLockAdmin)
    admin.site.register(LockEvent, LockEventAdmin)
