"""The pure core of mtaq: record types and codec, framing and tail rules, queue state, retry policy, the
bounce classifier (:mod:`~mtaq.core.bounce_class`).

Imports only the standard library and msgspec (serialization); no clock, no os, no asyncio (GUIDE §2).
"""
