"""Issue 33.1: contrib/systemd/mtaq.service and ``make install-service``.

PID 1 is not systemd on the test machine, so the unit cannot be started for real. What is checked instead:
``make install-service`` staged under a DESTDIR (the files it lays out, and that it overwrites no existing
configuration or sendmail); ``systemd-analyze verify`` of the staged unit (its syntax, and that ExecStart=
names an executable); ``systemd-analyze security --offline=true`` (the exposure score, at most 2.5 "OK");
and the unit's ExecStart= line run as its User= with what systemd would give it: the ambient
CAP_NET_BIND_SERVICE and that bounding set, NoNewPrivileges=, UMask=, LimitNOFILE=, MemoryDenyWriteExecute=
(prctl PR_SET_MDWE, the kernel's own version of it), SystemCallFilter= and RestrictAddressFamilies= (a
seccomp filter of the same system calls, made with libseccomp), ProtectSystem=strict (a mount namespace
with everything read-only but the spool) and the StateDirectory= spool (owned by User=, mode
StateDirectoryMode=). ProtectHome=, PrivateTmp=, PrivateDevices=, ProtectProc=..., Restart= and KillSignal=
need systemd as PID 1: not checked here.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import smtplib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mtaq.config import load_config
from mtaq.daemon.process import open_files_needed
from mtaq.testing.procs import children, low_free_port, maildir_count, proc_status, start_sink, wait_for, wait_port

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "contrib" / "systemd" / "mtaq.service"
DEFAULT_CONFIG = ROOT / "contrib" / "systemd" / "mtaq.toml"
EXPOSURE_MAX = 2.5

needs_systemd_analyze = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="installs and switches users as root")


def _service(path: Path) -> dict[str, list[str]]:
    """The [Service] section of a unit file: each key's values in order (SystemCallFilter= may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def _install(destdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "install-service", f"DESTDIR={destdir}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _staged(tmp_path: Path) -> Path:
    """``make install-service`` into DESTDIR=tmp_path/root, with the virtual environment's mtaq already there
    (pip is not run), and the host's systemd units copied in (verify --root needs sysinit.target...)."""
    root = tmp_path / "root"
    venv_mtaq = root / "opt" / "mtaq" / "bin" / "mtaq"
    venv_mtaq.parent.mkdir(parents=True)
    shutil.copy(shutil.which("mtaq") or os.path.join(os.path.dirname(sys.executable), "mtaq"), venv_mtaq)
    shutil.copytree("/usr/lib/systemd/system", root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    out = _install(root)
    assert (0, "") == (out.returncode, out.stderr)
    return root


@needs_root
@needs_systemd_analyze
def test_make_install_service_lays_out_a_unit_that_systemd_analyze_verify_accepts(tmp_path: Path) -> None:
    root = _staged(tmp_path)
    assert UNIT.read_text() == (root / "etc/systemd/system/mtaq.service").read_text()
    assert DEFAULT_CONFIG.read_text() == (root / "etc/mtaq/mtaq.toml").read_text()
    assert "/opt/mtaq/bin/mtaq" == os.readlink(root / "usr/sbin/sendmail")
    out = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "mtaq.service"], capture_output=True,
                         text=True, timeout=60)
    assert (0, "", "") == (out.returncode, out.stdout, out.stderr)
    # verify does look: without the executable ExecStart= (and ExecReload=) names, it fails.
    (root / "opt/mtaq/bin/mtaq").unlink()
    out = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "mtaq.service"], capture_output=True,
                         text=True, timeout=60)
    assert (1, ["mtaq.service: Command /opt/mtaq/bin/mtaq is not executable: No such file or directory"] * 2) == (
        out.returncode, out.stderr.strip().splitlines())


@needs_root
def test_make_install_service_keeps_an_existing_configuration_and_sendmail(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "opt/mtaq/bin").mkdir(parents=True)
    (root / "opt/mtaq/bin/mtaq").write_text("#!/bin/sh\n")
    (root / "opt/mtaq/bin/mtaq").chmod(0o755)
    (root / "etc/mtaq").mkdir(parents=True)
    (root / "etc/mtaq/mtaq.toml").write_text('listen = "127.0.0.1:25"\n')
    (root / "usr/sbin").mkdir(parents=True)
    (root / "usr/sbin/sendmail").symlink_to("/usr/lib/sm.bin/sendmail")
    out = _install(root)
    assert (0, "") == (out.returncode, out.stderr)
    assert 'listen = "127.0.0.1:25"\n' == (root / "etc/mtaq/mtaq.toml").read_text()
    assert "/usr/lib/sm.bin/sendmail" == os.readlink(root / "usr/sbin/sendmail")


