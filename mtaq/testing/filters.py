"""Real content filters (milters) as subprocesses on loopback, for tests: rspamd and OpenDKIM (issue 34).

Both are the Debian packages (``make debs`` installs ``rspamd`` and ``opendkim``), started with every file
they use in a temporary directory: no system-wide configuration (``/etc/rspamd``, ``/etc/opendkim.conf``),
no systemd, no Redis, no DNS or other network. Each listens on ``127.0.0.1`` and is ready when it answers
a milter option negotiation (``SMFIC_OPTNEG``, Sendmail milter protocol version 6), not merely when its port
accepts connections: rspamd's main process binds the socket before its proxy worker runs.

- :func:`start_rspamd`: rspamd's proxy worker in milter mode scanning by itself (``self_scan``), as
  rspamd's documentation configures it behind Postfix (https://rspamd.com/doc/integration.html).
  GTUBE in a body is rejected ``554 5.7.1 Gtube pattern``; a clean message gets ``X-Spamd-Result`` and
  ``X-Spam-Status`` added (``milter_headers``); with ``enable_test_patterns`` (on here) the GTUBE variants
  ``YJS*...`` (add header: ``X-Spam: Yes``) and ``ZJS*...`` (rewrite subject) force the other actions.
- :func:`start_rspamd_distribution`: the same worker on the distribution's own ``/etc/rspamd`` configuration
  with given ``local.d`` files (README "Filtering with rspamd"), the network cut.
- :func:`start_opendkim`: OpenDKIM in sign mode (``Mode s``) with a fresh RSA key; it signs mail from its
  ``InternalHosts`` or from an authenticated client (the ``{auth_type}`` macro of the MAIL step).

What an MTA must do for them (tests/test_milter_filters.py): rspamd 3.4 takes the no-reply steps
(``SMFIP_NR_*``, protocol 0xff080) whether offered or not; its reject is ``SMFIR_REPLYCODE`` ``554 5.7.1
...``; its X-Spam flag, a rewritten Subject and the deletion of a client's X-Spam fields are change-header
modifications (index 1; an absent field is added, an empty value deletes). OpenDKIM inserts its
``DKIM-Signature`` at index 0, the value folded with LF and a leading space (``SMFIP_HDR_LEADSPC``, taken
when offered), and accepts at the end of headers a message it will not sign.

Run as root (the tests are), each drops to its package's system user (``_rspamd``, ``opendkim``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mtaq.testing.procs import children, free_port, mail_owner_ready

__all__ = ["GTUBE", "GTUBE_ADD_HEADER", "GTUBE_REWRITE_SUBJECT", "Filter", "OpenDkim", "Rspamd",
           "milter_optneg", "start_opendkim", "start_rspamd", "start_rspamd_distribution",
           "wait_milter"]

# The GTUBE line (https://spamassassin.apache.org/gtube/): rspamd's core rejects a body with it.
GTUBE = "XJS*C4JDBQADN1.NSBN3*2IDNEN*GTUBE-STANDARD-ANTI-UBE-TEST-EMAIL*C.34X"
# rspamd's test variants (option ``enable_test_patterns``): action "add header", action "rewrite subject".
GTUBE_ADD_HEADER = "Y" + GTUBE[1:]
GTUBE_REWRITE_SUBJECT = "Z" + GTUBE[1:]

# Milter protocol (libmilter's mfdef.h): version 6, every action and protocol step bit.
_SMFI_VERSION = 6
_SMFI_V6_ACTS = 0x1FF
_SMFI_V6_PROT = 0x1FFFFF


@dataclass
class Filter:
    """A running milter: ``address`` is how mtaq (``smtpd_milters``) and Postfix name it, ``inet:HOST:PORT``.

    ``start_s``: seconds from the exec to its first answered option negotiation. ``log_path``: its stdout
    and stderr (rspamd logs into ``filter_log`` as well; OpenDKIM logs only to syslog, which it is told not
    to use). ``stop()`` ends it and every process it started; a fixture calls it at teardown."""

    name: str
    popen: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: str
    start_s: float
    filter_log: str = ""
    stop_grace_s: float = 10.0
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return f"inet:{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        """Its stdout/stderr, then its own log file (rspamd's), "" for what is not there."""
        out = []
        for path in (self.log_path, self.filter_log):
            if path:
                try:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        out.append(f.read())
                except FileNotFoundError:
                    pass
        return "\n".join(out)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM and wait up to ``timeout_s`` seconds (default: ``stop_grace_s``) for it and its worker
        processes to exit; SIGKILL whatever is left (at once with a grace of 0). Idempotent."""
        if self._stopped:
            return
        timeout_s = self.stop_grace_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            self.kill9()
            return
        self._stopped = True
        kids = children(self.popen.pid) if self.popen.poll() is None else []
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)  # an rspamd worker the main process did not take down
            except ProcessLookupError:
                pass

    def kill9(self) -> None:
        """SIGKILL it and its workers now (a filter that crashed), and reap it."""
        kids = children(self.popen.pid) if self.popen.poll() is None else []
        for pid in [self.popen.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait()
        self._stopped = True


@dataclass
class Rspamd(Filter):
    """rspamd's milter (its proxy worker). ``config_path``: the rspamd.conf it runs on."""

    config_path: str = ""


@dataclass
class OpenDkim(Filter):
    """OpenDKIM signing for ``domain`` with ``selector``. ``dns_txt``: the TXT record value that publishes
    the public key (``v=DKIM1; k=rsa; p=...``, RFC 6376 §3.6.1) at ``SELECTOR._domainkey.DOMAIN``;
    ``zone_line``: that record as a zone file line (for :class:`mtaq.testing.dnsserver.ZoneServer`);
    ``key_file``: the private key (PKCS#8 PEM)."""

    domain: str = ""
    selector: str = ""
    key_file: str = ""
    dns_txt: str = ""
    # libmilter looks for a termination signal once every 5 s: a SIGTERM costs up to 5 s of every test's
    # teardown, and a signing filter keeps no state that a SIGKILL could lose.
    stop_grace_s: float = 0.0
    zone_line: str = ""
    config_path: str = ""


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("milter closed the connection during option negotiation")
        data += chunk
    return data


def milter_optneg(
    host: str, port: int, timeout_s: float = 2.0, *, actions: int = _SMFI_V6_ACTS, protocol: int = _SMFI_V6_PROT
) -> tuple[int, int, int]:
    """Connect to the milter at ``host``:``port``, offer protocol version 6 with ``actions`` and ``protocol``
    (``SMFIC_OPTNEG``; default: every action, step and no-reply bit of libmilter's mfdef.h), and return its
    answer (version, actions, protocol bits); then ``SMFIC_QUIT``. Raises OSError (refused, timed out,
    closed) or ValueError (an answer that is not ``SMFIC_OPTNEG``)."""
    body = b"O" + struct.pack("!III", _SMFI_VERSION, actions, protocol)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(struct.pack("!I", len(body)) + body)
        (length,) = struct.unpack("!I", _recv_exact(s, 4))
        reply = _recv_exact(s, length)
        if reply[:1] != b"O" or length < 13:
            raise ValueError(f"not an option negotiation reply: {reply[:16]!r}")
        s.sendall(struct.pack("!I", 1) + b"Q")
        version, actions, protocol = struct.unpack("!III", reply[1:13])
        return version, actions, protocol


def wait_milter(host: str, port: int, proc: subprocess.Popen[bytes], timeout_s: float, log: str = "") -> None:
    """Wait until the milter at ``host``:``port`` answers an option negotiation; RuntimeError (with the tail
    of ``log``) when ``proc`` exits first or after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"milter exited with {proc.returncode} before answering on {port}: {_tail(log)}")
        try:
            milter_optneg(host, port, timeout_s=max(0.1, min(2.0, deadline - time.monotonic())))
            return
        except (OSError, ValueError) as e:
            error = e
            time.sleep(0.02)
    raise RuntimeError(f"no milter answer on {host}:{port} after {timeout_s}s ({error}): {_tail(log)}")


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except (FileNotFoundError, ValueError):
        return ""


def _program(name: str) -> str:
    path = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if path is None:
        raise RuntimeError(f"{name} is not installed (make debs installs the Debian packages rspamd and opendkim)")
    return path


def _system_user(*names: str) -> pwd.struct_passwd:
    for name in names:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(f"none of the users {list(names)} exists (created by the Debian package)")


def _owned(path: str, user: pwd.struct_passwd | None, mode: int = 0o700) -> str:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)
    return path


# rspamd's configuration: every path under the work directory; no distribution file is included.
# No Lua rules and no C filters (``filters = ""``): what is left is rspamd's core (GTUBE), the actions and
# the milter_headers module (the headers a clean message gets). DNS goes to a closed loopback port, so
# nothing can reach out; url_tld is a 5-line list (the 9,600-suffix one takes ~20 s to compile).
_RSPAMD_CONF = """\
options {{
  pidfile = "{run}/rspamd.pid";
  filters = "";
  enable_test_patterns = true;
  url_tld = "{dir}/tld.dat";
  tempdir = "{db}";
  hs_cache_dir = "{db}/";
  cache_file = "{db}/symbols.cache";
  local_addrs = [];
  task_timeout = 8s;
  dns {{ nameserver = ["127.0.0.1:{dns_port}"]; timeout = 0.5s; retransmits = 1; }}
}}
lang_detection {{ languages = "{dir}/languages"; }}
modules {{ path = "${{PLUGINSDIR}}"; }}
logging {{ type = "file"; filename = "{log}"; level = "info"; }}
actions {{ reject = {reject}; add_header = {add_header}; greylist = {greylist}; }}
milter_headers {{
  use = ["x-spamd-result", "x-spam-status"];
  skip_local = false;
  skip_authenticated = false;
}}
worker "rspamd_proxy" {{
  bind_socket = "127.0.0.1:{port}";
  milter = yes;
  timeout = 120s;
  count = 1;
  upstream "local" {{ default = yes; self_scan = yes; }}
  spam_header = "X-Spam";
  reject_message = "Spam message rejected";
  discard_on_reject = false;
  quarantine_on_reject = false;
}}
{extra}
"""


def start_rspamd(
    workdir: str,
    *,
    port: int | None = None,
    reject: float = 15,
    add_header: float = 6,
    greylist: float = 4,
    extra_config: str = "",
    timeout_s: float = 30.0,
) -> Rspamd:
    """Start ``rspamd -f`` with its proxy worker in milter mode on ``127.0.0.1:PORT`` (default: a free
    port), all its files under ``workdir`` (created; ``rspamd.conf``, ``db/``, ``run/``, ``log/rspamd.log``,
    ``rspamd.out``). ``reject``, ``add_header``, ``greylist``: the action thresholds (score; rspamd's
    defaults). ``extra_config``: more UCL appended to rspamd.conf. Returns once the proxy worker answers an
    option negotiation (~0.5 s idle, a few s on a loaded machine); RuntimeError after ``timeout_s`` seconds
    or if rspamd exits, after stopping it. Run as root, rspamd runs as ``_rspamd`` (``-u``/``-g``)."""
    workdir, dirs = _rspamd_dirs(workdir)
    port = port or free_port()
    config = os.path.join(workdir, "rspamd.conf")
    with open(config, "w", encoding="utf-8") as f:
        f.write(_RSPAMD_CONF.format(dir=workdir, db=dirs["DBDIR"], run=dirs["RUNDIR"], log=dirs["log"], port=port,
                                    dns_port=_closed_port(), reject=reject, add_header=add_header,
                                    greylist=greylist, extra=extra_config))
    # $CONFDIR/$LOCAL_CONFDIR point at the work directory: no /etc/rspamd file is read
    return _launch_rspamd(workdir, config, {"CONFDIR": workdir, "LOCAL_CONFDIR": workdir}, dirs, port, timeout_s)


# What start_rspamd_distribution adds to a newcomer's local.d files, at the highest priority (override.d):
# its own port, no normal/controller workers (fixed ports 11333/11334), DNS to a closed loopback port, the
# short TLD list, no languages, no hyperscan (its helper would compile the rules for tens of CPU seconds).
_OVERRIDES = {
    "override.d/worker-proxy.inc": 'bind_socket = "127.0.0.1:{port}";\n',
    "override.d/worker-normal.inc": "enabled = false;\n",
    "override.d/worker-controller.inc": "enabled = false;\n",
    "override.d/options.inc": 'url_tld = "{dir}/tld.dat";\ndisable_hyperscan = true;\n'
                              'dns {{ nameserver = ["127.0.0.1:{dns_port}"]; timeout = 0.1s; retransmits = 1; }}\n',
    "rspamd.conf.local": 'lang_detection {{ languages = "{dir}/languages"; }}\n',
}


def start_rspamd_distribution(
    workdir: str, local_d: Mapping[str, str], *, port: int | None = None, timeout_s: float = 60.0
) -> Rspamd:
    """Start ``rspamd -f`` on the distribution's own configuration (``/etc/rspamd/rspamd.conf``, every
    module it enables) with ``local_d`` (file name -> text) as ``$LOCAL_CONFDIR/local.d/``: what an
    administrator writes into ``/etc/rspamd/local.d/`` (README "Filtering with rspamd"). The fixture's own
    changes are in ``override.d`` (``_OVERRIDES``): the proxy on ``127.0.0.1:PORT``, no other workers, no
    network. Its milter answers what the distribution's rules make of a message; DNS-based rules fail fast.
    Files, return and errors as :func:`start_rspamd` (start: a few seconds)."""
    workdir, dirs = _rspamd_dirs(workdir)
    port = port or free_port()
    local = os.path.join(workdir, "local")
    values = {"port": port, "dir": workdir, "dns_port": _closed_port()}
    files = {**{f"local.d/{name}": text for name, text in local_d.items()},
             **{name: text.format(**values) for name, text in _OVERRIDES.items()}}
    for name, text in files.items():
        path = os.path.join(local, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    config = os.path.join(_DISTRIBUTION_CONFDIR, "rspamd.conf")
    return _launch_rspamd(workdir, config, {"LOCAL_CONFDIR": local}, dirs, port, timeout_s)


_DISTRIBUTION_CONFDIR = "/etc/rspamd"


def _rspamd_dirs(workdir: str) -> tuple[str, dict[str, str]]:
    """Make ``workdir`` and its ``db/``, ``run/``, ``log/`` (owned by rspamd's user when root), an empty
    ``languages/`` (loading rspamd's 46 takes seconds) and a 5-suffix ``tld.dat``. Returns the absolute
    work directory and {DBDIR, RUNDIR, LOGDIR: paths, log: the log file}."""
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    user = _system_user("_rspamd", "rspamd") if os.geteuid() == 0 else None
    if user is not None:
        mail_owner_ready(workdir)  # its workers reach their directories (o+x on the 0700 pytest parents)
    dirs = {var: _owned(os.path.join(workdir, name), user) for var, name in
            (("DBDIR", "db"), ("RUNDIR", "run"), ("LOGDIR", "log"))}
    dirs["log"] = os.path.join(dirs["LOGDIR"], "rspamd.log")
    os.makedirs(os.path.join(workdir, "languages"), exist_ok=True)
    with open(os.path.join(workdir, "tld.dat"), "w", encoding="ascii") as f:
        f.write("com\nnet\norg\ntest\nexample\n")
    return workdir, dirs


def _launch_rspamd(
    workdir: str, config: str, variables: Mapping[str, str], dirs: Mapping[str, str], port: int, timeout_s: float
) -> Rspamd:
    args = [_program("rspamd"), "-f", "-c", config]
    for var, value in {**variables, "DBDIR": dirs["DBDIR"], "RUNDIR": dirs["RUNDIR"], "LOGDIR": dirs["LOGDIR"]}.items():
        args += ["--var", f"{var}={value}"]
    if os.geteuid() == 0:
        user = _system_user("_rspamd", "rspamd")
        args += ["-u", user.pw_name, "-g", _group_name(user)]
    log_path = os.path.join(workdir, "rspamd.out")
    started = time.monotonic()
    with open(log_path, "ab") as out:
        p = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=workdir)
    f_ = Rspamd("rspamd", p, "127.0.0.1", port, log_path, 0.0, dirs["log"], config_path=config)
    try:
        wait_milter("127.0.0.1", port, p, timeout_s, log=dirs["log"])
    except BaseException:
        f_.kill9()
        raise
    f_.start_s = time.monotonic() - started
    return f_


def _group_name(user: pwd.struct_passwd) -> str:
    import grp

    return grp.getgrgid(user.pw_gid).gr_name


def _closed_port() -> int:
    """A UDP port on 127.0.0.1 nothing listened on a moment ago (DNS queries to it fail at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_opendkim(
    workdir: str,
    *,
    domain: str = "example.test",
    selector: str = "mtaq",
    port: int | None = None,
    internal_hosts: Sequence[str] = ("127.0.0.1", "::1"),
    extra_config: str = "",
    timeout_s: float = 15.0,
) -> OpenDkim:
    """Start ``opendkim -f`` in sign mode for ``domain``/``selector`` with a new 2048-bit RSA key, on
    ``inet:PORT@127.0.0.1`` (default: a free port), its files under ``workdir`` (``opendkim.conf``, the key
    ``SELECTOR.DOMAIN.pem`` mode 0600, ``internal-hosts``, ``opendkim.out``).

    It signs (relaxed/simple, rsa-sha256) the mail of a client whose address (the milter connect step's)
    is in ``internal_hosts`` (OpenDKIM's ``InternalHosts``; its default 127.0.0.1 here; () for none) or that
    authenticated (the ``{auth_type}`` macro). ``extra_config``: more opendkim.conf lines. Returns once it
    answers an option negotiation; RuntimeError after ``timeout_s`` seconds or if it exits, after stopping
    it. Run as root, it runs as ``opendkim`` (``UserID``)."""
    program = _program("opendkim")
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    root = os.geteuid() == 0
    user = _system_user("opendkim") if root else None
    pem, txt = _rsa_key()
    key_file = os.path.join(workdir, f"{selector}.{domain}.pem")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    hosts_file = os.path.join(workdir, "internal-hosts")
    with open(hosts_file, "w", encoding="ascii") as f:
        # An empty data set would leave OpenDKIM's default (127.0.0.1): "none" is a TEST-NET-1 address.
        f.write("\n".join(internal_hosts or ["192.0.2.255"]) + "\n")
    if user is not None:
        os.chown(key_file, user.pw_uid, user.pw_gid)
        mail_owner_ready(workdir)
    port = port or free_port()
    config = os.path.join(workdir, "opendkim.conf")
    lines = [
        "Syslog no",
        "Mode s",
        f"Domain {domain}",
        f"Selector {selector}",
        f"KeyFile {key_file}",
        f"Socket inet:{port}@127.0.0.1",
        "Canonicalization relaxed/simple",
        "SignatureAlgorithm rsa-sha256",
        f"InternalHosts {hosts_file}",
        # The key is under /tmp (world-writable): OpenDKIM refuses such a key path unless told not to check.
        "RequireSafeKeys no",
    ]
    if user is not None:
        lines.append(f"UserID {user.pw_name}:{_group_name(user)}")
    with open(config, "w", encoding="ascii") as f:
        f.write("\n".join(lines) + "\n" + extra_config + "\n")
    log_path = os.path.join(workdir, "opendkim.out")
    started = time.monotonic()
    with open(log_path, "ab") as out:
        p = subprocess.Popen([program, "-f", "-x", config], stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                             cwd=workdir)
    f_ = OpenDkim("opendkim", p, "127.0.0.1", port, log_path, 0.0, domain=domain, selector=selector,
                  key_file=key_file, dns_txt=txt, zone_line=_zone_line(domain, selector, txt), config_path=config)
    try:
        wait_milter("127.0.0.1", port, p, timeout_s, log=log_path)
    except BaseException:
        f_.kill9()
        raise
    f_.start_s = time.monotonic() - started
    return f_


def _rsa_key(bits: int = 2048) -> tuple[bytes, str]:
    """A new RSA private key as PKCS#8 PEM, and its DKIM TXT record value ``v=DKIM1; k=rsa; p=BASE64``, p= the
    DER SubjectPublicKeyInfo (RFC 6376 §3.6.1; as ``mtaq dkim keygen``, which testing may not import)."""
    import base64

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem, f"v=DKIM1; k=rsa; p={base64.b64encode(spki).decode('ascii')}"


def _zone_line(domain: str, selector: str, value: str) -> str:
    """``SELECTOR._domainkey.DOMAIN. IN TXT "..." ...``: ``value`` in strings of at most 255 bytes (RFC 1035
    §3.3; a verifier joins them, RFC 6376 §3.6.2.2)."""
    parts = [value[i : i + 255] for i in range(0, len(value), 255)]
    return f"{selector}._domainkey.{domain.rstrip('.')}. IN TXT " + " ".join(f'"{p}"' for p in parts)
