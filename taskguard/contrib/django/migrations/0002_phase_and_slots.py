"""task_locks.phase and task_locks.slots (taskguard's Alembic revision tg0003): the
lock phase a lease is in and its key's limit, also in the task_locks_held view the
admin's HeldLock reads."""

from django.db import migrations, models

from taskguard.contrib.django.schema_ops import AlembicUpgrade


class Migration(migrations.Migration):
    # Alembic opens its own connection and transaction; Django's must not hold one.
    atomic = False

    dependencies = [("taskguard", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[AlembicUpgrade("tg0003", previous="tg0002")],
            state_operations=[
                migrations.AddField(
                    model_name="heldlock",
                    name="phase",
                    field=models.CharField(blank=True, max_length=8, null=True),
                ),
                migrations.AddField(
                    model_name="heldlock",
                    name="slots",
                    field=models.SmallIntegerField(blank=True, null=True),
                ),
            ],
        )
    ]
