"""Inbound SMTP (aiosmtpd): validate, append, wait for the covering fsync, then reply.

The protocol (:mod:`~mtaq.edge.smtp`: DSN parameters, the DATA reader, relay control, AUTH), its policy
and limits, enhanced status codes, the password file and the ``Received`` header; :mod:`~mtaq.edge.server`
hands each message to the queue.

May import :mod:`mtaq.core`, :mod:`mtaq.queue`, :mod:`mtaq.config` and :mod:`mtaq.logs`; never delivery,
administration or the daemon's wiring. Nothing is imported here.
"""
