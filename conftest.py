"""The docs' code blocks as tests: see tests/docs/plugin.py."""

pytest_plugins = ["tests.docs.plugin"]
