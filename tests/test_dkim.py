"""DKIM signing (issue 16, RFC 6376): signatures checked by dkimpy's verifier, its key looked up for real.

The public keys are served by :class:`mtaq.testing.dnsserver.ZoneServer` (a real DNS server on 127.0.0.1 that
stands in for the internet's DNS); dkimpy's ``dnsfunc`` asks it with dnspython, so every verification
below makes a real TXT query for ``SELECTOR._domainkey.DOMAIN``. Keys come from ``mtaq dkim keygen`` and
the zone records are the lines it prints.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import smtplib
import subprocess
import sys
from email import policy
from email.message import EmailMessage

import dkim
import dns.exception
import dns.resolver
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.core.errors import ConfigError
from mtaq.edge.dkim import Origin, RelaxedBodyHash, Signer, from_domain, headers_to_sign, load_key, split_head
from mtaq.testing.dnsserver import ZoneServer


def mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=120)


def keygen(tmp_path, domain: str, selector: str, *extra: str) -> tuple[str, str]:
    """Run ``mtaq dkim keygen``; returns (key file, the zone line it printed)."""
    out_file = str(tmp_path / f"{selector}.{domain}.pem")
    out = mtaq("dkim", "keygen", domain, selector, "--out", out_file, *extra)
    assert 0 == out.returncode, out.stderr
    [line] = out.stdout.splitlines()
    return out_file, line


def dnsfunc_for(server: ZoneServer):
    """dkimpy's ``dnsfunc``: the TXT record of ``name`` from ``server``, by a real DNS query (dnspython)."""

    def dnsfunc(name: bytes, timeout: float = 5) -> bytes | None:
        r = dns.resolver.Resolver(configure=False)
        r.nameservers = ["127.0.0.1"]
        r.port = server.port
        r.timeout = r.lifetime = timeout
        try:
            answer = r.resolve(name.decode("ascii"), "TXT")
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.exception.Timeout):
            return None
        return b"".join(b"".join(rd.strings) for rd in answer)

    return dnsfunc


def message(sender: str = "Alice <alice@example.test>", subject: str = "signed", body: str = "hello\n",
            mid: str = "<m1@mtaq.test>") -> bytes:
    m = EmailMessage()
    m["From"], m["To"], m["Subject"], m["Message-ID"] = sender, "bob@example.net", subject, mid
    m["Date"] = "Mon, 20 Nov 2023 04:19:26 +0000"
    m.set_content(body)
    return m.as_bytes(policy=policy.SMTP)


needs_nacl = pytest.mark.skipif(__import__("importlib").util.find_spec("nacl") is None,
                                reason="dkimpy's ed25519-sha256 needs PyNaCl")


@pytest.mark.parametrize("extra", [
    pytest.param((), id="rsa-2048"),
    pytest.param(("--bits", "4096"), id="rsa-4096"),
    pytest.param(("--type", "ed25519"), id="ed25519", marks=needs_nacl),
])
def test_keygen_writes_a_private_key_0600_and_a_txt_record_that_verifies_its_signature(tmp_path, extra):
    """The key file has mode 0600; the printed line is a zone file line whose strings are at most 255 bytes;
    served by a DNS server, it verifies a signature made with the key (and only the key's domain asks)."""
    key_file, line = keygen(tmp_path, "example.test", "s1", *extra)
    assert 0o600 == os.stat(key_file).st_mode & 0o777
    assert line.startswith('s1._domainkey.example.test. IN TXT "v=DKIM1; k=')
    strings = line.split(" IN TXT ", 1)[1].strip('"').split('" "')
    assert all(len(s) <= 255 for s in strings)
    assert (4096 in [int(x) for x in extra if x.isdigit()]) == (len(strings) == 3)  # 4096-bit p= spans 3 strings
    key = load_key("example.test", "s1", key_file)
    signed = Signer([key]).sign(message())
    with ZoneServer(line + "\n") as zone:
        assert dkim.verify(signed, dnsfunc=dnsfunc_for(zone))
        assert ("s1._domainkey.example.test.", "TXT") in zone.queries  # a real lookup was made
    assert f"a={key.algorithm};".encode() in signed.replace(b"\r\n ", b" ")


