"""Header privacy for authenticated submission (issue 35.3): ``smtpd_received_header_private``.

A real daemon with a submission listener (STARTTLS, AUTH; trustme certificates), the real sink.
"""

from __future__ import annotations

import email.parser
import smtplib

import pytest
import test_submission
from test_dkim import _stored
from test_submission import USERS, client_context

from mtaq.testing.procs import free_port

pki, passwd_file = test_submission.pki, test_submission.passwd_file


def _message(mid: str) -> bytes:
    return f"From: alice@example.org\r\nTo: x@example.net\r\nSubject: p\r\nMessage-ID: {mid}\r\n\r\nbody\r\n".encode()


@pytest.mark.parametrize("private", [True, False], ids=["private", "default"])
def test_authenticated_mail_can_leave_the_client_out_of_its_received_field(relay_factory, pki, passwd_file, private):
    """With smtpd_received_header_private, mail from an authenticated client (587) gets
    `Received: by HOST (mtaq) with ESMTPSA for <RCPT>; DATE`: no HELO name, no client address; unauthenticated mail
    (port 25 from mynetworks) keeps `from HELO ([IP])`. Without the key both keep it."""
    submission = free_port()
    r = relay_factory(config=(
        f'tls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\nauth_password_file = "{passwd_file}"\n'
        f"smtpd_received_header_private = {'true' if private else 'false'}\n"
        f'[listeners."127.0.0.1:{submission}"]\nmode = "submission"\n'))
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    with smtplib.SMTP("127.0.0.1", submission, timeout=30) as s:
        s.ehlo("laptop.home.test")
        s.starttls(context=client_context(pki))
        s.ehlo("laptop.home.test")
        s.login("alice", USERS["alice"])
        assert {} == s.sendmail("alice@example.org", ["x@example.net"], _message("<auth@p>"))
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        s.ehlo("app.local.test")
        assert {} == s.sendmail("app@example.org", ["x@example.net"], _message("<plain@p>"))
    stored = r.wait_for(lambda: (m := _stored(r.maildir)) and len(m) == 2 and m, what="2 messages")

    def received(mid: str) -> str:
        return " ".join(email.parser.BytesHeaderParser().parsebytes(stored[mid]).get_all("Received")[0].split())

    auth, plain = received("<auth@p>"), received("<plain@p>")
    assert plain.startswith("from app.local.test ([127.0.0.1]) by ")
    if private:
        assert auth.startswith("by ") and " with ESMTPSA for <x@example.net>; " in auth, auth
        assert "laptop" not in auth and "127.0.0.1" not in auth
    else:
        assert auth.startswith("from laptop.home.test ([127.0.0.1]) by "), auth
