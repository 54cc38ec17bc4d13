"""The frame walk of one segment file in C (``_walk.c`` says what it checks and returns)."""

def walk(buf: bytes | bytearray | memoryview, first: int, salt: int, magic: int, valid: bytes, data_type: int, seal_type: int,
         max_length: int, /) -> tuple[bytes, bytes, bytes, int, bool] | None: ...