def test_a_signed_header_changed_afterwards_fails_verification_an_unsigned_one_does_not(tmp_path):
    """Negative control: the verifier used by every test here can fail. A changed Subject, a second From
    (From is over-signed, RFC 6376 §8.15) or a changed body fail; a Received field added on top does not."""
    key_file, line = keygen(tmp_path, "example.test", "s1")
    signed = Signer([load_key("example.test", "s1", key_file)]).sign(message(subject="original"))
    with ZoneServer(line + "\n") as zone:
        check = dnsfunc_for(zone)
        assert dkim.verify(signed, dnsfunc=check)
        assert not dkim.verify(signed.replace(b"Subject: original", b"Subject: changed"), dnsfunc=check)
        assert not dkim.verify(signed.replace(b"Subject:", b"From: mallory@example.test\r\nSubject:"), dnsfunc=check)
        assert not dkim.verify(signed.replace(b"hello", b"HELLO"), dnsfunc=check)
        assert dkim.verify(b"Received: from x by y; Mon, 20 Nov 2023 04:19:27 +0000\r\n" + signed, dnsfunc=check)


def test_signed_headers_are_those_of_rfc6376_5_4_1_and_each_once_more():
    """Each field of RFC 6376 §5.4.1's list once per occurrence, then each once more, present or not
    (over-signed, §8.15): no To, Reply-To, second Subject... can be added to a signed message."""
    head = (b"Received: x\r\nFrom: a@example.test\r\nTo: b@x\r\nCc: c@x\r\nBcc: d@x\r\nX-Mailer: m\r\n"
            b"Resent-From: r@x\r\nResent-Bcc: z@x\r\nList-Id: <l.x>\r\nSubject: s\r\n\tfolded\r\nDate: d\r\n")
    over = [b"from", b"sender", b"reply-to", b"subject", b"date", b"message-id", b"to", b"cc", b"in-reply-to",
            b"references", b"mime-version", b"content-type", b"content-transfer-encoding", b"content-id",
            b"content-description", b"resent-date", b"resent-from", b"resent-sender", b"resent-to", b"resent-cc",
            b"resent-message-id", b"list-id", b"list-help", b"list-unsubscribe", b"list-unsubscribe-post",
            b"list-subscribe", b"list-post", b"list-owner", b"list-archive"]
    assert [b"from", b"to", b"cc", b"resent-from", b"list-id", b"subject", b"date", *over] == headers_to_sign(head)


def test_no_header_field_can_be_added_to_a_signed_message(tmp_path):
    """Found by the outside review of issue 32: with only From over-signed, a Reply-To, To, Cc or a second
    Subject on top could be added to a genuinely signed message and it still verified (replay, redirected
    replies). Each such addition now breaks the signature; the message as signed verifies."""
    key_file, line = keygen(tmp_path, "example.test", "s1")
    signed = Signer([load_key("example.test", "s1", key_file)]).sign(message())
    with ZoneServer(line + "\n") as zone:
        check = dnsfunc_for(zone)
        assert dkim.verify(signed, dnsfunc=check)
        for added in (b"Reply-To: thief@evil.test", b"To: victim@example.net", b"Cc: x@evil.test",
                      b"Subject: URGENT", b"Content-Type: text/html",
                      # the second outside review (F2): Resent-*, List-*, Sender could still be added
                      b"Resent-From: ceo@example.test", b"Resent-Date: Mon, 1 Jan 2024 00:00:00 +0000",
                      b"Resent-To: victim@example.net", b"Resent-Cc: x@evil.test", b"Resent-Sender: x@evil.test",
                      b"List-Unsubscribe: <https://evil.test/u>", b"List-Unsubscribe-Post: List-Unsubscribe=One-Click",
                      b"List-Id: <evil.test>", b"List-Help: <https://evil.test/h>", b"List-Subscribe: <mailto:s@evil.test>",
                      b"List-Post: <mailto:p@evil.test>", b"List-Owner: <mailto:o@evil.test>",
                      b"List-Archive: <https://evil.test/a>", b"Sender: x@evil.test"):
            assert not dkim.verify(added + b"\r\n" + signed, dnsfunc=check), added
            assert not dkim.verify(signed.replace(b"\r\n\r\n", b"\r\n" + added + b"\r\n\r\n", 1), dnsfunc=check), added
        # A List-* field present once is over-signed too: a second one cannot be added.
        listed = Signer([load_key("example.test", "s1", key_file)]).sign(
            message().replace(b"\r\n\r\n", b"\r\nList-Post: <mailto:list@example.test>\r\n\r\n", 1))
        assert dkim.verify(listed, dnsfunc=check)
        assert not dkim.verify(b"List-Post: <mailto:p@evil.test>\r\n" + listed, dnsfunc=check)


