"""Operating the queue: what an administrator uses, on the running daemon or on a stopped spool.

* :mod:`mtaq.admin.service`: browse, size, delete, purge, flush, hold, bounce and delay (Apache James
  ADR 31) on a consistent view, each a durable log record;
* :mod:`mtaq.admin.http`: the admin HTTP API (aiohttp), its security (token, Host, Origin, content type);
* :mod:`mtaq.admin.openapi`: the API's OpenAPI 3.1 document;
* :mod:`mtaq.admin.metrics`: Prometheus metrics read from the queue's counters;
* :mod:`mtaq.admin.cli`: ``mtaq queue``, a client of the API that reads the spool when the daemon is down.

May import :mod:`mtaq.core`, :mod:`mtaq.storage`, :mod:`mtaq.queue`, :mod:`mtaq.config` and
:mod:`mtaq.logs`; never the SMTP edge, delivery or the daemon's wiring. Nothing is imported here.
"""
