# The feeds app of examples/djangofeeds, unchanged.

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Feed",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("url", models.URLField(unique=True)),
                ("import_count", models.PositiveIntegerField(default=0)),
                ("entries", models.PositiveIntegerField(default=0)),
                ("last_token", models.BigIntegerField(null=True)),
                ("imported_at", models.DateTimeField(null=True)),
            ],
        ),
        migrations.CreateModel(
            name="ImportRun",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("batch", models.CharField(db_index=True, max_length=32)),
                ("feed_url", models.URLField()),
                ("pid", models.IntegerField()),
                ("started_at", models.DateTimeField()),
                ("ended_at", models.DateTimeField(null=True)),
            ],
        ),
    ]
