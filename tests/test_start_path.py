"""What a start of ``mtaq serve`` loads before the first 250 (issue 36.3): nothing the first 250 does not use.

Mail is accepted at once after a start (crash-only: every start is a recovery), so what the supervisor imports
and parses before it forks the workers is on the path of the first 250: the queue and analytics commands'
parsers, prometheus_client (read at the first scrape), the shipped bounce rules (read at the first
classification) are not.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtaq import cli


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def test_the_serve_path_imports_neither_the_other_commands_nor_prometheus():
    """The serve parser, the daemon module and the start checks import no other command's module, no
    prometheus_client, and parse no bounce rules."""
    code = (
        "import sys, mtaq.cli\n"
        "args = mtaq.cli.build_parser(mtaq.cli._command_word(['--log-format', 'json', 'serve']))"
        ".parse_args(['--log-format', 'json', 'serve', '--spool', '/nonexistent'])\n"
        "import mtaq.daemon.process, mtaq.daemon.check, mtaq.config, mtaq.core.bounce_class as b\n"
        "[c() for c in mtaq.daemon.check._other_loaders(mtaq.config.Config())]\n"
        "loaded = {m for m in sys.modules if m.split('.')[0] == 'prometheus_client'"
        " or m in ('mtaq.admin.cli', 'mtaq.analytics.command', 'mtaq.admin.http')}\n"
        "print(sorted(loaded), len(b._DEFAULT))"
    )
    assert "[] 0" == _run(code)


@pytest.mark.parametrize("words, command", [
    (["serve", "--spool", "x"], "serve"),
    (["--log-format", "json", "serve"], "serve"),
    (["--log-format=json", "queue", "list"], "queue"),
    (["--help"], None),
    ([], None),
])
def test_command_word(words, command):
    assert command == cli._command_word(words)


def test_serve_parses_as_with_every_command():
    """The serve-only parser gives the same namespace as the full one."""
    words = ["--log-format", "json", "serve", "--spool", "s", "--listen", "127.0.0.1:1", "--workers", "2",
             "--mynetworks", "10.0.0.0/8,127.0.0.0/8", "--admin-listen", ""]
    assert vars(cli.build_parser().parse_args(words)) == vars(cli.build_parser("serve").parse_args(words))


def test_metrics_content_type_is_prometheus_own():
    from prometheus_client import CONTENT_TYPE_LATEST

    from mtaq.admin import metrics

    assert CONTENT_TYPE_LATEST == metrics.CONTENT_TYPE
