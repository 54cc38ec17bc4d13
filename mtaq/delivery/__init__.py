"""Outbound SMTP (aiosmtplib): per-recipient final replies from the next hop.

Routing (transport map, relayhost, MX by dnspython: :mod:`~mtaq.delivery.routing`), one connection and its
replies (:mod:`~mtaq.delivery.relay`), one attempt over a message's recipients with fail-over
(:mod:`~mtaq.delivery.transport`) and per-destination throttling (:mod:`~mtaq.delivery.throttle`);
recipient verification at RCPT by probing the next hop (:mod:`~mtaq.delivery.verify`). DANE
(:mod:`~mtaq.delivery.dane`) and MTA-STS (:mod:`~mtaq.delivery.mtasts`) are built and tested but not called yet.

May import :mod:`mtaq.core`, :mod:`mtaq.config` and :mod:`mtaq.logs`; never the log or the queue (outcomes
go back to the queue through the daemon), the edge, administration or the daemon's wiring.
Nothing is imported here.
"""
