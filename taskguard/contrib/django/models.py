"""Read-only Django views of taskguard's tables, for the admin (``managed = False``:
the tables are created by taskguard's own migrations, see
``migrations/0001_initial.py``).

:class:`HeldLock` reads the ``task_locks_held`` view (live leases only, judged by
the database clock). Its ``key`` stands in as primary key: a key with a
concurrency limit has one row per slot, and the admin acts on whole keys anyway.
"""

from __future__ import annotations

from django.db import models

__all__ = ["FORCE_RELEASE_PERMISSION", "HeldLock", "LockEvent"]

#: ``app_label.codename`` of the permission the admin's force-release action needs.
FORCE_RELEASE_PERMISSION = "taskguard.force_release_lock"


class HeldLock(models.Model):
    """A live lease (one slot of a key), as ``taskguard locks`` lists it."""

    key = models.CharField(max_length=255, primary_key=True)
    slot = models.SmallIntegerField()
    owner = models.CharField(max_length=32)
    token = models.BigIntegerField()
    task_name = models.CharField(max_length=255, null=True, blank=True)
    task_id = models.CharField(max_length=255, null=True, blank=True)
    hostname = models.CharField(max_length=255, null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    #: The lock phase (``queue``, ``run``) and the key's limit its grant recorded.
    phase = models.CharField(max_length=8, null=True, blank=True)
    slots = models.SmallIntegerField(null=True, blank=True)

    class Meta:
        managed = False
        db_table = "task_locks_held"
        ordering = ("key", "slot")
        verbose_name = "held lock"
        verbose_name_plural = "held locks"
        default_permissions = ("view",)
        permissions = (("force_release_lock", "Can force-release a held lock"),)

    def __str__(self) -> str:
        return self.key if not self.slot else f"{self.key} (slot {self.slot})"


class LockEvent(models.Model):
    """One row of the lock history (``task_lock_events``)."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField()
    key = models.CharField(max_length=255)
    slot = models.SmallIntegerField()
    event = models.CharField(max_length=16)
    owner = models.CharField(max_length=32, null=True, blank=True)
    token = models.BigIntegerField(null=True, blank=True)
    duration = models.FloatField(null=True, blank=True, help_text="seconds")
    task_name = models.CharField(max_length=255, null=True, blank=True)
    task_id = models.CharField(max_length=255, null=True, blank=True)
    hostname = models.CharField(max_length=255, null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    detail = models.CharField(max_length=500, null=True, blank=True)

    class Meta:
        managed = False
        db_table = "task_lock_events"
        ordering = ("-at", "-id")
        verbose_name = "lock event"
        verbose_name_plural = "lock history"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.event} {self.key}"
