"""The core run's per-run settings (taskguard/runs.py, issue 43): the finished
records' retention read once per app, and its one check of a bad value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from taskguard.exceptions import InvalidTTL
from taskguard.options import Framework
from taskguard.runs import GuardSpec, finished_retention


def fetch(url: str) -> None:
    pass


def test_the_retention_is_read_once_per_app() -> None:
    spec = GuardSpec.of(fetch, Framework("test"), {"key": "feed:{url}"})
    app = SimpleNamespace(conf={"taskguard_finished_retention": 60})
    assert spec.retention(app) == 60.0
    app.conf["taskguard_finished_retention"] = 5  # settings are read once per app
    assert spec.retention(app) == 60.0
    assert spec.retention(SimpleNamespace(conf={"taskguard_finished_retention": 0})) == 0.0
    assert spec.retention(SimpleNamespace(conf={})) == 7200.0  # the default


def test_a_bad_retention_is_refused_naming_the_setting() -> None:
    with pytest.raises(InvalidTTL, match="taskguard_finished_retention"):
        finished_retention(SimpleNamespace(conf={"taskguard_finished_retention": -1}))
