"""Settings of the djangofeeds example.

By default everything is SQLite files in DJANGOFEEDS_DIR (default ./var): the
project's database (which also holds taskguard's locks), and the embedded broker
and result backend that ``taskguard demo`` uses. Environment variables move it:

DJANGOFEEDS_DATABASE        postgresql://user:password@host:5432/dbname, or
                            mysql://user:password@host:3306/dbname (MariaDB)
DJANGOFEEDS_BROKER          e.g. redis://127.0.0.1:6379/0 or amqp://guest:guest@127.0.0.1//
DJANGOFEEDS_RESULT_BACKEND  e.g. redis://127.0.0.1:6379/1
"""

import os
from pathlib import Path

from sqlalchemy.engine import make_url

from taskguard.demo.embedded import embedded_urls

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DJANGOFEEDS_DIR", BASE_DIR / "var")).resolve()
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGOFEEDS_SECRET_KEY", "djangofeeds-example-not-secret")
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
    "djangofeeds",
]
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

#: Django's engine for each URL scheme DJANGOFEEDS_DATABASE may use.
_ENGINES = {
    "postgresql": "django.db.backends.postgresql",
    "postgres": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",  # MariaDB (mysqlclient)
    "mariadb": "django.db.backends.mysql",
}
_database = os.environ.get("DJANGOFEEDS_DATABASE")
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
            "NAME": VAR_DIR / "djangofeeds.sqlite3",
            # Worker threads write at once: wait for SQLite's write lock, not fail.
            "OPTIONS": {"timeout": 30},
            "TEST": {"NAME": VAR_DIR / "djangofeeds-test.sqlite3"},
        }
    }

_embedded = embedded_urls(VAR_DIR)
CELERY_BROKER_URL = os.environ.get("DJANGOFEEDS_BROKER", _embedded["broker"])
CELERY_RESULT_BACKEND = os.environ.get("DJANGOFEEDS_RESULT_BACKEND", _embedded["result_backend"])
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# taskguard: the locks live in DATABASES["default"] (TASKGUARD_DATABASE_ALIAS).
TASKGUARD_HISTORY = True
TASKGUARD_DEFAULT_TTL = 60.0
