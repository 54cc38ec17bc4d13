"""The analytics extra stays optional: the daemon never imports it, and it never imports the daemon's I/O."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parent.parent / "mtaq"


def test_the_daemon_and_the_cli_never_import_pyspark():
    """Importing the daemon, the CLI and the archive loads neither pyspark nor pyarrow nor matplotlib."""
    code = ("import sys, mtaq.daemon.process, mtaq.cli, mtaq.storage.archive; mtaq.cli.build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'pyarrow', 'matplotlib', 'py4j'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "[]" == out.stdout.strip()


def test_analytics_never_imports_asyncio_or_the_smtp_libraries():
    """mtaq/analytics reads segments with the core codec only: no asyncio, aiosmtpd, aiosmtplib, storage.log."""
    bad = {}
    for p in (PKG / "analytics").glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        hits = {n for n in names if n.split(".")[0] in ("asyncio", "aiosmtpd", "aiosmtplib") or n == "mtaq.storage.log"}
        if hits:
            bad[p.name] = hits
    assert {} == bad
