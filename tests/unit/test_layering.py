"""The package's import graph has no circles, counting imports inside functions and
under ``TYPE_CHECKING`` (a helper that needs a caller's type is a layer upside
down); ``exceptions`` imports nothing from the package; only the API imports the
storage layer; nothing below the integrations imports one; inside the Celery
integration each module imports only its own layer and the ones below.
docs/architecture.md draws the layers this keeps true."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "taskguard"
#: The integrations: layers over the TaskGuard API, imported by nothing below them.
INTEGRATIONS = (
    "taskguard.celery",
    "taskguard.compat",
    "taskguard.cli",
    "taskguard.demo",
    "taskguard.contrib",
    "taskguard.dramatiq",
    "taskguard.web",
    "taskguard.taskiq",
)
#: Known exceptions (importer, integration): config reads the database URL a compat
#: backend's own setting names (taskguard.compat.backend_url), one reading of the URL.
BELOW_INTEGRATIONS_ALLOWED = {("taskguard.config", "taskguard.compat")}
#: The modules that may import the storage layer (taskguard.store): the API.
STORE_USERS = {
    "taskguard.guard",
    "taskguard.waiting",
    "taskguard.startup_check",
    "taskguard.schema",
}
#: The Celery integration's layers, bottom first (docs/architecture.md): a module
#: imports modules of its own layer or below, never above.
CELERY_LAYERS = (
    # the message: the header, task ids as stored, the markers, a submission
    ("message",),
    # a task's leases: taken and given back, handed over in a message
    ("lease_calls",),
    # deferred runs: countdowns, re-published copies, outages
    ("deferral",),
    # behaviours: conflict strategies, the queue phase (and leases handed over in a
    # message), rates, pending runs (coalesce, debounce)
    ("conflicts", "handover", "rate", "pending"),
    # the options, declared once (they name the behaviours)
    ("options",),
    # the run
    ("running",),
    # the task surface (apply_async: the enqueue side), the worker's hooks, the reaper
    ("task", "worker", "reaper", ""),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` refers to (``a.b.c`` may be a name inside ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule, `from pkg import name` pkg.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_inside_the_package() -> None:
    assert _cycles(_graph()) == []


def test_exceptions_import_nothing_from_the_package() -> None:
    assert _graph()["taskguard.exceptions"] == set()


def test_only_the_storage_layer_and_dialects_touch_drivers() -> None:
    drivers = {"psycopg", "sqlite3", "pymysql", "MySQLdb"}
    offenders = []
    for module, path in _modules().items():
        if module.startswith(("taskguard.store", "taskguard.dialects", "taskguard.contrib")):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            if roots & drivers:
                offenders.append(module)
    assert offenders == []


def test_only_the_api_imports_the_storage_layer() -> None:
    offenders = {
        m: sorted(t for t in targets if t.startswith("taskguard.store"))
        for m, targets in _graph().items()
        if not m.startswith("taskguard.store") and m not in STORE_USERS
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_nothing_below_the_integrations_imports_one() -> None:
    # taskguard/__init__.py names the integration's public API (loaded on first use).
    offenders = {
        m: sorted(
            t
            for t in targets
            if t.startswith(INTEGRATIONS) and (m, t) not in BELOW_INTEGRATIONS_ALLOWED
        )
        for m, targets in _graph().items()
        if not m.startswith(INTEGRATIONS) and m != "taskguard"
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_celery_modules_import_only_their_layer_and_below() -> None:
    layer_of = {
        f"taskguard.celery.{name}".rstrip("."): n
        for n, names in enumerate(CELERY_LAYERS)
        for name in names
    }
    graph = _graph()
    unplaced = sorted(m for m in graph if m.startswith("taskguard.celery") and m not in layer_of)
    assert unplaced == [], "add each module of taskguard/celery/ to CELERY_LAYERS"
    upward = {m: sorted(t for t in graph[m] if layer_of.get(t, -1) > layer_of[m]) for m in layer_of}
    assert {m: t for m, t in upward.items() if t} == {}