@needs_systemd_analyze
def test_systemd_analyze_security_exposure_is_ok() -> None:
    """``systemd-analyze security --offline=true contrib/systemd/mtaq.service``: 1.6 with systemd 252."""
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)], capture_output=True,
                         text=True, timeout=60)
    m = re.search(r"Overall exposure level for mtaq\.service: ([0-9.]+) (\w+)", out.stdout)
    assert m is not None, out.stdout + out.stderr
    print(f"systemd-analyze security: exposure {m.group(1)} {m.group(2)}")
    assert (True, "OK") == (float(m.group(1)) <= EXPOSURE_MAX, m.group(2))


def test_limit_nofile_covers_what_the_default_configuration_needs() -> None:
    limit = int(_service(UNIT)["LimitNOFILE"][-1])
    needed = open_files_needed(load_config(str(DEFAULT_CONFIG), {}))
    assert (True, 684) == (limit >= needed, needed)


def _syscalls(unit: dict[str, list[str]]) -> list[str]:
    """The system calls SystemCallFilter= lines allow, groups expanded as ``systemd-analyze syscall-filter``
    lists them (an allow list, then ``~`` lines taking calls out of it)."""
    groups: dict[str, list[str]] = {}
    name = ""
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, timeout=60)
    for line in out.stdout.splitlines():
        if line.startswith("@"):
            name = line.strip()
            groups[name] = []
        elif line.strip() and not line.strip().startswith("#") and name:
            groups[name].append(line.strip())

    def expand(item: str) -> set[str]:
        return set().union(*(expand(i) for i in groups[item])) if item.startswith("@") else {item}

    allowed: set[str] = set()
    for value in unit["SystemCallFilter"]:
        deny = value.startswith("~")
        items = set().union(*(expand(i) for i in value.lstrip("~").split()))
        allowed = allowed - items if deny else allowed | items
    return sorted(allowed)


