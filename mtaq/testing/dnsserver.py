"""A small authoritative DNS server for tests: it stands in for the internet's DNS, which tests cannot reach.

It answers UDP (and TCP) queries on 127.0.0.1 from one zone parsed by dnspython (``dns.zone``), with the
rules of an authoritative server (RFC 1034 §4.3.2, simplified): a name in the zone with records of the
asked type -> those records; a name in the zone without them -> NOERROR and no answer; a name not in the zone
-> NXDOMAIN; a name outside the zone -> REFUSED. ``servfail`` names get SERVFAIL, ``silent`` names get no
answer at all (the resolver times out). Nothing here is used by the daemon itself.

For DNSSEC tests it can play a validating resolver: answers about ``secure`` names (and their negative
answers) carry the AD bit when the query asked for it with DO or AD (RFC 6840 §5.7-5.8); nothing is signed.
A bogus answer is what a validating resolver turns into SERVFAIL (``servfail``). Zone records of any type
dnspython parses are served (TLSA, TXT, ...). ``flags`` lists (header flags, EDNS flags) of every query.
"""

from __future__ import annotations

import errno
import socket
import socketserver
import threading
from collections.abc import Iterable

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import dns.zone

__all__ = ["ZoneServer"]

_HEAD = """$TTL 60
@ IN SOA ns.{origin} hostmaster.{origin} 1 3600 600 86400 60
@ IN NS ns.{origin}
ns IN A 127.0.0.1
"""


PORT_TRIES = 20  # port numbers tried for a UDP+TCP pair


class ZoneServer:
    """Serve ``records`` (zone file lines, names relative to ``origin``) on 127.0.0.1, a random port.

    SOA and NS records are added. Use as a context manager, or call :meth:`start` / :meth:`stop`.
    ``queries`` lists (name, type) of every query seen, in order.
    """

    def __init__(
        self,
        records: str,
        origin: str = "test.",
        *,
        servfail: Iterable[str] = (),
        silent: Iterable[str] = (),
        secure: Iterable[str] = (),
    ) -> None:
        self.origin = dns.name.from_text(origin)
        text = _HEAD.format(origin=self.origin.to_text()) + records
        self.zone = dns.zone.from_text(text, origin=self.origin, relativize=False)
        self.servfail = {dns.name.from_text(n, self.origin) for n in servfail}
        self.silent = {dns.name.from_text(n, self.origin) for n in silent}
        self.secure = {dns.name.from_text(n, self.origin) for n in secure}
        self.queries: list[tuple[str, str]] = []
        self.flags: list[tuple[int, int]] = []
        self._udp: socketserver.UDPServer | None = None
        self._tcp: socketserver.TCPServer | None = None
        self.port = 0

    def answer(self, wire: bytes) -> bytes | None:
        """The response to the query ``wire`` (None: stay silent)."""
        q = dns.message.from_wire(wire)
        resp = dns.message.make_response(q)
        resp.flags |= dns.flags.AA
        if not q.question:
            resp.set_rcode(dns.rcode.FORMERR)
            return resp.to_wire()
        question = q.question[0]
        name, rdtype = question.name, question.rdtype
        self.queries.append((name.to_text(), dns.rdatatype.to_text(rdtype)))
        self.flags.append((int(q.flags), int(q.ednsflags)))
        if name in self.silent:
            return None
        if name in self.servfail:
            resp.set_rcode(dns.rcode.SERVFAIL)
        elif not name.is_subdomain(self.origin):
            resp.set_rcode(dns.rcode.REFUSED)
        else:
            node = self.zone.get_node(name)
            if node is None:
                resp.set_rcode(dns.rcode.NXDOMAIN)
            else:
                rds = node.get_rdataset(dns.rdataclass.IN, rdtype)
                if rds is not None:
                    resp.answer.append(dns.rrset.from_rdata_list(name, rds.ttl, list(rds)))
            if name in self.secure and (q.flags & dns.flags.AD or q.ednsflags & dns.flags.DO):
                resp.flags |= dns.flags.AD
        return resp.to_wire()

    def start(self) -> ZoneServer:
        server = self

        class Udp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data, sock = self.request
                out = server.answer(data)
                if out is not None:
                    sock.sendto(out, self.client_address)

        class Tcp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                conn: socket.socket = self.request
                head = conn.recv(2)
                if len(head) < 2:
                    return
                want = int.from_bytes(head, "big")
                data = b""
                while len(data) < want:
                    chunk = conn.recv(want - len(data))
                    if not chunk:
                        return
                    data += chunk
                out = server.answer(data)
                if out is not None:
                    conn.sendall(len(out).to_bytes(2, "big") + out)

        class TcpServer(socketserver.ThreadingTCPServer):
            allow_reuse_address = True

        # One port number for both: the UDP port the system picks may be taken for TCP (by another
        # listener or a connection's local port); then pick again.
        for attempt in range(PORT_TRIES):
            udp = socketserver.ThreadingUDPServer(("127.0.0.1", 0), Udp)
            self.port = int(udp.server_address[1])
            try:
                tcp = TcpServer(("127.0.0.1", self.port), Tcp)
                break
            except OSError as exc:
                udp.server_close()
                if exc.errno != errno.EADDRINUSE or attempt == PORT_TRIES - 1:
                    raise
        self._udp, self._tcp = udp, tcp
        for s in (udp, tcp):
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        for s in (self._udp, self._tcp):
            if s is not None:
                s.shutdown()
                s.server_close()

    def __enter__(self) -> ZoneServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
