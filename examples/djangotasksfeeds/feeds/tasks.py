"""The cookbook's "one import of a feed at a time" on django.tasks, two ways."""

import os

from django.conf import settings
from django.db.models.functions import Now

from feeds.models import Feed, ImportRun
from taskguard.contrib.django_tasks import guarded

try:
    from django.tasks import task
except ImportError:  # Django < 6: the django-tasks backport
    from django_tasks import task


def _import(feed_url: str, batch: str) -> int:
    run = ImportRun.objects.create(
        batch=batch, feed_url=feed_url, pid=os.getpid(), started_at=Now()
    )
    feed = Feed.objects.import_feed(feed_url)
    ImportRun.objects.filter(pk=run.pk).update(ended_at=Now())
    return feed.import_count


@task()
@guarded(key="feed:{feed_url}", ttl=settings.FEEDS_LOCK_TTL)
def import_feed(feed_url: str, batch: str = "") -> int:
    """Every enqueue is queued; a run that finds the feed being imported is skipped
    (it returns taskguard's skipped marker)."""
    return _import(feed_url, batch)


@task()
@guarded(key="feed:{feed_url}", ttl=settings.FEEDS_LOCK_TTL, lock="queue_and_run",
         on_conflict="existing")  # fmt: skip
def import_feed_once(feed_url: str, batch: str = "") -> int:
    """At most one job per feed queued or running: enqueueing it again returns that
    job's TaskResult (needs GuardedBackend in TASKS)."""
    return _import(feed_url, batch)


@task()
@guarded(key="feed:{feed_url}", ttl=settings.FEEDS_LOCK_TTL, lock="queue_and_run",
         on_conflict="raise")  # fmt: skip
def import_feed_strict(feed_url: str, batch: str = "") -> int:
    """As ``import_feed_once``, but a duplicate enqueue raises AlreadyLocked."""
    return _import(feed_url, batch)
