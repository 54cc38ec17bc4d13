"""The house rules of GUIDE §2: a pure core, and fsync in one place."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "mtaq"
IO_MODULES = {"os", "io", "asyncio", "socket", "time", "threading", "subprocess", "shutil", "pathlib", "tempfile",
              "aiosmtpd", "aiosmtplib", "mmap", "select", "signal", "datetime", "random", "secrets"}


def imported_roots(path: pathlib.Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_imports_no_io_module():
    """mtaq/core is sans-I/O: no clock, no os, no asyncio, no sockets."""
    offenders = {p.name: imported_roots(p) & IO_MODULES for p in (PKG / "core").glob("*.py")}
    assert {} == {k: v for k, v in offenders.items() if v}


def test_only_storage_fs_calls_fsync():
    """Every fsync of mtaq is in mtaq/storage/fs.py (one place to get durability right)."""
    callers = set()
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("fsync", "fdatasync") and isinstance(node.value, ast.Name) and node.value.id == "os":
                callers.add(str(p.relative_to(PKG)))
    assert {"storage/fs.py"} == callers


def test_spool_directories_are_made_by_the_storage_layer():
    """A directory of the spool is created only by mtaq/storage (make_durable_dirs, CacheDir, quarantine,
    the archive), which fsyncs its parent: an ``os.makedirs``/``os.mkdir`` elsewhere makes a directory whose
    entry a power cut can take away (issue 31.11: the first start's spool). mtaq/analytics writes reports,
    not the spool; mtaq/testing is the harness."""
    callers = set()
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG)
        if rel.parts[0] in ("storage", "testing", "analytics"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("makedirs", "mkdir") and isinstance(node.value, ast.Name) and node.value.id == "os":
                callers.add(str(rel))
    assert set() == callers


# The packages of mtaq and what each may import (README "Layout"; each package's __init__ says the same).
# A module is named by its package: mtaq/X/... is X, a module at the root (cli, config, logs) is itself.
ALLOWED: dict[str, set[str]] = {
    "core": set(),  # pure: imports nothing of mtaq
    "config": {"core"},
    "logs": {"core"},
    "storage": {"core"},  # the only file-system code
    "queue": {"core", "storage"},  # the queue over the log: store, runners, recovery
    "delivery": {"core", "config", "logs"},
    "edge": {"core", "storage", "queue", "config", "logs"},
    "admin": {"core", "storage", "queue", "config", "logs"},
    "analytics": {"core"},  # never imported by the daemon (tests/test_analytics_boundaries.py)
    "testing": {"core", "storage", "queue", "config", "logs"},
    "daemon": {"core", "storage", "queue", "config", "logs", "delivery", "edge", "admin", "testing"},
    "cli": {"core", "storage", "config", "logs", "edge", "admin", "analytics", "testing", "daemon"},
    "__init__": {"core"},
}
# Hooks that production code calls, off unless asked by the environment; they import nothing of mtaq.
HOOKS = {"mtaq.testing.killpoints"}


def package_of_path(path: pathlib.Path, pkg_root: pathlib.Path = PKG) -> str:
    rel = path.relative_to(pkg_root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def package_of_module(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def mtaq_imports(path: pathlib.Path, pkg_root: pathlib.Path = PKG) -> set[str]:
    """Every mtaq module ``path`` imports, at the top or inside a function (``from mtaq.p import m`` as
    ``mtaq.p.m`` when ``m`` is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mtaq"}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (use absolute mtaq.* imports)"
            if node.module and node.module.split(".")[0] == "mtaq":
                base = pkg_root.joinpath(*node.module.split(".")[1:])
                for a in node.names:
                    sub = base / a.name
                    found.add(f"{node.module}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").is_file() else node.module)
    return found


def layering_violations(pkg_root: pathlib.Path = PKG) -> list[str]:
    bad = []
    for path in sorted(pkg_root.rglob("*.py")):
        here = package_of_path(path, pkg_root)
        module = "mtaq." + ".".join(path.relative_to(pkg_root).with_suffix("").parts)
        for target in sorted(mtaq_imports(path, pkg_root)):
            there = package_of_module(target)
            if module in HOOKS:
                bad.append(f"{module} imports {target}: a hook imports nothing of mtaq")
            elif there == here or target in HOOKS:
                continue
            elif there not in ALLOWED[here]:
                bad.append(f"{module} ({here}) imports {target} ({there}); {here} may import {sorted(ALLOWED[here])}")
    return bad


def test_every_package_is_in_the_table():
    """A new package (or root module) must say what it may import."""
    names = {package_of_path(p) for p in PKG.rglob("*.py")}
    assert set() == names - set(ALLOWED)


def test_packages_import_only_what_the_layering_allows():
    """core imports nothing of mtaq; storage only core; nothing but the command line imports the daemon;
    nothing imports the command line (the table ALLOWED)."""
    assert [] == layering_violations()


def test_nothing_imports_cli_and_only_cli_imports_daemon():
    assert not any("cli" in deps for deps in ALLOWED.values())
    assert {k for k, deps in ALLOWED.items() if "daemon" in deps} == {"cli"}


def test_the_check_catches_a_core_module_importing_storage(tmp_path):
    """The layering check is not vacuous: a copy of the package whose core imports storage fails it."""
    import shutil

    copy = tmp_path / "mtaq"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    frame = copy / "core" / "frame.py"
    frame.write_text(frame.read_text() + "\nfrom mtaq.storage.log import Log  # noqa\n")
    assert any(v.startswith("mtaq.core.frame (core) imports mtaq.storage.log") for v in layering_violations(copy))


def test_no_import_cycles_between_modules():
    """No module imports, directly or through others, itself (lazy imports count too)."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        module = "mtaq." + ".".join(path.relative_to(PKG).with_suffix("").parts)
        graph[module.removesuffix(".__init__")] = {t for t in mtaq_imports(path)}
    cycles = []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t):], t]))
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert [] == cycles