# What systemd does between fork and exec after the switch to User= (setpriv): MemoryDenyWriteExecute= as the
# kernel offers it (Linux 6.3+: prctl PR_SET_MDWE, kept across execve), UMask=, SystemCallFilter= and
# RestrictAddressFamilies= (a seccomp filter made with libseccomp: any other call, and socket() of another
# family, fails with EPERM; systemd's socket() fails with EAFNOSUPPORT, glibc's getaddrinfo takes either
# failure of its netlink socket as "IPv4 and IPv6 both there"), and
# SystemCallArchitectures=native (the filter has only the native architecture). Then exec the rest of argv.
_SANDBOX_EXEC = r"""
import ctypes, os, sys
umask, allowed, families, argv = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:
    sys.exit("PR_SET_MDWE: errno %d" % ctypes.get_errno())
os.umask(int(umask, 8))
sc = ctypes.CDLL("libseccomp.so.2")
sc.seccomp_init.restype = ctypes.c_void_p
sc.seccomp_init.argtypes = [ctypes.c_uint32]
sc.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
sc.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                      ctypes.POINTER(Cmp)]
sc.seccomp_load.argtypes = [ctypes.c_void_p]
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
ctx = sc.seccomp_init(ERRNO | 1)
sock = sc.seccomp_syscall_resolve_name(b"socket")
for name in allowed:
    nr = sc.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0 and nr != sock:
        assert sc.seccomp_rule_add_array(ctx, ALLOW, nr, 0, None) == 0, name
for family in families:
    assert sc.seccomp_rule_add_array(ctx, ALLOW, sock, 1, (Cmp * 1)(Cmp(0, 4, int(family), 0))) == 0
if sc.seccomp_load(ctx) != 0:
    sys.exit("seccomp_load failed")
os.execvp(argv[0], argv)
"""
FAMILIES = {"AF_UNIX": socket.AF_UNIX, "AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6}

# ProtectSystem=strict with the StateDirectory= writable, in a private mount namespace (unshare): every mount
# but /proc, /sys and /dev made read-only, then the spool ($1) bound onto itself read-write; /tmp stays
# read-only too (stricter than PrivateTmp=, whose empty /tmp would hide the test's spool). Then exec the rest.
_PROTECT_SYSTEM_STRICT = r"""
for m in $(awk '{print $5}' /proc/self/mountinfo | grep -v -E '^/(proc|sys|dev)(/|$)' | sort -u); do
  mount -o remount,bind,ro "$m" || exit 1
done
mount --bind "$1" "$1" && mount -o remount,bind,rw "$1" || exit 1
shift
exec "$@"
"""


@needs_root
@pytest.mark.skipif(not (shutil.which("setpriv") and shutil.which("prlimit")), reason="needs util-linux")
def test_the_units_execstart_run_as_its_user_relays_a_message(tmp_path: Path) -> None:
    """The unit's ExecStart= (its entry point /opt/mtaq/bin/mtaq replaced by this Python's ``-m mtaq.cli``,
    its configuration by the shipped default with the spool, the address and the next hop of the test) run
    as User=/Group= with the capabilities, limits and flags systemd would set (setpriv, prlimit, prctl,
    seccomp, a read-only mount namespace): it
    binds a port below 1024, relays a message to a sink (and one that a local user, nobody, gave to
    ``mtaq sendmail`` with the same configuration), its ExecReload= (``systemctl reload``) run the same way
    reloads every worker, and every process of it is the user's, with CAP_NET_BIND_SERVICE and nothing else."""
    unit = _service(UNIT)
    argv = shlex.split(unit["ExecStart"][-1])
    assert ["/opt/mtaq/bin/mtaq", "serve", "--config", "/etc/mtaq/mtaq.toml"] == argv
    assert (["mtaq"], ["mtaq"]) == (unit["User"], unit["Group"])
    assert (["CAP_NET_BIND_SERVICE"], ["CAP_NET_BIND_SERVICE"]) == (
        unit["AmbientCapabilities"], unit["CapabilityBoundingSet"])
    pw = pwd.getpwnam(unit["User"][-1])
    # StateDirectory=mtaq with StateDirectoryMode=0711: the spool of the shipped configuration, the user's.
    assert (["mtaq"], ["0711"]) == (unit["StateDirectory"], unit["StateDirectoryMode"])
    spool = tmp_path / "var-lib-mtaq"
    spool.mkdir()
    spool.chmod(int(unit["StateDirectoryMode"][-1], 8))
    os.chown(spool, pw.pw_uid, pw.pw_gid)
    tmp_path.chmod(0o755)
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    port = low_free_port(range(999, 600, -1))
    text = DEFAULT_CONFIG.read_text()
    for key, shipped, test in [("spool_dir", "/var/lib/mtaq", str(spool)),
                               ("listen", "0.0.0.0:25", f"127.0.0.1:{port}"),
                               ("relayhost", "", f"[127.0.0.1]:{sink.port}")]:
        text, n = re.subn(rf'^{key} = "{re.escape(shipped)}"$', f'{key} = "{test}"', text, flags=re.M)
        assert (key, 1) == (key, n)
    config = tmp_path / "mtaq.toml"
    config.write_text(text + 'admin_listen = "127.0.0.1:0"\nworkers = 2\n')
    config.chmod(0o644)
    nofile = unit["LimitNOFILE"][-1]
    assert (["yes"], ["native"], ["yes"]) == (
        unit["NoNewPrivileges"], unit["SystemCallArchitectures"], unit["MemoryDenyWriteExecute"])
    families = [str(int(FAMILIES[f])) for f in unit["RestrictAddressFamilies"][-1].split()]
    assert (["strict"], ["yes"]) == (unit["ProtectSystem"], unit["PrivateTmp"])
    wrapper = ["prlimit", f"--nofile={nofile}:{nofile}", "--",
               "unshare", "--mount", "--propagation", "private", "sh", "-c", _PROTECT_SYSTEM_STRICT, "sh", str(spool),
               "setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
               "--inh-caps=-all,+net_bind_service", "--ambient-caps=-all,+net_bind_service",
               "--bounding-set=-all,+net_bind_service", "--no-new-privs",
               sys.executable, "-c", _SANDBOX_EXEC, unit["UMask"][-1], ",".join(_syscalls(unit)), ",".join(families)]
    # The sandbox bites: a file outside the spool, a netlink socket, setpriority (@resources), a W+X mapping are refused.
    probe = ("import errno, mmap, os, socket\n"
             f"try: open({str(tmp_path / 'outside-the-spool')!r}, 'w')\n"
             "except OSError as e: print(errno.errorcode[e.errno])\n"
             "try: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)\n"
             "except OSError as e: print(errno.errorcode[e.errno])\n"
             "try: os.setpriority(os.PRIO_PROCESS, 0, 5)\n"
             "except OSError as e: print(errno.errorcode[e.errno])\n"
             "try: mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
             "except OSError as e: print(errno.errorcode[e.errno])\n")
    out = subprocess.run([*wrapper, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert (0, ["EROFS", "EPERM", "EPERM", "EACCES"], "") == (out.returncode, out.stdout.split(), out.stderr)
    command = [*wrapper, sys.executable, "-m", "mtaq.cli", *argv[1:3], str(config)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with open(tmp_path / "daemon.log", "ab") as log:
        p = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
    try:
        wait_port(port, 30, proc=p)
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
            c.sendmail("a@client.test", ["b@dest.test"], b"Subject: t\r\n\r\nbody\r\n")
        wait_for(lambda: maildir_count(str(tmp_path / "maildir")) == 1, 20, "the relayed message")
        # A local user's sendmail reaches the maildrop through the StateDirectoryMode= spool.
        nobody = pwd.getpwnam("nobody")
        out = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                              sys.executable, "-m", "mtaq.cli", "sendmail", "-C", str(config), "b@dest.test"],
                             input=b"Subject: from cron\n\nbody\n", capture_output=True, timeout=30, env=env)
        assert (0, b"") == (out.returncode, out.stderr)
        wait_for(lambda: maildir_count(str(tmp_path / "maildir")) == 2, 20, "the message from sendmail")
        # systemctl reload: the unit's ExecReload= run as its user in the same sandbox; every worker reloads.
        reload_argv = shlex.split(unit["ExecReload"][-1])
        assert ["/opt/mtaq/bin/mtaq", "reload", "--config", "/etc/mtaq/mtaq.toml"] == reload_argv
        out = subprocess.run([*wrapper, sys.executable, "-m", "mtaq.cli", *reload_argv[1:3], str(config)],
                             capture_output=True, text=True, timeout=60, env=env)
        assert (0, "worker 0: reloaded; changed: no key (files read again)\n"
                   "worker 1: reloaded; changed: no key (files read again)\n", "") == (out.returncode, out.stdout, out.stderr)
        procs = [p.pid, *children(p.pid)]
        assert 3 == len(procs)  # the supervisor and its 2 workers
        for pid in procs:
            st = proc_status(pid)
            assert ([str(pw.pw_uid)] * 4, [str(pw.pw_gid)] * 4, "0000000000000400", "0000000000000400", "1", "2") == (
                st["Uid"], st["Gid"], st["CapEff"][0], st["CapBnd"][0], st["NoNewPrivs"][0], st["Seccomp"][0])
        assert (pw.pw_uid, 0o711) == (spool.stat().st_uid, spool.stat().st_mode & 0o777)
    finally:
        for pid in [*children(p.pid)] if p.poll() is None else []:
            os.kill(pid, 9)
        p.kill()
        p.wait()
        sink.kill9()


README_KILL = """kill -9 "$(python3 -c 'import json; print(json.load(open("spool/admin.json"))["pid"])')\""""


@pytest.mark.parametrize("workers", [1, 2])
def test_the_readmes_kill_line_for_a_checkout_stops_that_daemon_alone(tmp_path: Path, workers: int) -> None:
    """README, "Send a first message": ``kill -9`` of the pid in ``SPOOL/admin.json`` (a worker with several:
    the supervisor then SIGKILLs the others and exits), instead of ``pkill -9 -f "mtaq serve"``, which kills
    every mtaq of the host. A second daemon on another spool lives on."""
    assert True is (README_KILL in (ROOT / "README.md").read_text())
    from mtaq.testing.procs import start_daemon

    (tmp_path / "other").mkdir()
    ours = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "ours.log"), workers=workers)
    other = start_daemon(str(tmp_path / "other" / "spool"), None, str(tmp_path / "other.log"), workers=workers)
    try:
        kids = ours.children()
        out = subprocess.run(["sh", "-c", README_KILL], cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert (0, "") == (out.returncode, out.stderr)
        ours.popen.wait(timeout=20)
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in kids), 20, "its workers gone")
        assert (True, workers if workers > 1 else 0) == (other.alive(), len(other.children()))
    finally:
        ours.kill9()
        other.kill9()
