"""The real filters of issue 34 (rspamd, OpenDKIM; mtaq.testing.filters) answer as their documentation says,
checked over their milter sockets with an independent milter client (tests/milterkit.py, PyPI miltertest):
what mtaq's own milter client will be tested against is proven here without it.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket

import dkim
import pytest
from milterkit import converse
from test_dkim import dnsfunc_for

from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.filters import GTUBE, GTUBE_ADD_HEADER, GTUBE_REWRITE_SUBJECT, milter_optneg
from mtaq.testing.procs import children, wait_for

HEADERS = [
    ("From", "Alice <alice@example.test>"),
    ("To", "bob@example.net"),
    ("Subject", "quarterly figures"),
    ("Date", "Fri, 27 Nov 2026 07:00:00 +0000"),
    ("Message-ID", "<figures.1@example.test>"),
]
BODY = b"Hello Bob,\r\n\r\nthe figures are attached.\r\n\r\nAlice\r\n"


def message(headers: list[tuple[str, str]], body: bytes) -> bytes:
    """The message as a recipient stores it: header fields (values as the milter wire carries them: folded
    with LF, leading space or not), a blank line, the body; CRLF line ends."""
    head = b"".join(f"{n}:{v if v.startswith(' ') else ' ' + v}".replace("\r\n", "\n").replace("\n", "\r\n").encode() + b"\r\n"
                    for n, v in headers)
    return head + b"\r\n" + body


def test_rspamd_rejects_gtube_with_its_reply(rspamd_milter):
    """GTUBE in the body: rspamd answers the end of message with the reply code 554 5.7.1 and its text (the
    reply an MTA gives its client), and logs the GTUBE reject."""
    out = converse(rspamd_milter.address, headers=HEADERS, body=b"Hello\r\n" + GTUBE.encode() + b"\r\n")
    assert ("eom", "y") == (out.stage, out.verdict[0])
    assert ("554", "5.7.1 Gtube pattern") == (out.verdict[1]["smtpcode"], out.verdict[1]["text"])
    assert "gtube reject pattern has been found" in rspamd_milter.log_text()


def test_rspamd_tags_a_clean_message(rspamd_milter):
    """A clean message is accepted with rspamd's headers added (milter_headers: X-Spamd-Result,
    X-Spam-Status), as add-header modifications before the accept; no X-Spam flag."""
    out = converse(rspamd_milter.address, headers=HEADERS, body=BODY)
    assert ("eom", ("a", {})) == (out.stage, out.verdict)
    added = out.added_headers()
    assert {"X-Spamd-Result", "X-Spam-Status"} == set(added)
    assert added["X-Spamd-Result"].startswith("default: False [")
    assert added["X-Spam-Status"].startswith("No, score=")
    assert {"h"} == {m[0] for m in out.modifications}


def test_rspamd_add_header_action_sets_the_spam_flag(rspamd_milter):
    """rspamd's add-header test pattern (GTUBE with Y): accepted, with ``X-Spam: Yes`` set by a change-header
    modification (index 1 of a field the message lacks: the MTA adds it)."""
    out = converse(rspamd_milter.address, headers=HEADERS, body=GTUBE_ADD_HEADER.encode() + b"\r\n")
    assert ("eom", ("a", {})) == (out.stage, out.verdict)
    assert [("m", {"index": 1, "name": "X-Spam", "value": "Yes"})] == out.modifications


def test_rspamd_rewrite_subject_action_changes_the_subject(rspamd_milter):
    """rspamd's rewrite-subject test pattern (GTUBE with Z): the Subject: field is changed (index 1) to
    rspamd's ``*** SPAM *** %s``, and the message accepted."""
    out = converse(rspamd_milter.address, headers=HEADERS, body=GTUBE_REWRITE_SUBJECT.encode() + b"\r\n")
    assert ("eom", ("a", {})) == (out.stage, out.verdict)
    assert [("m", {"index": 1, "name": "Subject", "value": "*** SPAM *** quarterly figures"})] == out.modifications


