"""Integrations with frameworks taskguard does not depend on (each imported only when used)."""
