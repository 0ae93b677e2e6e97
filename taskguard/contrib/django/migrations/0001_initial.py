"""taskguard's tables, created by taskguard's own Alembic migrations.

The database side runs exactly what ``taskguard db upgrade`` runs (same revisions,
same version table ``taskguard_alembic_version``), on the database being migrated
(the test database under Django's test runner), so the two ways cannot drift. A
database already upgraded by ``taskguard db upgrade`` is left as it is. The state
side only tells Django about the read-only models the admin uses.

Each later Alembic revision gets a Django migration here that upgrades to it.
"""

from django.db import migrations, models

from taskguard.contrib.django.schema_ops import AlembicUpgrade


class Migration(migrations.Migration):
    # Alembic opens its own connection and transaction; Django's must not hold one.
    atomic = False

    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[AlembicUpgrade("tg0002", previous="base")],
            state_operations=[
                migrations.CreateModel(
                    name="HeldLock",
                    fields=[
                        (
                            "key",
                            models.CharField(max_length=255, primary_key=True, serialize=False),
                        ),
                        ("slot", models.SmallIntegerField()),
                        ("owner", models.CharField(max_length=32)),
                        ("token", models.BigIntegerField()),
                        ("task_name", models.CharField(blank=True, max_length=255, null=True)),
                        ("task_id", models.CharField(blank=True, max_length=255, null=True)),
                        ("hostname", models.CharField(blank=True, max_length=255, null=True)),
                        ("pid", models.IntegerField(blank=True, null=True)),
                        ("acquired_at", models.DateTimeField()),
                        ("expires_at", models.DateTimeField()),
                    ],
                    options={
                        "verbose_name": "held lock",
                        "verbose_name_plural": "held locks",
                        "db_table": "task_locks_held",
                        "ordering": ("key", "slot"),
                        "permissions": (("force_release_lock", "Can force-release a held lock"),),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="LockEvent",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        ("at", models.DateTimeField()),
                        ("key", models.CharField(max_length=255)),
                        ("slot", models.SmallIntegerField()),
                        ("event", models.CharField(max_length=16)),
                        ("owner", models.CharField(blank=True, max_length=32, null=True)),
                        ("token", models.BigIntegerField(blank=True, null=True)),
                        ("duration", models.FloatField(blank=True, help_text="seconds", null=True)),
                        ("task_name", models.CharField(blank=True, max_length=255, null=True)),
                        ("task_id", models.CharField(blank=True, max_length=255, null=True)),
                        ("hostname", models.CharField(blank=True, max_length=255, null=True)),
                        ("pid", models.IntegerField(blank=True, null=True)),
                        ("detail", models.CharField(blank=True, max_length=500, null=True)),
                    ],
                    options={
                        "verbose_name": "lock event",
                        "verbose_name_plural": "lock history",
                        "db_table": "task_lock_events",
                        "ordering": ("-at", "-id"),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
            ],
        ),
    ]
