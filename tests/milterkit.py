"""The MTA side of one milter conversation, for tests that check a filter without mtaq's milter client.

Built on PyPI ``miltertest`` (Paul Arthur's encoder/decoder of the Sendmail milter protocol, version 6):
an independent implementation, so a filter fixture proven with it does not lean on the code under test.
The steps follow Postfix's order (MILTER_README): option negotiation, connect, HELO, MAIL, RCPT, DATA,
headers, end of headers, body, end of message, with the macros Postfix sends at each step. A step the
filter asked not to get (``SMFIP_NO*``) is skipped; one it asked not to answer (``SMFIP_NR_*``) is sent
without waiting. The first reply other than continue ends the conversation (it is the verdict).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

import miltertest
from miltertest import constants as C

# What this side offers: every action; every step and no-reply bit, header values with their leading
# space (SMFIP_HDR_LEADSPC); not SMFIP_SKIP (the body is sent whole) nor SMFIP_RCPT_REJ.
PROTOCOL = C.SMFI_V6_PROT & ~(C.SMFIP_SKIP | C.SMFIP_RCPT_REJ)


@dataclass
class Outcome:
    """What the filter did: ``stage`` is the step whose reply ended the conversation (``"connect"``,
    ``"helo"``, ``"mail"``, ``"rcpt"``, ``"data"``, ``"header"``, ``"eoh"``, ``"body"``, ``"eom"``),
    ``verdict`` that reply as (command, fields) from miltertest (``("a", {})`` accept, ``("y",
    {"smtpcode": "554", "text": "5.7.1 ..."})`` a reply code, ...), ``modifications`` the end-of-message
    actions before it (``("h", {"name": ..., "value": ...})`` add header, ``("i", ...)`` insert,
    ``("m", {"index": ..., ...})`` change, ...), ``protocol`` the bits the filter negotiated."""

    stage: str
    verdict: tuple[str, dict]
    modifications: list[tuple[str, dict]] = field(default_factory=list)
    protocol: int = 0
    actions: int = 0

    def added_headers(self) -> dict[str, str]:
        """Header name -> value of every add/insert/change modification (a change of a field the message
        does not have adds it, as in Sendmail's smfi_chgheader)."""
        return {m[1]["name"]: m[1]["value"] for m in self.modifications if m[0] in ("h", "i", "m")}


def converse(
    address: str,
    *,
    headers: list[tuple[str, str]],
    body: bytes,
    client_addr: str = "192.0.2.10",
    client_name: str = "client.example.org",
    helo: str = "client.example.org",
    mail_from: str = "alice@example.test",
    rcpts: tuple[str, ...] = ("bob@example.net",),
    auth_authen: str = "",
    auth_type: str = "PLAIN",
    queue_id: str = "4A1B2C3D",
    timeout_s: float = 15.0,
) -> Outcome:
    """Run one message through the milter at ``address`` (``inet:HOST:PORT``) as Postfix's smtpd would.
    ``headers``: (name, value) in order, values without the space after the colon. ``auth_authen``: the
    SASL login, sent with ``{auth_type}`` (``auth_type``, "" for none) in the MAIL step's macros ("" for an
    anonymous client)."""
    _, host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        c = miltertest.MilterConnection(s)
        actions, protocol = c.optneg_mta(C.SMFI_V6_ACTS, PROTOCOL)
        lead = " " if protocol & C.SMFIP_HDR_LEADSPC else ""

        def step(stage: str, cmd: str, no: int, nr: int, **kw) -> Outcome | None:
            if protocol & no:
                return None
            if protocol & nr:
                c._send(cmd, **kw)
                return None
            reply = c.send_ar(cmd, **kw)
            if reply[0] != C.SMFIR_CONTINUE:
                return Outcome(stage, reply, [], protocol, actions)
            return None

        family = C.SMFIA_INET6 if ":" in client_addr else C.SMFIA_INET
        c.send_macro(C.SMFIC_CONNECT, **{"j": "mx.example.test", "{daemon_name}": "mtaq", "{client_addr}": client_addr,
                                         "{client_name}": client_name})
        steps = [
            ("connect", C.SMFIC_CONNECT, C.SMFIP_NOCONNECT, C.SMFIP_NR_CONN,
             {"hostname": client_name, "family": family, "port": 40000, "address": client_addr}),
            ("helo", C.SMFIC_HELO, C.SMFIP_NOHELO, C.SMFIP_NR_HELO, {"helo": helo}),
        ]
        for stage, cmd, no, nr, kw in steps:
            if (out := step(stage, cmd, no, nr, **kw)) is not None:
                return out
        mail_macros = {"{mail_addr}": mail_from, "i": queue_id}
        if auth_authen:
            mail_macros["{auth_authen}"] = auth_authen
            if auth_type:
                mail_macros["{auth_type}"] = auth_type
        c.send_macro(C.SMFIC_MAIL, **mail_macros)
        if (out := step("mail", C.SMFIC_MAIL, C.SMFIP_NOMAIL, C.SMFIP_NR_MAIL, args=[f"<{mail_from}>"])) is not None:
            return out
        for rcpt in rcpts:
            c.send_macro(C.SMFIC_RCPT, **{"{rcpt_addr}": rcpt})
            if (out := step("rcpt", C.SMFIC_RCPT, C.SMFIP_NORCPT, C.SMFIP_NR_RCPT, args=[f"<{rcpt}>"])) is not None:
                return out
        if (out := step("data", C.SMFIC_DATA, C.SMFIP_NODATA, C.SMFIP_NR_DATA)) is not None:
            return out
        for name, value in headers:
            if (out := step("header", C.SMFIC_HEADER, C.SMFIP_NOHDRS, C.SMFIP_NR_HDR, name=name,
                            value=lead + value)) is not None:
                return out
        if (out := step("eoh", C.SMFIC_EOH, C.SMFIP_NOEOH, C.SMFIP_NR_EOH)) is not None:
            return out
        if not protocol & C.SMFIP_NOBODY:
            for start in range(0, len(body), C.MILTER_CHUNK_SIZE):
                # The body as bytes (miltertest's encoder takes str): length, 'B', the chunk.
                chunk = body[start : start + C.MILTER_CHUNK_SIZE]
                s.sendall(struct.pack("!Ic", len(chunk) + 1, b"B") + chunk)
                if not protocol & C.SMFIP_NR_BODY:
                    reply = c.recv()
                    if reply[0] != C.SMFIR_CONTINUE:
                        return Outcome("body", reply, [], protocol, actions)
        replies = c.send_eom()
        c._send(C.SMFIC_QUIT)
        return Outcome("eom", replies[-1], replies[:-1], protocol, actions)
