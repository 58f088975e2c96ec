"""Resumable, SHA-256-checked object transfers over gRPC streams.

A download is a header-then-chunks stream opened at a byte offset: it reconnects from the last
byte received while the server is UNAVAILABLE, and to a file it goes through a ``.part`` file
that later attempts (and later processes) resume from. An upload is cut into chunks from the
offset the server already holds."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import grpc

from fctkit.errors import HashMismatchError, RpcStatusError

from .common_pb2 import Chunk
from .retry_policy import RetryPolicy, sleep_before_retry

PART_SUFFIX = ".part"


@dataclass(frozen=True)
class Transfer:
    """What a download or upload moved: the object's digest and size, and where it (re)started."""

    sha256: str
    size: int
    resumed_from: int
    header: Any = None  # ArtifactHeader / BlobInfo as sent by the server


def stream_download(
    open_stream: Callable[[int], Any],
    header_digest: Callable[[Any], tuple[str, int]],
    sink: BinaryIO,
    offset: int,
    digest: Any,
    retry: RetryPolicy,
    known: tuple[str, int] | None = None,
) -> Transfer:
    """Write a header-then-chunks stream from ``offset`` into ``sink`` (which holds the
    first ``offset`` bytes already, hashed into ``digest``), reconnecting from the last
    byte received while the server is UNAVAILABLE; verify the SHA-256 at the end. ``known``
    (SHA-256, size) from signed metadata: the server must announce exactly that. No byte past
    the announced size is written (endless data)."""
    position, started, header, expected = offset, offset, None, known
    delays = retry.delays()
    while True:
        call = open_stream(position)
        try:
            for message in call:
                if message.WhichOneof("payload") == "header":
                    header = message.header
                    announced = header_digest(header)
                    if known is not None and announced != known:
                        raise HashMismatchError(
                            f"the server announces {announced[1]} bytes with SHA-256 {announced[0][:16]}…, but the signed "
                            f"metadata says {known[1]} bytes with SHA-256 {known[0][:16]}…: refused before downloading"
                        )
                    if expected is not None and announced != expected:
                        raise HashMismatchError(
                            "the object changed on the server while it was being downloaded; start again"
                        )
                    expected = announced
                    if position > expected[1]:
                        raise HashMismatchError(
                            f"{position} bytes are held locally but the object has only {expected[1]}; start again"
                        )
                    continue
                chunk = message.chunk
                if expected is None or chunk.offset != position:
                    raise RpcStatusError(
                        "DATA_LOSS", f"the server sent a chunk at offset {chunk.offset}, expected {position}"
                    )
                data = chunk.data  # each access copies the bytes out of the message
                if position + len(data) > expected[1]:
                    raise HashMismatchError(
                        f"the server sent more than the {expected[1]} bytes announced: refused "
                        "(endless data); download again"
                    )
                sink.write(data)
                digest.update(data)
                position += len(data)
                delays = retry.delays()  # progress resets the retry budget
            break
        except grpc.RpcError as error:
            sleep_before_retry(error, delays)
        finally:
            call.cancel()
    if expected is None:  # a stream that ended before its header
        raise RpcStatusError("DATA_LOSS", "the server ended the download without announcing the object")
    sha256, size = expected
    if position != size or digest.hexdigest() != sha256:
        raise HashMismatchError(
            f"downloaded {position} bytes hashing to {digest.hexdigest()[:16]}…, expected {size} bytes with "
            f"SHA-256 {sha256[:16]}…; download again"
        )
    return Transfer(sha256, size, started, header)


def download_to_file(
    open_stream: Callable[[int], Any],
    header_digest: Callable[[Any], tuple[str, int]],
    dest: Path,
    retry: RetryPolicy,
    known: tuple[str, int] | None = None,
) -> Transfer:
    """Download into ``dest`` through ``dest.part`` (kept between attempts and processes,
    resumed from its size), renamed to ``dest`` once the SHA-256 matches (``known``: see
    :func:`stream_download`)."""
    dest = Path(dest)
    part = dest.with_name(dest.name + PART_SUFFIX)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with part.open("a+b") as sink:
        sink.seek(0)
        while block := sink.read(1 << 20):
            digest.update(block)
        offset = sink.tell()
        try:
            transfer = stream_download(open_stream, header_digest, sink, offset, digest, retry, known)
        except HashMismatchError:
            sink.close()
            part.unlink(missing_ok=True)
            raise
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(part, dest)
    return transfer


def chunks_of(fh: BinaryIO, offset: int, chunk_size: int) -> Iterator[Chunk]:
    """``fh`` from ``offset`` on, as the wire's chunks of at most ``chunk_size`` bytes."""
    fh.seek(offset)
    while data := fh.read(chunk_size):
        yield Chunk(offset=offset, data=data)
        offset += len(data)