def test_the_signing_domain_is_the_one_from_address_else_nothing():
    """d= follows the From: header (DMARC alignment), not the envelope; no From, two From fields or two
    addresses: None (relayed unsigned)."""
    assert "example.test" == from_domain(b"From: \"A, B\" <a@Example.TEST.>\r\nSender: s@other.test\r\n")
    assert "sub.example.test" == from_domain(b"From: a@sub.example.test\r\n")
    assert "xn--bcher-kva.test" == from_domain("From: a@bücher.test\r\n".encode())
    assert None is from_domain(b"To: a@example.test\r\n")
    assert None is from_domain(b"From: a@example.test\r\nFrom: b@example.test\r\n")
    assert None is from_domain(b"From: a@example.test, b@example.test\r\n")
    assert None is from_domain(b"From: undisclosed\r\n")


def test_a_subdomain_uses_its_closest_parent_key_and_other_domains_are_not_signed(tmp_path):
    key_file, _ = keygen(tmp_path, "example.test", "s1")
    signer = Signer([load_key("example.test", "s1", key_file)])
    assert "example.test" == signer.key_for("mx.sub.example.test").domain
    assert None is signer.key_for("other.test")
    assert None is signer.key_for("badexample.test")
    assert b"" == signer.signature(message(sender="x@other.test"))
    # no header section (the message starts with an empty line): a From: line in the body chooses nothing
    assert b"" == signer.signature(b"\r\nFrom: a@example.test\r\n\r\nbody\r\n")
    assert message(sender="x@other.test") == signer.sign(message(sender="x@other.test"))


def test_unsafe_weak_or_unusable_key_files_are_refused_with_one_line_naming_the_key(tmp_path):
    """Mode 0644 (or 0640), RSA 1024, an encrypted key, not a key: ConfigError naming dkim_keys."DOMAIN"
    and never the key material."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key_file, _ = keygen(tmp_path, "example.test", "s1")
    secret = open(key_file).read()
    os.chmod(key_file, 0o640)
    with pytest.raises(ConfigError, match=r'^dkim_keys\."example.test"\.key_file: .* has mode 0640: it must be readable only'):
        load_key("example.test", "s1", key_file)

    def write(name: str, data: bytes) -> str:
        p = tmp_path / name
        p.write_bytes(data)
        p.chmod(0o600)
        return str(p)

    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    cases = {
        write("weak.pem", weak.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())): "RSA key of 1024 bits, at least 2048",
        write("enc.pem", weak.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"pw"))): "encrypted",
        write("junk.pem", secret[:200].encode()): "not a PEM private key",
        str(tmp_path / "missing.pem"): "No such file",
    }
    for path, why in cases.items():
        with pytest.raises(ConfigError) as exc:
            load_key("example.test", "s1", path)
        text = str(exc.value)
        assert why in text and text.startswith('dkim_keys."example.test".key_file: ') and "\n" not in text
        assert secret.splitlines()[1] not in text
    with pytest.raises(ConfigError, match="selector"):
        load_key("example.test", "bad selector", key_file)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_exits_2_with_one_line_when_a_key_file_is_readable_by_others(tmp_path, workers):
    """With one process and with several workers (checked before any worker starts)."""
    key_file, _ = keygen(tmp_path, "example.test", "s1")
    os.chmod(key_file, 0o644)
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text(f'[dkim_keys."example.test"]\nselector = "s1"\nkey_file = "{key_file}"\n')
    out = mtaq("serve", "--config", str(cfg), "--spool", str(tmp_path / "spool"), "--listen", "127.0.0.1:2",
               "--admin-listen", "", "--workers", workers)
    assert 2 == out.returncode
    assert [f'mtaq: dkim_keys."example.test".key_file: {key_file} has mode 0644: it must be readable only by the '
            "daemon (chmod 600)"] == out.stderr.splitlines()


def _stored(maildir: str) -> dict[str, bytes]:
    """Message-ID -> the message as the sink stored it (Return-Path and Delivered-To lines on top)."""
    import email.parser

    out = {}
    for p in glob.glob(os.path.join(maildir, "new", "*")):
        data = open(p, "rb").read()
        mid = email.parser.BytesHeaderParser().parsebytes(data).get("Message-ID", "").strip()
        out[mid] = data
    return out


def test_mail_relayed_through_the_daemon_and_its_dsn_verify_at_the_sink(relay_factory, tmp_path):
    """The real daemon signs what it queues and the real sink receives it: a small message and one larger
    than receive_buffer_bytes (the temporary-file path) verify, DKIM-Signature is the top field with the
    Received field below it, mail from a domain without a key arrives unsigned, and the DSN for a refused
    recipient (From: MAILER-DAEMON@mx.example.test) verifies with the key of example.test. No key material
    in the daemon's log."""
    key_file, line = keygen(tmp_path, "example.test", "s1")
    r = relay_factory(
        sink_args=["--reject-rcpt", "^nobody@"],
        config=(f'myhostname = "mx.example.test"\nretry_intervals_s = [1.0]\nreceive_buffer_bytes = 4096\n'
                f'[dkim_keys."example.test"]\nselector = "s1"\nkey_file = "{key_file}"\n'),
    )
    big_body = "".join(f"line {i} of a large body \t with  spaces   \n" for i in range(4000))  # ~170 KB
    sends = [
        ("alice@example.test", message(mid="<small@mtaq.test>"), ["bob@example.net"]),
        ("alice@example.test", message(mid="<big@mtaq.test>", body=big_body), ["bob@example.net"]),
        ("carol@other.test", message(sender="carol@other.test", mid="<other@mtaq.test>"), ["bob@example.net"]),
        ("alice@example.test", message(mid="<bounced@mtaq.test>"), ["nobody@example.net"]),
    ]
    for sender, msg, rcpts in sends:
        with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
            s.ehlo("client.test")
            assert {} == s.sendmail(sender, rcpts, msg)
    stored = r.wait_for(lambda: (m := _stored(r.maildir)) and len(m) == 4 and m, what="3 messages and a DSN")
    [dsn_mid] = [k for k in stored if "mtaq.test" not in k]
    with ZoneServer(line + "\n") as zone:
        check = dnsfunc_for(zone)
        for mid in ("<small@mtaq.test>", "<big@mtaq.test>", dsn_mid):
            data = stored[mid]
            assert dkim.verify(data, dnsfunc=check), mid
            names = [h.split(b":", 1)[0] for h in data.split(b"\r\n\r\n")[0].split(b"\r\n") if h[:1] not in b" \t"]
            ours = [n for n in names if n not in (b"Return-Path", b"Delivered-To")]  # the sink's
            second = b"From" if mid == dsn_mid else b"Received"  # a DSN made here has no Received field
            assert [b"DKIM-Signature", second] == ours[:2], mid
        assert b"DKIM-Signature" not in stored["<other@mtaq.test>"]
        assert not dkim.verify(stored["<small@mtaq.test>"].replace(b"Subject: signed", b"Subject: changed"), dnsfunc=check)
    assert b"From: Mail Delivery System <MAILER-DAEMON@mx.example.test>" in stored[dsn_mid]
    assert b"d=example.test;" in stored[dsn_mid]
    log = open(r.daemon.log_path, "rb").read()
    assert open(key_file, "rb").read().splitlines()[1] not in log


