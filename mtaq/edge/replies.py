"""Enhanced status codes (RFC 2034, RFC 3463) for every reply of the SMTP server.

mtaq advertises ENHANCEDSTATUSCODES, so every 2xx, 4xx and 5xx reply must carry an enhanced code, except
the greeting and the replies to HELO and EHLO (RFC 2034 §3). Most of aiosmtpd's own replies have none;
:func:`enhance` adds it, from a table of aiosmtpd 1.4's reply texts (with the wording Postfix uses where
aiosmtpd's would mislead), and otherwise from the reply class (``X.0.0``, RFC 3463 §3.1). A reply that
already has a code is left as it is.

Must always hold: the basic code is never changed, except for aiosmtpd's ``502`` on the 5th unknown
command, after which it closes the connection: that is a ``421 4.7.0`` (RFC 5321 §3.8).
"""

from __future__ import annotations

import re

__all__ = ["enhance", "has_enhanced_code", "reply_code"]

_ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3}(?: |$)")

# aiosmtpd's reply (exactly, or a prefix ending in a space or colon) -> the reply mtaq sends.
_EXACT = {
    "250 OK": "250 2.0.0 Ok",
    "221 Bye": "221 2.0.0 Bye",
    "500 Error: bad syntax": "500 5.5.2 Error: bad syntax",
    "500 Command line too long": "500 5.5.2 Error: command line too long",
    "503 Error: send HELO first": "503 5.5.1 Error: send HELO/EHLO first",
    "503 Error: send EHLO first": "503 5.5.1 Error: send EHLO first",
    "503 Error: nested MAIL command": "503 5.5.1 Error: nested MAIL command",
    "503 Error: need MAIL command": "503 5.5.1 Error: need MAIL command",
    "503 Error: need RCPT command": "503 5.5.1 Error: need RCPT command",
    "503 Already authenticated": "503 5.5.1 Error: already authenticated",
    "502 EXPN not implemented": "502 5.5.1 Error: EXPN not implemented",
    "454 TLS not available": "454 4.7.0 TLS not available",
    "220 Ready to start TLS": "220 2.0.0 Ready to start TLS",
    "530 Must issue a STARTTLS command first": "530 5.7.0 Must issue a STARTTLS command first",
    "554 Command refused due to lack of security": "554 5.7.0 Command refused due to lack of security",
    "552 Error: message size exceeds fixed maximum message size":
        "552 5.3.4 Error: message size exceeds fixed maximum message size",
    "555 MAIL FROM parameters not recognized or not implemented":
        "555 5.5.4 Error: MAIL FROM parameters not recognized or not implemented",
    "555 RCPT TO parameters not recognized or not implemented":
        "555 5.5.4 Error: RCPT TO parameters not recognized or not implemented",
    "502 5.5.1 Too many unrecognized commands, goodbye.": "421 4.7.0 Error: too many unrecognized commands",
}
# By basic code, for replies not in the table (RFC 3463 §3: X.5.1 invalid command, X.5.2 syntax error,
# X.5.4 invalid command arguments, X.7.0 security; X.0.0 otherwise).
_BY_CODE = {500: "5.5.2", 501: "5.5.4", 502: "5.5.1", 503: "5.5.1", 504: "5.5.4", 530: "5.7.0", 535: "5.7.8",
            538: "5.7.11", 552: "5.3.4", 555: "5.5.4", 252: "2.0.0", 235: "2.7.0", 250: "2.0.0"}
# What a plain "250 OK" means after MAIL and after RCPT (RFC 3463 §3.2: X.1.0 / X.1.5).
_OK_AFTER = {"MAIL": "250 2.1.0 Ok", "RCPT": "250 2.1.5 Ok"}
# Replies that take no enhanced code (RFC 2034 §3): the greeting, and HELO/EHLO.
_RAW_VERBS = frozenset({"HELO", "EHLO"})


def reply_code(reply: str) -> int:
    """The basic reply code of ``reply`` (its first three digits), or 0 if it has none."""
    return int(reply[:3]) if len(reply) >= 3 and reply[:3].isdigit() else 0


def has_enhanced_code(reply: str) -> bool:
    """Whether ``reply`` already carries an enhanced status code after its basic code."""
    return _ENHANCED.match(reply) is not None


def enhance(reply: str, verb: str | None = None) -> str:
    """``reply`` with an enhanced status code; ``verb`` is the command it answers (None for the greeting
    or when unknown).

    Replies that must not carry a code (3xx, the 220 greeting, 250 to HELO/EHLO) come back unchanged.
    """
    code = reply_code(reply)
    if reply == "250 OK" and verb in _OK_AFTER:
        return _OK_AFTER[verb]
    if reply in _EXACT:
        return _EXACT[reply]
    if code == 0 or has_enhanced_code(reply) or 300 <= code < 400:
        return reply
    if (verb in _RAW_VERBS and code == 250) or (code == 220 and verb != "STARTTLS"):
        return reply
    if code == 500 and reply.startswith('500 Error: command "'):
        # aiosmtpd echoes the unknown command, raw: ESC, CR and the like back to the client. Postfix names
        # nothing of it (its "502 5.5.2 Error: command not recognized"); the basic code stays 500.
        return "500 5.5.2 Error: command not recognized"
    klass = code // 100
    if klass not in (2, 4, 5):
        return reply
    enhanced = _BY_CODE.get(code, f"{klass}.0.0")
    text = reply[4:] if len(reply) > 4 else ""
    return f"{code} {enhanced} {text}".rstrip()
