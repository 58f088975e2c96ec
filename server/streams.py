"""Chunked byte streams in both directions, shared by artifact downloads, vault blobs and
bundle publishing: a header message first, then contiguous :class:`Chunk` messages."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from fctkit.errors import RpcStatusError
from fctkit.protos import limits

from .validation import invalid


async def read_header(requests: AsyncIterator[Any]) -> Any:
    """The ``header`` of the stream's first message (oneof ``payload``)."""
    try:
        first = await anext(requests)
    except StopAsyncIteration:
        raise invalid("the stream is empty: send the header first, then the chunks") from None
    if first.WhichOneof("payload") != "header":
        raise invalid("the first message of the stream must be the header")
    return first.header


async def receive_chunks(requests: AsyncIterator[Any], sink: BinaryIO, *, position: int, total: int, digest=None) -> int:
    """Write the chunks that follow the header to ``sink``; returns the end position.

    Each chunk must start where the previous one ended, carry at most 1 MiB, and not go
    past the ``total`` the header announced.
    """
    async for message in requests:
        if message.WhichOneof("payload") != "chunk":
            raise invalid("only chunks may follow the header")
        chunk = message.chunk
        if chunk.offset != position:
            raise invalid(f"chunk.offset is {chunk.offset}; expected {position} (chunks must be contiguous)")
        if len(chunk.data) > limits.MAX_CHUNK_BYTES:
            raise invalid(f"chunk.data has {len(chunk.data)} bytes; at most {limits.MAX_CHUNK_BYTES}")
        if position + len(chunk.data) > total:
            raise invalid(f"the chunks carry more than the {total} bytes the header announced")
        sink.write(chunk.data)
        if digest is not None:
            digest.update(chunk.data)
        position += len(chunk.data)
    return position


def open_stored(path: Path, missing: RpcStatusError) -> BinaryIO:
    """Open a stored file *before* a download's header is sent, so that a delete racing the
    download cannot pull the file away mid-stream (an open file stays readable on POSIX);
    ``missing`` is raised when it is already gone."""
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise missing from None


def file_chunks(source: BinaryIO, offset: int, end: int, chunk_size: int, response_type: type) -> Iterator[Any]:
    """``response_type(chunk=...)`` messages carrying the open file ``source`` from ``offset``
    to ``end`` (the caller closes it).

    The data goes straight into the response (a nested Chunk passed to the constructor would
    be copied once more: a megabyte per message)."""
    source.seek(offset)
    position = offset
    while position < end:
        data = source.read(min(chunk_size, end - position))
        if not data:
            raise RpcStatusError("DATA_LOSS", f"stored file {Path(source.name).name} is shorter than recorded; the server's data directory is damaged")
        yield response_type(chunk={"offset": position, "data": data})
        position += len(data)


def check_offset(offset: int, size: int) -> int:
    if offset > size:
        raise RpcStatusError("OUT_OF_RANGE", f"offset {offset} is past the end ({size} bytes)")
    return offset
