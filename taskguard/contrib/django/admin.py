"""Admin pages: held locks and lock history (read-only), and a force-release action
that needs its own permission (``taskguard.force_release_lock``) and is recorded in
the history with the admin user's name. Registered only when the locks live in a
Django database (no ``TASKGUARD_DATABASE_URL``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin, messages

from taskguard.contrib.django import conf
from taskguard.contrib.django.models import FORCE_RELEASE_PERMISSION, HeldLock, LockEvent
from taskguard.contrib.django.release import force_release_as

__all__ = ["HeldLockAdmin", "LockEventAdmin"]


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
        "key",
        "slot",
        "task_name",
        "task_id",
        "hostname",
        "pid",
        "token",
        "acquired_at",
        "expires_at",
    )
    search_fields = ("key", "task_name", "task_id")
    list_filter = ("task_name", "hostname")
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
                f"force-released {len(result.released)} key(s): {', '.join(result.released)}",
                messages.SUCCESS,
            )
        if result.not_held:
            self.message_user(
                request,
                f"no longer held: {', '.join(result.not_held)}",
                messages.WARNING,
            )

    def has_force_release_permission(self, request: Any) -> bool:
        return bool(request.user.has_perm(FORCE_RELEASE_PERMISSION))


class LockEventAdmin(_ReadOnly):
    """The lock history (``task_lock_events``): grants, conflicts, releases, ..."""

    list_display = (
        "at",
        "event",
        "key",
        "slot",
        "owner",
        "token",
        "duration",
        "task_name",
        "hostname",
        "pid",
        "detail",
    )
    search_fields = ("key", "task_name", "task_id")
    list_filter = ("event", "task_name", "at")
    actions = None


# With TASKGUARD_DATABASE_URL the locks are outside Django's databases, where these
# models cannot read them: no pages rather than pages that fail.
if not getattr(settings, conf.URL_SETTING, None):
    admin.site.register(HeldLock, HeldLockAdmin)
    admin.site.register(LockEvent, LockEventAdmin)
