"""``mtaq check`` (issue 33 item 4; Postfix's ``postfix check``) and the same checks at ``mtaq serve``'s start.

Real files: trustme certificates and keys, a bcrypt password file, DKIM keys made by mtaq, a real spool
directory; the command is run as a subprocess. Every problem is one line, all of them in one run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import trustme

from mtaq.edge.auth import hash_password
from mtaq.edge.dkim import generate_key
from mtaq.testing.procs import free_port, mail_owner_ready


def write(path, data: bytes | str, mode: int = 0o600) -> str:
    p = str(path)
    with open(p, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(p, mode)
    return p


def mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=60)


def good_files(tmp) -> dict[str, str]:
    """A config's files, every one sound: TLS pair, CA file, auth and outbound password files, a DKIM key."""
    ca = trustme.CA()
    cert = ca.issue_cert("mx.example.org")
    other = ca.issue_cert("other.example.org")
    pem, _ = generate_key("ed25519")
    spool = tmp / "spool"
    spool.mkdir(mode=0o700)
    return {
        "cert": write(tmp / "cert.pem", cert.cert_chain_pems[0].bytes()),
        "key": write(tmp / "key.pem", cert.private_key_pem.bytes()),
        "other_key": write(tmp / "other.key.pem", other.private_key_pem.bytes()),
        "ca": write(tmp / "ca.pem", ca.cert_pem.bytes(), 0o644),
        "auth": write(tmp / "users", f"alice:{hash_password(b'secret', rounds=4)}\n"),
        "sasl": write(tmp / "sasl_passwd", "[relay.example.net]:587 bob:pw\n"),
        "dkim": write(tmp / "dkim.pem", pem),
        "spool": str(spool),
    }


def config(tmp, f: dict[str, str], *, listen: str, key: str = "key") -> str:
    return write(tmp / "mtaq.toml", f"""
spool_dir = "{f['spool']}"
listen = "{listen}"
admin_listen = "127.0.0.1:0"
tls_cert_file = "{f['cert']}"
tls_key_file = "{f[key]}"
auth_password_file = "{f['auth']}"
smtp_sasl_auth_enable = true
smtp_sasl_password_file = "{f['sasl']}"
smtp_tls_CAfile = "{f['ca']}"
[dkim_keys."example.org"]
selector = "s1"
key_file = "{f['dkim']}"
""", 0o644)


def test_check_of_a_sound_config_exits_0_and_prints_nothing(tmp_path):
    f = good_files(tmp_path)
    mail_owner_ready(f["spool"])
    out = mtaq("check", "--config", config(tmp_path, f, listen=f"127.0.0.1:{free_port()}"), "--bind", "--no-dns")
    assert (0, "", "") == (out.returncode, out.stdout, out.stderr)


def test_check_reports_every_problem_one_line_each(tmp_path):
    """A key of another certificate, a world-readable auth password file, a DKIM key that is no key, a spool
    writable by others and a listen address that does not parse: five lines, exit 1, in one run."""
    f = good_files(tmp_path)
    os.chmod(f["auth"], 0o644)
    write(f["dkim"], "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    os.chmod(f["spool"], 0o777)
    out = mtaq("check", "--config", config(tmp_path, f, listen="127.0.0.1:99999", key="other_key"), "--no-dns")
    lines = out.stdout.splitlines()
    wanted = ["listen: port 99999 out of range",
              f"spool: {f['spool']} has mode 0777",
              f"auth_password_file: {f['auth']} has mode 0644",
              "tls_key_file does not match tls_cert_file",
              'dkim_keys."example.org"']
    assert (1, 5, "") == (out.returncode, len(lines), out.stderr), out.stdout
    assert [True] * 5 == [w in line for w, line in zip(wanted, lines, strict=True)], lines


def test_check_bind_names_an_address_in_use(tmp_path):
    f = good_files(tmp_path)
    mail_owner_ready(f["spool"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = mtaq("check", "--config", config(tmp_path, f, listen=f"127.0.0.1:{port}"), "--bind", "--no-dns")
    assert (1, [f"mtaq: check: listen 127.0.0.1:{port}: Address already in use (cannot be bound now)"]) == (
        out.returncode, out.stdout.splitlines())


def test_serve_refuses_a_world_readable_auth_password_file(tmp_path):
    """The newcomer's finding: mode 0644 was accepted silently; now exit 2 with one line, before binding."""
    f = good_files(tmp_path)
    os.chmod(f["auth"], 0o644)
    mail_owner_ready(f["spool"])
    out = mtaq("--log-format", "json", "serve", "--config",
               config(tmp_path, f, listen=f"127.0.0.1:{free_port()}"), "--workers", "1")
    assert (2, [f"mtaq: auth_password_file: {f['auth']} has mode 0644: it must be readable only by its owner "
                "(chmod 600)"]) == (out.returncode, out.stderr.splitlines())


def test_check_looks_up_each_dkim_keys_record(tmp_path):
    """Issue 33 item 4: `mtaq check` asks DNS (a real server on loopback, `dns_nameservers`) for each key's
    TXT record: good.test publishes its key (split into 255-octet strings, as `mtaq dkim keygen` prints it):
    no line; other.test publishes another key, missing.test nothing, revoked.test an empty p=: one line each,
    naming the record and what to publish; silent.test's server does not answer: not checked, no line.
    `--no-dns`: no lookup, exit 0."""
    from mtaq.edge.dkim import txt_record
    from mtaq.testing.dnsserver import ZoneServer

    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    mail_owner_ready(str(spool))
    keys, zone = {}, ""
    for d in ("good", "other", "missing", "revoked", "silent"):
        pem, value = generate_key("rsa" if d == "good" else "ed25519")
        keys[d] = write(tmp_path / f"{d}.pem", pem)
        if d in ("good", "silent"):
            zone += txt_record(f"{d}.test", "s1", value) + "\n"
        elif d == "other":
            zone += txt_record(f"{d}.test", "s1", generate_key("ed25519")[1]) + "\n"
        elif d == "revoked":
            zone += txt_record(f"{d}.test", "s1", "v=DKIM1; k=ed25519; p=") + "\n"
    with ZoneServer(zone, origin="test.", silent=["s1._domainkey.silent"]) as server:
        cfg = write(tmp_path / "mtaq.toml", f'spool_dir = "{spool}"\nlisten = "127.0.0.1:{free_port()}"\n'
                    f'admin_listen = ""\ndns_nameservers = ["127.0.0.1:{server.port}"]\n'
                    + "".join(f'[dkim_keys."{d}.test"]\nselector = "s1"\nkey_file = "{path}"\n'
                              for d, path in keys.items()), 0o644)
        out = mtaq("check", "--config", cfg)
        quiet = mtaq("check", "--config", cfg, "--no-dns")
        asked = sorted({name for name, _ in server.queries})
    lines = out.stdout.splitlines()
    assert (1, 3, "") == (out.returncode, len(lines), out.stderr), out.stdout
    assert lines[0].startswith('mtaq: check: dkim_keys."other.test": the record at s1._domainkey.other.test '
                               "publishes another key than key_file's (publish: v=DKIM1; k=ed25519; p=")
    assert lines[1].startswith('mtaq: check: dkim_keys."missing.test": no DKIM record at '
                               "s1._domainkey.missing.test (publish: v=DKIM1; k=ed25519; p=")
    assert 'mtaq: check: dkim_keys."revoked.test": the record at s1._domainkey.revoked.test is revoked (empty p=)' == lines[2]
    assert [f"s1._domainkey.{d}.test." for d in sorted(keys)] == asked
    assert (0, "") == (quiet.returncode, quiet.stdout)
