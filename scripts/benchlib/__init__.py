"""Helpers for scripts/bench.py: one module per section of the benchmark (issue #6).

Every section builds its own scratch PostgreSQL database and Redis key prefix,
bounds its loops by count and time, and cleans up what it created.
"""
