"""Settings of the djangotasksfeeds example.

The project's database (which also holds the task queue of django-tasks-db and
taskguard's locks) is a SQLite file in DJANGOTASKSFEEDS_DIR (default ./var) unless
DJANGOTASKSFEEDS_DATABASE names a server:

DJANGOTASKSFEEDS_DATABASE   postgresql://user:password@host:5432/dbname, or
                            mysql://user:password@host:3306/dbname (MariaDB)
"""

import importlib.util
import os
from pathlib import Path

from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DJANGOTASKSFEEDS_DIR", BASE_DIR / "var")).resolve()
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGOTASKSFEEDS_SECRET_KEY", "djangotasksfeeds-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "taskguard.contrib.django",  # locks in DATABASES["default"], admin, manage.py taskguard
    "django_tasks_db",  # the queue and its db_worker command
    "feeds",
]
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.insert(-2, "django_tasks")  # Django < 6: the backport
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "feedsite.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

_ENGINES = {
    "postgresql": "django.db.backends.postgresql",
    "postgres": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",  # MariaDB (mysqlclient)
    "mariadb": "django.db.backends.mysql",
}
_database = os.environ.get("DJANGOTASKSFEEDS_DATABASE")
if _database:
    _url = make_url(_database)
    DATABASES = {
        "default": {
            "ENGINE": _ENGINES[_url.get_backend_name()],
            "NAME": _url.database,
            "USER": _url.username or "",
            "PASSWORD": _url.password or "",
            "HOST": _url.host or "",
            "PORT": _url.port or "",
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "djangotasksfeeds.sqlite3",
            # Two workers and the enqueuer write at once: wait for the write lock.
            "OPTIONS": {"timeout": 30},
            "TEST": {"NAME": VAR_DIR / "djangotasksfeeds-test.sqlite3"},
        }
    }

# django-tasks-db's queue, with taskguard's enqueue-time deduplication in front.
TASKS = {
    "default": {
        "BACKEND": "taskguard.contrib.django_tasks.GuardedBackend",
        "OPTIONS": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    }
}

# taskguard: the locks live in DATABASES["default"] (TASKGUARD_DATABASE_ALIAS).
TASKGUARD_HISTORY = True

#: Seconds a feed's lock lasts without renewal (renewed every third of it while an
#: import runs; after a worker is killed the next import waits at most this long).
FEEDS_LOCK_TTL = float(os.environ.get("DJANGOTASKSFEEDS_LOCK_TTL", "60"))
#: How long the (simulated) download of a feed takes.
FEEDS_FETCH_SECONDS = float(os.environ.get("DJANGOTASKSFEEDS_FETCH_SECONDS", "0.2"))