def test_rspamd_deletes_a_clients_spam_headers_before_adding_its_own(rspamd_milter):
    """A message that arrives with X-Spam and X-Spam-Status fields (a sender faking a verdict): rspamd's
    milter_headers deletes them (change header with an empty value: Sendmail's smfi_chgheader deletion),
    then adds its own X-Spamd-Result and X-Spam-Status."""
    out = converse(rspamd_milter.address, headers=[*HEADERS, ("X-Spam", "Yes"), ("X-Spam-Status", "Yes, score=99")],
                   body=BODY)
    assert ("eom", ("a", {})) == (out.stage, out.verdict)
    kinds = [c for c, _ in out.modifications]
    assert ["m", "m", "h", "h"] == kinds  # the deletions first (in either order)
    assert {("X-Spam", 1, ""), ("X-Spam-Status", 1, "")} == {(m["name"], m["index"], m["value"])
                                                               for c, m in out.modifications if c == "m"}
    added = {m["name"]: m["value"] for c, m in out.modifications if c == "h"}
    assert {"X-Spamd-Result", "X-Spam-Status"} == set(added)
    assert "No, score=0.00" == added["X-Spam-Status"]


def test_rspamd_asks_for_no_reply_steps_even_when_not_offered(rspamd_milter):
    """rspamd 3.4 answers the option negotiation with the no-reply bits (SMFIP_NR_HDR, NR_CONN, NR_HELO,
    NR_MAIL, NR_RCPT, NR_DATA, NR_UNKN, NR_EOH, NR_BODY: 0xff080) whether or not the MTA offered them, and
    then sends no reply to those steps: an MTA must offer and honour them (as Postfix does), or wait in vain."""
    nr_bits = 0xFF080
    assert (6, 0x1FF, nr_bits) == milter_optneg(rspamd_milter.host, rspamd_milter.port)
    assert (6, 0x1FF, nr_bits) == milter_optneg(rspamd_milter.host, rspamd_milter.port, protocol=0x1FFFFF & ~nr_bits)


def test_rspamd_starts_fast_and_stops_with_its_workers(filters):
    """The fixture's rspamd (no Lua rules, a 5-suffix TLD list, no network) answers a milter negotiation in
    a few seconds, not the ~20 s of the distribution's configuration; stop() ends the main process and its
    workers, and the port then refuses."""
    f = filters.rspamd()
    print(f"rspamd start {f.start_s:.2f} s")
    assert f.start_s < 10
    assert 6 == milter_optneg(f.host, f.port)[0]
    pids = [f.popen.pid, *children(f.popen.pid)]
    assert len(pids) >= 2  # main, rspamd_proxy (and hs_helper)
    f.stop()
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids), 10, "rspamd gone")
    with pytest.raises(OSError), socket.create_connection((f.host, f.port), timeout=2):
        pass


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as st:
            return st.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def signed(out) -> bytes:
    """The message as OpenDKIM's insert-header modifications leave it (inserted at their index, 0 = top)."""
    fields = list(HEADERS)
    for cmd, m in out.modifications:
        assert "i" == cmd, (cmd, m)
        fields.insert(m["index"], (m["name"], m["value"]))
    return message(fields, BODY)


def test_opendkim_signs_and_dkimpy_verifies(opendkim_milter):
    """A client in OpenDKIM's InternalHosts (127.0.0.1): the end of message inserts one DKIM-Signature at the
    top (d=example.test, s=mtaq), which dkimpy verifies against the fixture's public key, fetched by a real DNS
    query; a changed body does not verify."""
    f = opendkim_milter
    out = converse(f.address, headers=HEADERS, body=BODY, client_addr="127.0.0.1")
    assert ("eom", ("a", {})) == (out.stage, out.verdict)
    assert [("i", 0, "DKIM-Signature")] == [(c, m["index"], m["name"]) for c, m in out.modifications]
    sig = out.modifications[0][1]["value"]
    assert " d=example.test;" in sig and " s=mtaq;" in sig
    msg = signed(out)
    with ZoneServer(f.zone_line + "\n") as zone:
        check = dnsfunc_for(zone)
        assert dkim.verify(msg, dnsfunc=check)
        assert not dkim.verify(msg.replace(b"figures are", b"figures were"), dnsfunc=check)
        assert [("mtaq._domainkey.example.test.", "TXT")] == zone.queries[:1]


