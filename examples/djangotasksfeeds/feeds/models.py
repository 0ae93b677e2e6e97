"""The Celery cookbook's feed importer (as in examples/djangofeeds), for django.tasks."""

import hashlib
import time

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import F
from django.db.models.functions import Now

from taskguard.contrib.django_tasks import current_lease


def fetch(feed_url: str) -> list[str]:
    """Stands in for downloading and parsing the feed, so the example runs offline."""
    time.sleep(settings.FEEDS_FETCH_SECONDS)
    digest = hashlib.sha256(feed_url.encode()).hexdigest()
    return [f"entry {i} of {digest[:8]}" for i in range(3)]


class FeedManager(models.Manager["Feed"]):
    def import_feed(self, feed_url: str) -> "Feed":
        """Download ``feed_url`` and store it, fenced by the run's lease: a worker
        whose lock expired or was taken over cannot store what it downloaded."""
        entries = fetch(feed_url)
        with transaction.atomic():
            lease = current_lease()
            token = lease.fence(connection) if lease is not None else None
            feed, _ = self.get_or_create(url=feed_url)
            self.filter(pk=feed.pk).update(
                import_count=F("import_count") + 1,
                entries=len(entries),
                last_token=token,
                imported_at=Now(),
            )
        feed.refresh_from_db()
        return feed


class Feed(models.Model):
    url = models.URLField(unique=True)
    import_count = models.PositiveIntegerField(default=0)
    entries = models.PositiveIntegerField(default=0)
    #: taskguard's fencing token of the import that wrote this row last.
    last_token = models.BigIntegerField(null=True)
    imported_at = models.DateTimeField(null=True)

    objects = FeedManager()

    def __str__(self) -> str:
        return self.url


class ImportRun(models.Model):
    """One execution of a task, start and end by the database clock: the record
    ``manage.py import_feeds`` reads to show that runs of one feed never overlapped."""

    batch = models.CharField(max_length=32, db_index=True)
    feed_url = models.URLField()
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True)