LOCAL = Origin(client="127.0.0.1:1025", mynetworks=True, login="", mail_from="alice@example.test")


def test_a_body_in_the_temporary_file_is_signed_from_it_in_pieces(tmp_path):
    """A BodyBuffer that spilled to its temporary file (bodies beyond receive_buffer_bytes) is signed over all
    of its pieces (hashed piece by piece, in a worker thread), and the signature verifies on the bytes the
    log will hold: the signature, then the buffer's pieces."""
    import asyncio

    from mtaq.storage.spill import BodyBuffer

    key_file, line = keygen(tmp_path, "example.test", "s1")
    signer = Signer([load_key("example.test", "s1", key_file)])
    msg = message(body="".join(f"piece {i} \t  spaced\t\n" + "\n" * (i % 3) for i in range(20000)) + "\n\n\n")
    buf = BodyBuffer(str(tmp_path), memory_bytes=4096, chunk_bytes=4096)
    for i in range(0, len(msg), 1000):
        buf.write(msg[i : i + 1000])
    assert buf.spilled
    sig = asyncio.run(signer.signature_of(buf, LOCAL))
    buf.head = sig
    relayed = b"".join(buf.pieces())
    buf.close()
    assert sig + msg == relayed
    with ZoneServer(line + "\n") as zone:
        assert dkim.verify(relayed, dnsfunc=dnsfunc_for(zone))
        assert not dkim.verify(relayed.replace(b"piece 19999", b"piece 19998"), dnsfunc=dnsfunc_for(zone))
    other = BodyBuffer(str(tmp_path), memory_bytes=4096)
    other.write(message(sender="x@other.test", body="x" * 70 + "\n" * 100))
    assert b"" == asyncio.run(signer.signature_of(other, LOCAL))
    other.close()


def _dkimpy_body_hash(message_bytes: bytes) -> bytes:
    """dkimpy's own relaxed body hash of a message (what its verifier compares bh= with)."""
    import hashlib

    from dkim.canonicalization import CanonicalizationPolicy

    _, body = dkim.rfc822_parse(message_bytes)
    return hashlib.sha256(CanonicalizationPolicy.from_c_value(b"relaxed/relaxed").canonicalize_body(body)).digest()


