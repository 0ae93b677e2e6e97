"""task_locks.phase and task_locks.slots (taskguard's Alembic revision tg0003): the
lock phase a lease is in and its key's limit. The admin's models read the view and
the history table, which this revision leaves as they are: no state change."""

from django.db import migrations

from taskguard.contrib.django.schema_ops import AlembicUpgrade


class Migration(migrations.Migration):
    # Alembic opens its own connection and transaction; Django's must not hold one.
    atomic = False

    dependencies = [("taskguard", "0001_initial")]

    operations = [AlembicUpgrade("tg0003", previous="tg0002")]
