"""Address rewriting (issue 35.3): canonical_maps at receipt, smtp_generic_maps for mail leaving (Postfix
canonical(5), generic(5)).

The tables alone (mtaq.edge.canonical), then real daemons with the real sink as next hop: the envelope and
header addresses rewritten before the message is queued and signed (what the sink stores is what was queued,
and its DKIM signature verifies with dkimpy against a real DNS server), a body spilled to its temporary file,
and generic maps that change only what leaves (`mtaq queue show` still shows the queued addresses).
"""

from __future__ import annotations

import json
import smtplib
import subprocess
import sys

import dkim
import pytest
from test_dkim import _stored, dnsfunc_for, keygen

from mtaq.core.errors import ConfigError
from mtaq.edge.canonical import CLASSES, AddressMap, Canonical, Generic, MapNesting
from mtaq.testing.dnsserver import ZoneServer

TABLE = """# canonical(5) source
alice@example.org      Alice.Smith@example.org
@old.example           @new.example
bob                    robert@example.org
carol@Example.ORG
    carol.c@example.org
dave@example.net       dave.d@example.net
"""


def canon(tmp_path, table: str = TABLE, **kw) -> Canonical:
    path = tmp_path / "canonical"
    path.write_text(table)
    c = Canonical.from_config(canonical_maps=str(path), sender_canonical_maps="", recipient_canonical_maps="",
                              canonical_classes=list(kw.get("classes", CLASSES)), myhostname="mx.test", myorigin="")
    assert c is not None
    return c


def test_lookups_follow_postfix_order_and_forms(tmp_path):
    """user@domain (any ASCII case), then user (only at myhostname/myorigin), then @domain; a value @domain
    keeps the local part; a continuation line continues its entry; an address no entry matches and the null
    sender stay as they are."""
    c = canon(tmp_path)
    assert "Alice.Smith@example.org" == c.sender("ALICE@Example.ORG")
    assert "zed@new.example" == c.recipient("zed@old.example")
    assert "robert@example.org" == c.sender("bob@mx.test")
    assert "bob@elsewhere.test" == c.sender("bob@elsewhere.test")
    assert "carol.c@example.org" == c.recipient("carol@example.org")
    assert "nobody@example.org" == c.recipient("nobody@example.org")
    assert "" == c.sender("")


def test_a_loop_in_the_table_is_refused_after_ten_lookups_and_chains_are_followed(tmp_path):
    c = canon(tmp_path, "a@x.test b@x.test\nb@x.test c@x.test\nl1@x.test l2@x.test\nl2@x.test l1@x.test\n")
    assert "c@x.test" == c.sender("a@x.test")  # applied again to its result (Postfix cleanup_map11)
    with pytest.raises(MapNesting):
        c.sender("l1@x.test")


