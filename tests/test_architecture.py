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
