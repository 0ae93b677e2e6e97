"""taskguard's Alembic migrations (installed as ``taskguard.migrations``)."""
