"""Which database an app's taskguard uses (issue 33): one reading for the start-up
check, the reaper, the CLI wrappers, the compat backends and Django. An explicit URL
beats the app's configuration (``taskguard_database_url``, else the compat backend's
URL setting as the migration guides give it), which beats the environment."""

from __future__ import annotations

import pytest
from celery import Celery

from taskguard import ConfigurationError
from taskguard.config import ENV_DATABASE_URL, database_url

ONCE = "taskguard.compat.celery_once.Backend"
SINGLETON = "taskguard.compat.celery_singleton.Backend"
A = "postgresql+psycopg://127.0.0.1/a"
B = "mysql+mysqldb://root@127.0.0.1/b"


def _app(**conf: object) -> Celery:
    app = Celery("url-app", set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DATABASE_URL, raising=False)


def test_the_celery_once_guide_alone_names_the_database() -> None:
    once = {"backend": ONCE, "settings": {"url": "sqlite:///x.db", "default_timeout": 3600}}
    assert database_url(_app(ONCE=once)) == "sqlite:///x.db"
    # another library's backend's URL is not taskguard's
    redis = {"backend": "celery_once.backends.Redis", "settings": {"url": A}}
    with pytest.raises(ConfigurationError, match="no database URL"):
        database_url(_app(ONCE=redis))


def test_the_celery_singleton_guide_alone_names_the_database() -> None:
    app = _app(singleton_backend_class=SINGLETON, singleton_backend_url=B)
    assert database_url(app) == B
    # the Redis URL celery-singleton falls back to is never a lock database
    app = _app(singleton_backend_class=SINGLETON, broker_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigurationError, match="no database URL"):
        database_url(app)


def test_explicit_beats_the_app_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DATABASE_URL, "sqlite:///env.db")
    once = {"backend": ONCE, "settings": {"url": B}}
    assert database_url(_app(taskguard_database_url=A, ONCE=once)) == A
    assert database_url(_app(ONCE=once)) == B
    assert database_url(_app(ONCE=once), explicit="sqlite:///cli.db") == "sqlite:///cli.db"
    assert database_url(_app()) == "sqlite:///env.db"
    assert database_url() == "sqlite:///env.db"


def test_a_misspelled_setting_is_named_with_the_right_one() -> None:
    with pytest.raises(ConfigurationError) as exc:
        database_url(_app(taskguard_databse_url=A))
    assert "unknown setting taskguard_databse_url: did you mean taskguard_database_url?" in str(
        exc.value
    )


def test_djangos_own_settings_in_a_celery_conf_are_not_misspellings() -> None:
    """A Celery app configured from Django's settings (``namespace="CELERY"``) also sees
    Django's ``TASKGUARD_*`` settings, which Django's checks validate: the start-up check
    warned ``unknown setting TASKGUARD_HISTORY`` on every such worker."""
    from taskguard.config import unknown_settings

    app = _app(TASKGUARD_HISTORY=True, TASKGUARD_DATABASE_ALIAS="locks", taskguard_histroy=True)
    assert unknown_settings(app) == [
        "unknown setting taskguard_histroy: did you mean taskguard_history?"
    ]