def test_opendkim_signs_authenticated_mail_not_outside_mail(filters):
    """With no InternalHosts, OpenDKIM signs for a client that authenticated ({auth_type}/{auth_authen} in the
    MAIL step's macros) and accepts an anonymous one's message unsigned, at the end of headers."""
    f = filters.opendkim(internal_hosts=())
    anonymous = converse(f.address, headers=HEADERS, body=BODY, client_addr="192.0.2.10")
    assert ("eoh", ("a", {}), []) == (anonymous.stage, anonymous.verdict, anonymous.modifications)
    # OpenDKIM goes by {auth_type} (Postfix sends it with the MAIL step: milter_mail_macros), not {auth_authen}
    no_type = converse(f.address, headers=HEADERS, body=BODY, client_addr="192.0.2.10", auth_authen="alice", auth_type="")
    assert ("eoh", ("a", {}), []) == (no_type.stage, no_type.verdict, no_type.modifications)
    authenticated = converse(f.address, headers=HEADERS, body=BODY, client_addr="192.0.2.10", auth_authen="alice")
    assert ("eom", ["DKIM-Signature"]) == (authenticated.stage, [m["name"] for _, m in authenticated.modifications])
    with ZoneServer(f.zone_line + "\n") as zone:
        assert dkim.verify(signed(authenticated), dnsfunc=dnsfunc_for(zone))


def readme_rspamd_files() -> dict[str, str]:
    """The files of README "Filtering with rspamd": each code block whose first line is a comment naming
    ``/etc/rspamd/local.d/NAME``, as NAME -> its text (the indentation of the list item removed)."""
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = text.split("## Filtering with rspamd\n", 1)[1].split("\n## ", 1)[0]
    files = {}
    for indent, name, body in re.findall(r"\n( *)```\n *# /etc/rspamd/local\.d/(\S+)\n(.*?)\n *```", section, re.S):
        files[name] = "\n".join(line.removeprefix(indent) for line in body.splitlines()) + "\n"
    return files


def test_readme_rspamd_files_on_the_distribution_config(filters):
    """A newcomer's rspamd: Debian's /etc/rspamd configuration with the README's local.d files (the fixture
    only moves the port and cuts the network). GTUBE is refused with 554 5.7.1, a clean message from an
    authenticated client on loopback is tagged (milter_headers would skip it by default)."""
    files = readme_rspamd_files()
    assert ["milter_headers.conf", "worker-proxy.inc"] == sorted(files)
    assert "self_scan = yes;" in files["worker-proxy.inc"] and "milter = yes;" in files["worker-proxy.inc"]
    f = filters.rspamd_distribution(files)
    print(f"rspamd (distribution config) start {f.start_s:.2f} s")
    spam = converse(f.address, headers=HEADERS, body=GTUBE.encode() + b"\r\n")
    assert ("eom", "554", "5.7.1 Gtube pattern") == (spam.stage, spam.verdict[1].get("smtpcode"), spam.verdict[1].get("text"))
    clean = converse(f.address, headers=HEADERS, body=BODY, client_addr="127.0.0.1", auth_authen="alice")
    assert ("eom", ("a", {})) == (clean.stage, clean.verdict)
    added = clean.added_headers()
    assert {"X-Spamd-Result", "X-Spam-Status"} <= set(added)
    assert added["X-Spamd-Result"].startswith("default: False [")
