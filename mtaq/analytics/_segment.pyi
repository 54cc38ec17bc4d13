"""The frame walk of one segment file and the decoding of record payloads, in C (``_segment.c`` says what
each checks and returns). ``buf``: any object with the buffer protocol (bytes, a numpy array)."""

def walk(buf: bytes | bytearray | memoryview, first: int, salt: int, magic: int, valid: bytes, data_type: int, seal_type: int,
         max_length: int, /) -> tuple[bytes, bytes, bytes, int, bool] | None: ...
def decode(buf: object, starts: bytes, ends: bytes, program: bytes, kinds: bytes, nullable: bytes,
           /) -> list[tuple[bytes, bytes | None, bytes | None]] | None: ...