@pytest.mark.parametrize(("line", "why"), [
    ("alice@example.org", "expected KEY VALUE"),
    ("alice@ not-an-address", "is not user@domain"),
    ("alice@example.org not an address", "is not an address"),
    ("@example.org @", "is not an address"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, line, why):
    path = tmp_path / "map"
    path.write_text(f"# ok\nok@example.org fine@example.org\n{line}\n")
    with pytest.raises(ConfigError, match=rf"canonical_maps: {path}: line 3: ") as e:
        AddressMap.load("canonical_maps", str(path))
    assert why in str(e.value)


def test_header_addresses_are_rewritten_and_every_other_octet_kept(tmp_path):
    """Sender fields with the sender maps, recipient fields with the recipient maps: display names (quoted,
    encoded words), comments, folding, groups and the other addresses of a list kept as they were; a
    Subject that holds an address is not an address field."""
    c = canon(tmp_path)
    head = (b'From: "Alice A." <alice@example.org>\r\n'
            b"To: zed@old.example,\r\n\t=?utf-8?q?J=C3=B6rg?= <bob@mx.test> (the boss), team: carol@example.org,"
            b" x@y.test;\r\n"
            b"Cc: Dave <dave@example.net>, \"Eve, E.\" <eve@example.net>\r\n"
            b"Subject: alice@example.org\r\nX-Other: alice@example.org\r\n")
    assert (b'From: "Alice A." <Alice.Smith@example.org>\r\n'
            b"To: zed@new.example,\r\n\t=?utf-8?q?J=C3=B6rg?= <robert@example.org> (the boss), team:"
            b" carol.c@example.org, x@y.test;\r\n"
            b"Cc: Dave <dave.d@example.net>, \"Eve, E.\" <eve@example.net>\r\n"
            b"Subject: alice@example.org\r\nX-Other: alice@example.org\r\n") == c.head(head)
    assert None is c.head(b"From: x@y.test\r\nTo: z@y.test\r\n")  # nothing changed
    envelope_only = canon(tmp_path, classes=["envelope_sender", "envelope_recipient"])
    assert None is envelope_only.head(head)  # canonical_classes without the header classes


def test_generic_maps_leave_fields_a_signature_covers(tmp_path):
    (tmp_path / "generic").write_text("alice@example.org alice@public.example\n@old.example @new.example\n")
    g = Generic.from_config(str(tmp_path / "generic"), myhostname="mx.test", myorigin="")
    assert g is not None
    head = (b"DKIM-Signature: v=1; a=rsa-sha256; d=example.org; s=s1;\r\n\th=from:subject; bh=x; b=y\r\n"
            b"From: alice@example.org\r\nTo: z@old.example\r\n")
    assert (b"DKIM-Signature: v=1; a=rsa-sha256; d=example.org; s=s1;\r\n\th=from:subject; bh=x; b=y\r\n"
            b"From: alice@example.org\r\nTo: z@new.example\r\n") == g.head(head)
    assert "alice@public.example" == g.address("alice@example.org")


MAPS = {
    "sender_canonical_maps": "alice@example.org  Alice.Smith@example.org\n",
    "recipient_canonical_maps": "bob@example.net  robert@example.net\n",
    "canonical_maps": "@old.example  @new.example\ncarol@example.net carol.c@example.net\n",
}


def _config(tmp_path, extra: str = "") -> str:
    lines = []
    for key, table in MAPS.items():
        (tmp_path / key).write_text(table)
        (tmp_path / key).chmod(0o644)
        lines.append(f'{key} = "{tmp_path / key}"')
    return "\n".join(lines) + "\nreceive_buffer_bytes = 4096\n" + extra


def test_canonical_maps_rewrite_envelope_and_headers_before_queue_and_signature(relay_factory, tmp_path):
    """A daemon with the three maps and a DKIM key for example.org (the client is in mynetworks): a small
    message and one spilled to its temporary file (200 KiB) arrive at the sink with the envelope sender
    rewritten (Return-Path), the recipients rewritten (Delivered-To: the envelope as delivered), From:,
    To: and a Cc: of several display-named addresses rewritten, the @old.example -> @new.example form
    applied, the bodies whole, and DKIM signatures (made after the rewrite) that verify."""
    key_file, zone_line = keygen(tmp_path, "example.org", "s1")
    r = relay_factory(config=_config(tmp_path, f'[dkim_keys."example.org"]\nselector = "s1"\nkey_file = "{key_file}"\n'))
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    big = b"".join(b"line %06d of a large body\r\n" % i for i in range(7500))
    sent = {"<small@p>": b"short body\r\n", "<big@p>": big}
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        for mid, body in sent.items():
            assert {} == s.sendmail("alice@example.org", ["bob@example.net", "zed@old.example"], (
                f'From: "Alice A." <alice@example.org>\r\nTo: Bob <bob@example.net>, zed@old.example\r\n'
                f'Cc: "Carol, C." <carol@example.net>,\r\n (c) Dan <dan@example.net>, Ann <ann@old.example>\r\n'
                f"Subject: hello\r\nMessage-ID: {mid}\r\n\r\n").encode() + body)
    stored = r.wait_for(lambda: (m := _stored(r.maildir)) and len(m) == 2 and m, what="2 messages")
    with ZoneServer(zone_line + "\n", origin="org.") as zone:
        check = dnsfunc_for(zone)
        for mid, body in sent.items():
            m = stored[mid]
            head = m.split(b"\r\n\r\n", 1)[0]
            assert m.startswith(b"Return-Path: <Alice.Smith@example.org>\r\n"
                                b"Delivered-To: robert@example.net\r\nDelivered-To: zed@new.example\r\n"), mid
            assert b'\r\nFrom: "Alice A." <Alice.Smith@example.org>\r\n' in head, mid
            assert b"\r\nTo: Bob <robert@example.net>, zed@new.example\r\n" in head, mid
            assert (b'\r\nCc: "Carol, C." <carol.c@example.net>,\r\n (c) Dan <dan@example.net>, '
                    b"Ann <ann@new.example>\r\n") in head, mid
            assert m.endswith(b"\r\n\r\n" + body), mid
            assert dkim.verify(m, dnsfunc=check), mid
    [one, _] = r.events("canonical_rewrite")
    assert ("Alice.Smith@example.org", ["bob@example.net -> robert@example.net", "zed@old.example -> zed@new.example"]) == (
        one["new_sender"], one["recipients"])


def test_canonical_maps_leave_the_headers_of_mail_from_the_internet(relay_factory, tmp_path):
    """A client outside mynetworks (127.0.0.2, mail for a relay domain): its envelope is rewritten, its
    headers are not (Postfix local_header_rewrite_clients): a signature made elsewhere stays whole."""
    r = relay_factory(config=_config(tmp_path, 'mynetworks = ["127.0.0.1/32"]\nrelay_domains = ["example.net"]\n'))
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30, source_address=("127.0.0.2", 0)) as s:
        assert {} == s.sendmail("alice@example.org", ["bob@example.net"],
                                b"From: alice@example.org\r\nTo: bob@example.net\r\nMessage-ID: <in@p>\r\n\r\nhi\r\n")
    m = r.wait_for(lambda: _stored(r.maildir).get("<in@p>"), what="the message")
    assert m.startswith(b"Return-Path: <Alice.Smith@example.org>\r\nDelivered-To: robert@example.net\r\n")
    assert b"\r\nFrom: alice@example.org\r\nTo: bob@example.net\r\n" in m


def test_generic_maps_rewrite_only_what_leaves(relay_factory, tmp_path):
    """smtp_generic_maps with a message held by header_checks: `mtaq queue show` gives the queued envelope
    and headers unchanged; once released, the sink gets the envelope sender and recipient and the unsigned
    From:/To: rewritten. A message signed at receipt (example.org has a key) keeps its signed From:/To: as
    they were (its signature verifies), only its envelope rewritten."""
    key_file, zone_line = keygen(tmp_path, "example.org", "s1")
    (tmp_path / "generic").write_text("alice@example.org alice@public.example\n"
                                      "@internal.example @public.example\n"
                                      "bob@example.net robert@example.net\n")
    (tmp_path / "generic").chmod(0o644)
    r = relay_factory(config=f'smtp_generic_maps = "{tmp_path / "generic"}"\n'
                      "header_checks = ['/^X-Hold:/ HOLD wait']\n"
                      f'[dkim_keys."example.org"]\nselector = "s1"\nkey_file = "{key_file}"\n')
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        assert {} == s.sendmail("carl@internal.example", ["bob@example.net"], (
            b"From: Carl <carl@internal.example>\r\nTo: Bob <bob@example.net>\r\nX-Hold: yes\r\n"
            b"Message-ID: <plain@p>\r\n\r\nhi\r\n"))
        assert {} == s.sendmail("alice@example.org", ["bob@example.net"], (
            b"From: Alice <alice@example.org>\r\nTo: Bob <bob@example.net>\r\nMessage-ID: <signed@p>\r\n\r\nhi\r\n"))
    [hold] = r.wait_for(lambda: r.events("header_checks_hold"), what="the hold event")

    def queue(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", *args, "--spool", r.spool],
                              capture_output=True, text=True, timeout=60)

    out = queue("show", hold["queue_id"], "--json")
    assert 0 == out.returncode, out.stderr
    shown = json.loads(out.stdout)
    assert ("carl@internal.example", ["bob@example.net"]) == (
        shown["sender"], [x["address"] for x in shown["recipients_detail"]])
    headers = dict((k, v) for k, v in shown["headers"])
    assert ("Carl <carl@internal.example>", "Bob <bob@example.net>") == (headers["From"], headers["To"])
    signed = r.wait_for(lambda: _stored(r.maildir).get("<signed@p>"), what="the signed message")
    assert signed.startswith(b"Return-Path: <alice@public.example>\r\nDelivered-To: robert@example.net\r\n")
    assert b"\r\nFrom: Alice <alice@example.org>\r\nTo: Bob <bob@example.net>\r\n" in signed
    with ZoneServer(zone_line + "\n", origin="org.") as zone:
        assert dkim.verify(signed, dnsfunc=dnsfunc_for(zone))
    assert 0 == queue("release", hold["queue_id"]).returncode
    plain = r.wait_for(lambda: _stored(r.maildir).get("<plain@p>"), what="the released message")
    assert plain.startswith(b"Return-Path: <carl@public.example>\r\nDelivered-To: robert@example.net\r\n")
    assert b"\r\nFrom: Carl <carl@public.example>\r\nTo: Bob <robert@example.net>\r\n" in plain
    assert plain.endswith(b"\r\n\r\nhi\r\n")
    assert {"bob@example.net"} == {e["recipient"] for e in r.events("delivered")}  # the log: queued addresses


def test_a_rewritten_recipient_keeps_its_original_address_as_orcpt():
    """RFC 3461 §4.2 ORCPT=rfc822;ORIGINAL added to a recipient canonical_maps rewrote (Postfix keeps the
    original recipient for DSNs); one given by the client, and an unchanged recipient, are kept as they are."""
    from mtaq.edge.server import _keep_original

    old = ["a@old.example", "b@old.example", "c@example.org"]
    new = ["a@new.example", "b@new.example", "c@example.org"]
    given = [(("NOTIFY", "FAILURE"),), (("ORCPT", "rfc822;b@client.example"),), ()]
    assert [(("NOTIFY", "FAILURE"), ("ORCPT", "rfc822;a@old.example")), (("ORCPT", "rfc822;b@client.example"),),
            ()] == _keep_original(old, new, given)
    assert [(("ORCPT", "rfc822;a@old.example"),), (("ORCPT", "rfc822;b@old.example"),), ()] == _keep_original(
        old, new, None)


def test_reload_reads_the_maps_again(relay_factory, tmp_path):
    """The canonical and generic map files changed in place (the configuration itself unchanged) and SIGHUP
    to the daemon: a message sent before goes out with the old tables' addresses, one sent after the
    `reloaded` event with the new ones (canonical at receipt, generic as it leaves)."""
    import signal

    canon_file, generic_file = tmp_path / "canonical", tmp_path / "generic"
    canon_file.write_text("alice@example.org first@example.org\n")
    generic_file.write_text("bob@example.net bob.first@example.net\n")
    for f in (canon_file, generic_file):
        f.chmod(0o644)
    r = relay_factory(config=f'canonical_maps = "{canon_file}"\nsmtp_generic_maps = "{generic_file}"\n')
    r.wait_for(lambda: r.events("listening"), what="the listening event")

    def send(mid: str) -> bytes:
        with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
            assert {} == s.sendmail("alice@example.org", ["bob@example.net"],
                                    f"From: alice@example.org\r\nMessage-ID: {mid}\r\n\r\nhi\r\n".encode())
        return bytes(r.wait_for(lambda: _stored(r.maildir).get(mid), what=f"delivery of {mid}"))

    assert send("<before@p>").startswith(b"Return-Path: <first@example.org>\r\nDelivered-To: bob.first@example.net\r\n")
    canon_file.write_text("alice@example.org second@example.org\n")
    generic_file.write_text("bob@example.net bob.second@example.net\n")
    r.daemon.popen.send_signal(signal.SIGHUP)
    [ev] = r.wait_for(lambda: r.events("reloaded"), what="reloaded")
    assert [] == ev["changed"]
    after = send("<after@p>")
    assert after.startswith(b"Return-Path: <second@example.org>\r\nDelivered-To: bob.second@example.net\r\n")
    assert b"\r\nFrom: second@example.org\r\n" in after


def test_mail_from_the_maildrop_is_rewritten_too(tmp_path):
    """`mtaq sendmail -t` as root (myhostname host.test): the table's bare `root` key (the user form, at
    myhostname) rewrites the envelope sender root@host.test and the From: sendmail wrote; the recipient's
    @domain form its envelope and To: (Postfix's cleanup rewrites pickup mail as it does smtpd's)."""
    import test_sendmail

    base = tmp_path / "h"
    base.mkdir()
    (tmp_path / "canonical").write_text("root  admin@example.org\n@old.example  @new.example\n")
    h = test_sendmail.Host(base, f'canonical_maps = "{tmp_path / "canonical"}"\n')
    try:
        h.start()
        r = test_sendmail.sendmail(h.cfg, "-t", stdin=b"To: Ann <ann@old.example>\nSubject: t\n\nhello\n")
        assert (0, b"") == (r.returncode, r.stderr)
        [m] = h.wait_messages(1)
        assert ("<admin@example.org>", ["ann@new.example"], "Ann <ann@new.example>") == (
            m["Return-Path"], m.get_all("Delivered-To"), m["To"])
        assert "admin@example.org" in m["From"]
    finally:
        h.close()


def test_mtaq_check_names_a_bad_line_of_either_map(tmp_path):
    """`mtaq check` loads the maps as the start does: a bad line of canonical_maps or smtp_generic_maps is a
    problem line naming the key, the file and the line; exit status 1."""
    (tmp_path / "bad").write_text("# fine\nalice@example.org\n")
    for key in ("canonical_maps", "smtp_generic_maps"):
        cfg = tmp_path / f"{key}.toml"
        cfg.write_text(f'spool_dir = "{tmp_path / "spool"}"\n{key} = "{tmp_path / "bad"}"\n')
        out = subprocess.run([sys.executable, "-m", "mtaq.cli", "check", "--config", str(cfg)],
                             capture_output=True, text=True, timeout=60)
        assert 1 == out.returncode, out.stdout + out.stderr
        assert f"{key}: {tmp_path / 'bad'}: line 2: expected KEY VALUE" in out.stdout + out.stderr


def test_long_and_hostile_address_lists(tmp_path):
    """A To: of 5,000 addresses is rewritten whole (each list element parsed alone: the standard parser is
    quadratic in what it is given); 5,000 nested comments (the parser's recursion) leave that field as it
    is and the others rewritten; a comma in a quoted name, a comment or a group does not cut an address."""
    c = canon(tmp_path)
    many = b"To: " + b",\r\n ".join(b"u%d@old.example" % i for i in range(5000)) + b"\r\n"
    assert many.replace(b"@old.example", b"@new.example") == c.head(many)
    hostile = b"Cc: " + b"(" * 5000 + b")" * 5000 + b" zed@old.example\r\nFrom: alice@example.org\r\n"
    assert hostile.replace(b"From: alice@", b"From: Alice.Smith@") == c.head(hostile)
    tricky = b'To: "x, alice@example.org" <zed@old.example> (a, b), team: a@old.example, b@old.example;\r\n'
    assert (b'To: "x, alice@example.org" <zed@new.example> (a, b), team: a@new.example, b@new.example;\r\n'
            == c.head(tricky))


@pytest.mark.parametrize("domain", ["Example.ORG", "bücher.test", "xn--bcher-kva.test", "BÜCHER.test", "[192.0.2.1]",
                                    "xn--zz.test", "a_b.test", "straße.de"])
def test_lookup_keys_fold_domains_as_the_smtp_edge_does(domain):
    """The tables' own copy of the edge's IDNA rule (mtaq.edge.policy imports mtaq.edge.canonical, which
    therefore cannot import it): the same A-labels, or None, for every domain."""
    from mtaq.edge import canonical, policy

    assert policy.domain_to_ascii(domain) == canonical.domain_to_ascii(domain)