_BODY_PARTS = [b"a", b"bc", b" ", b"\t", b"  \t ", b"\r\n", b"\n", b"\r", b"x y", b"\r\n\r\n", b".", b"\xff"]


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(_BODY_PARTS), max_size=40), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_the_body_hash_computed_in_pieces_is_dkimpys_for_any_body_and_any_cuts(parts, cuts):
    """RFC 6376 §3.4.4 relaxed body canonicalization, fed in pieces cut anywhere (inside a CRLF, inside a run of
    whitespace, before trailing empty lines), hashes exactly as dkimpy's canonicalize_body over the whole body:
    empty body, whitespace-only lines, trailing empty lines, a last line without a line end, bare CR and LF."""
    body = b"".join(parts)
    msg = b"From: a@example.test\r\nSubject: s\r\n\r\n" + body
    cut = split_head(msg)
    assert cut is not None and body == msg[cut:]
    h = RelaxedBodyHash()
    at = 0
    for c in sorted(cuts):
        h.update(body[at:c])
        at = max(at, c)
    h.update(body[at:])
    assert _dkimpy_body_hash(msg) == h.digest()


@pytest.mark.parametrize("msg", [
    b"From: a@example.test\r\n\r\n",
    b"From: a@example.test\r\n",  # no body at all
    b"From: a@example.test\r\nSubject: x\r\n\r\n\r\n\r\n",
    b"From: a@example.test\r\n\r\nline  \t\r\n \r\nlast \t",
])
def test_signing_in_pieces_verifies_and_has_the_body_hash_of_signing_whole(tmp_path, msg):
    """The signature made from pieces (dkimpy signs the header section with the body hash given) verifies, and
    its bh= is the one dkimpy's own sign() puts on the whole message."""
    import re

    key_file, line = keygen(tmp_path, "example.test", "s1")
    signer = Signer([load_key("example.test", "s1", key_file)])
    key = signer.wants(msg)
    assert key is not None
    sig = signer.signature_of_pieces([msg[i : i + 7] for i in range(0, len(msg), 7)], key)
    whole = signer.signature(msg)

    def bh(field: bytes) -> bytes:
        return re.search(rb"bh=([^;]+);", re.sub(rb"\s+", b"", field)).group(1)

    assert bh(whole) == bh(sig)
    with ZoneServer(line + "\n") as zone:
        assert dkim.verify(sig + msg, dnsfunc=dnsfunc_for(zone))


def test_signing_concurrent_large_messages_keeps_the_daemon_memory_bounded(relay_factory, tmp_path):
    """Issue 32.6: eight sessions from mynetworks send 9.5 MB each at once, every one DKIM-signed (held with
    HOLDFOR, so that no delivery reads them back): the daemon's peak RSS (VmHWM) grows by far less than one
    message each (whole-message signing grew it by about 10 MiB per message: +208 MiB for 20). Then one more
    9.5 MB message is delivered and its signature verifies with dkimpy."""
    from test_streamed_data import _send_big

    from mtaq.testing.procs import peak_rss_kib

    key_file, line = keygen(tmp_path, "example.org", "s1")
    r = relay_factory(config=(f'message_size_limit_bytes = 12000000\n[dkim_keys."example.org"]\nselector = "s1"\n'
                              f'key_file = "{key_file}"\n'))
    before = peak_rss_kib(r.daemon.popen.pid)
    assert before is not None
    n, size = 8, 9_500_000
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(lambda i: _send_big(r.daemon.port, i, size, ["HOLDFOR=3600"]), range(n)))
    assert all(code == 250 for code, _ in replies), replies
    after = peak_rss_kib(r.daemon.popen.pid)
    assert after is not None
    grown_mib = (after - before) / 1024
    print(f"peak RSS grew by {grown_mib:.1f} MiB for {n} x {size} bytes, DKIM-signed")
    assert grown_mib < 40, f"peak RSS grew by {grown_mib:.0f} MiB for {n} x {size} bytes, DKIM-signed"
    assert 250 == _send_big(r.daemon.port, 99, size, [])[0]
    r.wait_for(lambda: r.events("delivered"), timeout_s=60, what="the large message delivered")
    (path,) = glob.glob(r.maildir + "/new/*")
    with open(path, "rb") as f:
        got = f.read()
    assert len(got) > size and b"d=example.org;" in got
    with ZoneServer(line + "\n", origin="org.") as zone:
        assert dkim.verify(got, dnsfunc=dnsfunc_for(zone))
        assert not dkim.verify(got.replace(b"0000099 LLL", b"0000099 LLX", 1), dnsfunc=dnsfunc_for(zone))
