"""Chunked byte streams in both directions, shared by artifact downloads, vault blobs and
bundle publishing: a header message first, then contiguous :class:`Chunk` messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO, Protocol

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


class Sink(Protocol):
    async def write(self, data: bytes) -> None: ...


class FileSink:
    """A local file as a :class:`Sink`."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle

    async def write(self, data: bytes) -> None:
        self._handle.write(data)


class Readable(Protocol):
    name: str

    def read(self, size: int) -> bytes: ...
    def close(self) -> None: ...


async def receive_chunks(requests: AsyncIterator[Any], sink: Sink, *, position: int, total: int, digest=None) -> int:
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
        await sink.write(chunk.data)
        if digest is not None:
            digest.update(chunk.data)
        position += len(chunk.data)
    return position


def open_stored(opener: Callable[[], Readable], missing: RpcStatusError) -> Readable:
    """Open a stored object *before* a download's header is sent, so that a delete racing the
    download cannot pull it away mid-stream (an open file stays readable on POSIX);
    ``missing`` is raised when it is already gone."""
    try:
        return opener()
    except FileNotFoundError:
        raise missing from None


async def file_chunks(
    source: Readable, offset: int, end: int, chunk_size: int, response_type: type
) -> AsyncIterator[Any]:
    """``response_type(chunk=...)`` messages carrying the object ``source`` (opened at ``offset``)
    up to ``end`` (the caller closes it), each read on a worker thread (an object store's read is
    a network call).

    The data goes straight into the response (a nested Chunk passed to the constructor would
    be copied once more: a megabyte per message)."""
    position = offset
    while position < end:
        data = await asyncio.to_thread(source.read, min(chunk_size, end - position))
        if not data:
            name = str(getattr(source, "name", "?")).rsplit("/", 1)[-1]
            raise RpcStatusError(
                "DATA_LOSS", f"stored object {name} is shorter than recorded; the server's storage is damaged"
            )
        yield response_type(chunk={"offset": position, "data": data})
        position += len(data)


def check_offset(offset: int, size: int) -> int:
    if offset > size:
        raise RpcStatusError("OUT_OF_RANGE", f"offset {offset} is past the end ({size} bytes)")
    return offset
