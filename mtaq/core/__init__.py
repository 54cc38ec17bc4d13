"""The pure core of mtaq: record types and codec, framing and tail rules, queue state, retry policy.

Imports only the standard library and msgspec (serialization); no clock, no os, no asyncio (GUIDE §2).
"""
