"""mtaq's milter client (mtaq.edge.milter) in front of the real filters of issue 34 (mtaq.testing.filters):
rspamd's proxy worker in milter mode and OpenDKIM in sign mode, over real SMTP and real milter sockets;
what the log holds is checked (the 250 means the filtered message is on disk)."""

from __future__ import annotations

import dkim
from edgekit import run_edge
from test_dkim import dnsfunc_for
from test_edge_tls_auth import PASSWORD, USER, cert, client_context, passwd_file, plain  # noqa: F401  (fixtures)

from mtaq.edge.auth import PasswordFile
from mtaq.edge.milter import MilterSettings
from mtaq.edge.policy import EdgePolicy, server_tls_context
from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.filters import GTUBE

CLEAN = (b"From: Alice <alice@example.test>\r\nTo: bob@example.net\r\nSubject: quarterly figures\r\n"
         b"Date: Fri, 27 Nov 2026 07:00:00 +0000\r\nMessage-ID: <figures.1@example.test>\r\n\r\n"
         b"Hello Bob,\r\n\r\nthe figures are attached.\r\n\r\nAlice\r\n")


def test_rspamd_refuses_gtube_and_tags_a_clean_message(tmp_path, rspamd_milter):
    """smtpd_milters = [rspamd]: GTUBE in the body gets rspamd's ``554 5.7.1 Gtube pattern`` at the end of
    data and nothing is queued; a clean message is queued with rspamd's X-Spamd-Result and X-Spam-Status."""
    pol = EdgePolicy(milter=MilterSettings(smtpd_milters=(rspamd_milter.address,)))
    with run_edge(tmp_path, pol) as edge, edge.client(timeout_s=60) as s:
        s.ehlo("client.test")
        s.mail("alice@example.test")
        s.rcpt("bob@example.net")
        assert (554, b"5.7.1 Gtube pattern") == s.data(CLEAN.replace(b"Alice\r\n", GTUBE.encode() + b"\r\n"))
        assert {} == s.sendmail("alice@example.test", ["bob@example.net"], CLEAN)
        [(_, body)] = edge.messages()
    head = body.partition(b"\r\n\r\n")[0].decode()
    assert "\r\nX-Spamd-Result: default: False [" in head
    assert "\r\nX-Spam-Status: No, score=" in head
    assert body.endswith(b"the figures are attached.\r\n\r\nAlice\r\n")


def test_opendkim_signs_authenticated_mail_and_the_queued_copy_verifies(tmp_path, filters, cert, passwd_file):  # noqa: F811
    """OpenDKIM (no InternalHosts) behind a listener with STARTTLS and AUTH: a client that authenticated
    (mtaq sends {auth_type} and {auth_authen} with MAIL) gets its message signed, and the copy in the log,
    with mtaq's Received: on top, verifies with dkimpy against the key in DNS; a client that did not
    authenticate gets no signature."""
    f = filters.opendkim(internal_hosts=())
    pol = EdgePolicy(tls_context=server_tls_context(*cert), passwords=PasswordFile.load(passwd_file),
                     milter=MilterSettings(smtpd_milters=(f.address,)))
    with run_edge(tmp_path, pol) as edge:
        with edge.client(timeout_s=60) as s:
            assert {} == s.sendmail("alice@example.test", ["bob@example.net"], CLEAN)
        with edge.client(timeout_s=60) as s:
            s.ehlo("client.test")
            s.starttls(context=client_context(cert[0]))
            s.ehlo("client.test")
            assert 235 == s.docmd("AUTH", "PLAIN " + plain(USER, PASSWORD))[0]
            assert {} == s.sendmail("alice@example.test", ["bob@example.net"], CLEAN)
        [(_, anonymous), (_, signed)] = edge.messages()
    assert b"DKIM-Signature:" not in anonymous
    assert signed.startswith(b"Received: ") and b"\r\nDKIM-Signature: " in signed
    with ZoneServer(f.zone_line + "\n") as zone:
        assert dkim.verify(signed, dnsfunc=dnsfunc_for(zone))
