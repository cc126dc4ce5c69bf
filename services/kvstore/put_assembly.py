"""The framing of one Put stream: a header opens a slice, data chunks fill it to exactly its length.

Framing errors end the stream (the caller's blocks completed before them stay stored): data with no
slice open, more data than the header said, a header or the end of the stream arriving before the
open slice is complete (truncated).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.validation import SliceHeader, check_chunk_data, check_slice_header, invalid


@dataclass(frozen=True)
class CompleteSlice:
    """One slice with its whole payload, as the chunks brought it (joined only where it must be)."""

    header: SliceHeader
    # bytes of data chunks, or views of a writer's shared memory (valid only until the Put answers).
    parts: list[bytes | memoryview]

    def payload(self) -> bytes:
        """The payload in one buffer of its own (a copy only when it came in several chunks or by reference)."""
        return bytes(self.parts[0]) if len(self.parts) == 1 else b"".join(self.parts)


class SliceAssembler:
    """Chunks in, complete slices out; raises StatusError on a framing error."""

    def __init__(self) -> None:
        self._open: SliceHeader | None = None
        self._parts: list[bytes | memoryview] = []
        self._received = 0

    def feed(
        self, chunk: kvstore_pb2.PutChunk, data: bytes | memoryview | None = None
    ) -> tuple[SliceHeader | None, CompleteSlice | None]:
        """The slice this chunk opens (if its header is set) and the slice it completes (if any).

        `data` is the chunk's payload when it came by another way than chunk.data (PutChunk.shared, read by
        the caller, which has checked its size)."""
        if data is None:
            check_chunk_data(chunk.data)
            data = chunk.data
        opened = None
        if chunk.HasField("header"):
            self._check_closed("the next header")
            opened = self._open = check_slice_header(chunk.header)
        elif self._open is None:
            raise invalid("header", "is unset, but no slice is open: the first chunk of each slice carries its header")
        return opened, self._add(data)

    def finish(self) -> None:
        """The stream ended; the open slice, if any, is truncated."""
        self._check_closed("the end of the stream")

    def _check_closed(self, what: str) -> None:
        if self._open is not None:
            raise invalid(
                "data",
                f"{self._open.describe()} got {self._received} of its {self._open.payload_length} payload bytes "
                f"before {what}: send a slice's whole payload (head_count x bytes per head) first",
            )

    def _add(self, data: bytes | memoryview) -> CompleteSlice | None:
        header = self._open
        assert header is not None
        if self._received + len(data) > header.payload_length:
            raise invalid(
                "data",
                f"{header.describe()} got {self._received + len(data)} payload bytes; its header says "
                f"{header.payload_length} (head_count x num_layers x 2 x block_size x head_dim x dtype bytes)",
            )
        if data:
            self._parts.append(data)
            self._received += len(data)
        if self._received < header.payload_length:
            return None
        done = CompleteSlice(header, self._parts)
        self._open, self._parts, self._received = None, [], 0
        return done
