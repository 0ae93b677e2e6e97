"""The task from the Celery cookbook's "Ensuring a task is only executed one at a
time", with taskguard instead of a cache lock."""

import os

from django.db.models.functions import Now
from feedsite.celery import app

from djangofeeds.models import Feed, ImportRun
from taskguard import guarded_task


@guarded_task(app=app, key="feed:{feed_url}", ttl=60, lock="run", on_conflict="skip")
def import_feed(feed_url: str, batch: str = "") -> int:
    """Import one feed; a second call for the same feed_url while one runs is skipped."""
    run = ImportRun.objects.create(
        batch=batch, feed_url=feed_url, pid=os.getpid(), started_at=Now()
    )
    feed = Feed.objects.import_feed(feed_url)
    ImportRun.objects.filter(pk=run.pk).update(ended_at=Now())
    return feed.import_count
