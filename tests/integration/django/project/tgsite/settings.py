"""Settings of the test project, chosen by the environment the tests set:

TG_DJANGO_DB      "postgresql", "mariadb" (Django's mysql ENGINE) or "sqlite"
TG_DJANGO_NAME    the PostgreSQL or MariaDB database name, or the SQLite file
TG_DJANGO_PG_URL  server, user and password for PostgreSQL or MariaDB (a SQLAlchemy URL)
TG_DJANGO_EXTRA   JSON object of extra settings (e.g. a bad TASKGUARD_DATABASE_ALIAS)
"""

import json
import os
from pathlib import Path

from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "taskguard-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "taskguard.contrib.django",
    "shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tgsite.urls"
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
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_name = os.environ["TG_DJANGO_NAME"]
if os.environ.get("TG_DJANGO_DB", "sqlite") == "postgresql":
    _pg = make_url(os.environ["TG_DJANGO_PG_URL"])
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _name,
            "USER": _pg.username or "",
            "PASSWORD": _pg.password or "",
            "HOST": _pg.host or "",
            "PORT": _pg.port or "",
            "OPTIONS": {"sslmode": "disable", "application_name": "tg-django-tests"},
        }
    }
elif os.environ.get("TG_DJANGO_DB") == "mariadb":
    _server = make_url(os.environ["TG_DJANGO_PG_URL"])
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": _name,
            "USER": _server.username or "",
            "PASSWORD": _server.password or "",
            "HOST": _server.host or "",
            "PORT": _server.port or "",
            "OPTIONS": {"charset": "utf8mb4"},
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _name,
            "TEST": {"NAME": _name + "-test"},
        }
    }

# Django-style taskguard settings; shop/scenarios.py checks they reach the Celery app.
TASKGUARD_HISTORY = True
TASKGUARD_DEFAULT_TTL = 42.0
TASKGUARD_REAPER_INTERVAL = 30.0

CELERY_BROKER_URL = "memory://"
CELERY_TASK_ALWAYS_EAGER = False

globals().update(json.loads(os.environ.get("TG_DJANGO_EXTRA", "{}")))
