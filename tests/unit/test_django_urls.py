"""The lock database URL taskguard.contrib.django builds from a DATABASES entry
(no Django settings needed: url_from_settings_dict is pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from taskguard.contrib.django.conf import url_from_settings_dict
from taskguard.exceptions import ConfigurationError


def test_postgresql_carries_credentials_host_port_and_libpq_options() -> None:
    url = url_from_settings_dict(
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "shop",
            "USER": "app",
            "PASSWORD": "p@ss:w/rd%",
            "HOST": "db.internal",
            "PORT": "6432",
            "OPTIONS": {
                "sslmode": "verify-full",
                "sslrootcert": "/etc/ca.pem",
                "connect_timeout": 5,
                "isolation_level": 3,  # Django's, not libpq's
                "pool": {"min_size": 2},
                "server_side_binding": True,
            },
        }
    )
    assert url.drivername == "postgresql+psycopg"
    assert (url.username, url.password, url.host, url.port, url.database) == (
        "app",
        "p@ss:w/rd%",
        "db.internal",
        6432,
        "shop",
    )
    assert dict(url.query) == {
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ca.pem",
        "connect_timeout": "5",
    }
    # The password survives a round trip through the rendered string.
    from sqlalchemy.engine import make_url

    assert make_url(url.render_as_string(hide_password=False)).password == "p@ss:w/rd%"


def test_postgresql_unix_socket_directory_goes_to_the_host_parameter() -> None:
    url = url_from_settings_dict(
        {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "HOST": "/var/run/postgresql"}
    )
    assert url.host is None and url.query["host"] == "/var/run/postgresql"
    assert url.port is None and url.username is None and url.password is None


def test_sqlite_is_an_absolute_file_path(tmp_path: Path) -> None:
    url = url_from_settings_dict(
        {"ENGINE": "django.db.backends.sqlite3", "NAME": tmp_path / "db.sqlite3"}
    )
    assert url.render_as_string() == f"sqlite:///{tmp_path / 'db.sqlite3'}"


@pytest.mark.parametrize("name", [":memory:", "file:memorydb_default?mode=memory&cache=shared", ""])
def test_in_memory_sqlite_is_refused_with_the_fix(name: str) -> None:
    with pytest.raises(ConfigurationError, match=r"in-memory SQLite.*\['TEST'\]\['NAME'\]"):
        url_from_settings_dict({"ENGINE": "django.db.backends.sqlite3", "NAME": name}, "default")


def test_mysql_maps_to_mysqlclient_as_django_uses() -> None:
    url = url_from_settings_dict(
        {
            "ENGINE": "django.db.backends.mysql",
            "NAME": "shop",
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": 3306,
            "OPTIONS": {"charset": "utf8mb4", "ssl": {"ca": "/etc/ca.pem"}, "autocommit": True},
        }
    )
    # mysqlclient: what Django's own mysql backend uses, and the `mysql` extra installs.
    assert url.drivername == "mysql+mysqldb"
    assert dict(url.query) == {"charset": "utf8mb4", "ssl_ca": "/etc/ca.pem"}
    socket = url_from_settings_dict(
        {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "HOST": "/run/mysqld/mysqld.sock"}
    )
    assert socket.host is None and socket.query["unix_socket"] == "/run/mysqld/mysqld.sock"


def test_an_unknown_engine_names_the_fix() -> None:
    with pytest.raises(
        ConfigurationError, match=r"django\.db\.backends\.oracle.*TASKGUARD_DATABASE_URL"
    ):
        url_from_settings_dict({"ENGINE": "django.db.backends.oracle", "NAME": "x"}, "other")
