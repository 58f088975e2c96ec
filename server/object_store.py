"""Artifacts, vault blobs and unfinished uploads in an S3-compatible bucket (boto3), for the
scale-out backend: every replica reads and writes the same objects.

```
s3://BUCKET/PREFIX/artifacts/<sha256>                     bundle artifacts
s3://BUCKET/PREFIX/blobs/<sha256>                         vault blobs (device ciphertext)
s3://BUCKET/PREFIX/uploads/<owner folder>/<sha256>/<start>-<end>   parts of unfinished uploads
```

Objects are named by their SHA-256 and written whole (a PUT is atomic), so a reader never sees
half an object. An unfinished upload is a set of part objects, each named by the byte range it
holds; any replica can tell how much arrived (the contiguous ranges from 0) and resume it.
The endpoint and credentials come from the standard AWS settings (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles, instance roles).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import tempfile
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fctkit.errors import ConfigError

from .content_store import checked_sha256, is_sha256
from .partial_uploads import IncompleteUpload, owner_folder
from .streams import Sink

PART_BYTES = 1 << 20  # an unfinished upload is flushed to the bucket every MiB (what a killed replica can lose)
_PART = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})")


@dataclass(frozen=True)
class BucketLocation:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> BucketLocation:
        match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?", url)
        if match is None:
            raise ConfigError(f"--object-store {url!r} is not s3://BUCKET[/PREFIX] (a valid S3 bucket name)")
        prefix = (match.group(2) or "").strip("/")
        return cls(match.group(1), prefix + "/" if prefix else "")


def s3_client(endpoint_url: str | None = None, *, max_connections: int = 64) -> Any:
    """A boto3 S3 client (thread-safe); the endpoint and credentials default to the AWS environment."""
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max_connections,
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
    )
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)
    client.fctkit_requests = RequestCounter()
    client.meta.events.register("before-send.s3", client.fctkit_requests)
    return client


class RequestCounter:
    """Counts the HTTP requests a client sends (its retries included), for the operator's sizing figures."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, **_: Any) -> None:
        self.count += 1


def check_bucket(client: Any, location: BucketLocation) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=location.bucket)
    except (ClientError, BotoCoreError) as exc:
        raise ConfigError(
            f"cannot reach bucket {location.bucket!r} ({exc}); check --object-store, the endpoint "
            "(AWS_ENDPOINT_URL or --s3-endpoint-url) and the credentials"
        ) from exc


def _missing(error: Exception) -> bool:
    code = getattr(error, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


class S3Reader:
    """A stored object from ``offset`` on: one ranged GET, begun when opened (so an object deleted
    afterwards is still delivered whole, as an open file would be), streamed as it is read."""

    def __init__(self, client: Any, bucket: str, key: str, name: str, offset: int) -> None:
        self.name = name
        try:
            self._body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-")["Body"]
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(key) from None
            if "InvalidRange" not in str(exc):
                raise
            self._body = None  # at or past the end: nothing left to read

    def read(self, size: int) -> bytes:
        return self._body.read(size) if self._body is not None else b""

    def close(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None


class S3ContentStore:
    """Immutable objects named by their SHA-256 under ``PREFIX/<kind>/`` of one bucket."""

    def __init__(self, client: Any, location: BucketLocation, kind: str) -> None:
        self._client, self._bucket = client, location.bucket
        self._prefix = f"{location.prefix}{kind}/"

    def key(self, sha256: str) -> str:
        return self._prefix + checked_sha256(sha256)

    def has(self, sha256: str) -> bool:
        try:
            self._client.head_object(Bucket=self._bucket, Key=self.key(sha256))
        except Exception as exc:
            if _missing(exc):
                return False
            raise
        return True

    def open(self, sha256: str, offset: int = 0) -> S3Reader:
        """A reader of the object from ``offset``; FileNotFoundError when it is not stored."""
        return S3Reader(self._client, self._bucket, self.key(sha256), sha256, offset)

    def put(self, source: Path, sha256: str) -> None:
        """Upload the finished file ``source`` (whose digest the caller checked) and remove it; an
        object already stored is kept."""
        self.stage(source, sha256)
        Path(source).unlink(missing_ok=True)

    def stage(self, source: Path, sha256: str) -> None:
        """Upload ``source`` unless the object is stored; ``source`` stays (a :meth:`put` under the
        blob's lock then finds the object, or uploads it again if a delete won the race)."""
        if not self.has(sha256):
            self._client.upload_file(str(source), self._bucket, self.key(sha256))

    def delete(self, sha256: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self.key(sha256))

    def listing(self) -> Iterator[tuple[str, float]]:
        """Every stored digest with its last change (seconds since the epoch)."""
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=self._prefix):
            for entry in page.get("Contents", ()):
                name = entry["Key"][len(self._prefix) :]
                if is_sha256(name):
                    yield name, entry["LastModified"].timestamp()

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.listing())


class _PartSink:
    """Buffers an upload's chunks and writes them to the bucket as part objects of up to
    :data:`PART_BYTES` (on a worker thread, so the event loop keeps serving)."""

    def __init__(self, parts: S3Partials, owner_id: str, sha256: str, offset: int) -> None:
        self._parts, self._owner, self._sha256 = parts, owner_id, sha256
        self._start, self._buffer = offset, bytearray()

    async def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= PART_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self._buffer:
            return
        data, self._buffer = bytes(self._buffer), bytearray()
        end = self._start + len(data)
        await asyncio.to_thread(self._parts.put_part, self._owner, self._sha256, self._start, end, data)
        self._start = end


class S3Partials:
    """Unfinished uploads as part objects ``PREFIX/uploads/<owner folder>/<sha256>/<start>-<end>``
    (hex offsets), so any replica can resume an upload another one began."""

    def __init__(self, client: Any, location: BucketLocation, scratch: Path) -> None:
        self._client, self._bucket = client, location.bucket
        self._prefix = f"{location.prefix}uploads/"
        self._scratch = scratch

    def _folder(self, owner_id: str, sha256: str) -> str:
        return f"{self._prefix}{owner_folder(owner_id)}/{sha256}/"

    def _keys(self, prefix: str) -> Iterator[str]:
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix):
            yield from (entry["Key"] for entry in page.get("Contents", ()))

    def _parts(self, owner_id: str, sha256: str) -> list[tuple[int, int, str]]:
        """(start, end, key) of the upload's parts, by start."""
        found = []
        for key in self._keys(self._folder(owner_id, sha256)):
            match = _PART.fullmatch(key.rsplit("/", 1)[-1])
            if match:
                found.append((int(match.group(1), 16), int(match.group(2), 16), key))
        return sorted(found)

    @staticmethod
    def _cover(parts: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
        """The parts that hold the contiguous bytes from 0, each with the offset it is read from."""
        chosen: list[tuple[int, int, str]] = []
        position = 0
        while True:
            reaching = [p for p in parts if p[0] <= position < p[1]]
            if not reaching:
                return chosen
            start, end, key = max(reaching, key=lambda p: p[1])
            chosen.append((position - start, end, key))
            position = end

    @staticmethod
    def _end(cover: list[tuple[int, int, str]]) -> int:
        """How many contiguous bytes from 0 a cover holds."""
        return cover[-1][1] if cover else 0

    def held(self, owner_id: str, sha256: str) -> int | None:
        parts = self._parts(owner_id, sha256)
        return self._end(self._cover(parts)) if parts else None

    def put_part(self, owner_id: str, sha256: str, start: int, end: int, data: bytes) -> None:
        key = f"{self._folder(owner_id, sha256)}{start:016x}-{end:016x}"
        self._client.put_object(Bucket=self._bucket, Key=key, Body=data)

    def truncate(self, owner_id: str, sha256: str, offset: int) -> None:
        """Drop the bytes held from ``offset`` on, as a file would be truncated: parts that start
        there or later go, and a part across it is rewritten to end there (the new part is put
        before the old one goes, so a crash in between loses nothing below ``offset``)."""
        doomed = []
        for start, end, key in self._parts(owner_id, sha256):
            if end <= offset:
                continue
            if start < offset:
                body = self._client.get_object(Bucket=self._bucket, Key=key, Range=f"bytes=0-{offset - start - 1}")[
                    "Body"
                ]
                with contextlib.closing(body):
                    self.put_part(owner_id, sha256, start, offset, body.read())
            doomed.append(key)
        self._delete(doomed)

    @contextlib.asynccontextmanager
    async def writer(self, owner_id: str, sha256: str, offset: int) -> AsyncIterator[Sink]:
        """Parts from ``offset`` on (the caller truncated the upload there); what arrived is flushed
        when the stream ends, however it ends (a replica killed outright loses at most its last
        unflushed MiB)."""
        sink = _PartSink(self, owner_id, sha256, offset)
        try:
            yield sink
        finally:
            await sink.flush()

    def assemble(self, owner_id: str, sha256: str, size: int) -> Path:
        """The upload's bytes 0..size in a local scratch file; IncompleteUpload when parts are missing."""
        cover = self._cover(self._parts(owner_id, sha256))
        if (held := self._end(cover)) < size:
            raise IncompleteUpload(held)
        with tempfile.NamedTemporaryFile(dir=self._scratch, prefix="upload-", delete=False) as handle:
            for skip, _, key in cover:
                try:
                    body = self._client.get_object(Bucket=self._bucket, Key=key, Range=f"bytes={skip}-")["Body"]
                except Exception as exc:
                    if not _missing(exc):
                        raise
                    Path(handle.name).unlink(missing_ok=True)  # another replica finished or discarded the upload
                    raise IncompleteUpload(0) from None
                with contextlib.closing(body):
                    for chunk in iter(functools.partial(body.read, 1 << 20), b""):
                        handle.write(chunk)
        return Path(handle.name)

    def finished(self, owner_id: str, sha256: str, assembled: Path) -> None:
        assembled.unlink(missing_ok=True)
        self.discard(owner_id, sha256)

    def discard(self, owner_id: str, sha256: str) -> None:
        self._delete(list(self._keys(self._folder(owner_id, sha256))))

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True})

    def sweep(self, reserved: Callable[[], Collection[tuple[str, str]]]) -> int:
        """Remove the parts of every upload not in ``reserved()`` ((owner id, SHA-256) pairs, asked
        once the parts are listed: an upload another replica began meanwhile is kept); returns how many uploads."""
        keys = list(self._keys(self._prefix))
        kept = {f"{self._prefix}{owner_folder(owner)}/{sha256}/" for owner, sha256 in reserved()}
        stale: dict[str, list[str]] = {}
        for key in keys:
            folder = key.rsplit("/", 1)[0] + "/"
            if folder not in kept:
                stale.setdefault(folder, []).append(key)
        self._delete([key for keys in stale.values() for key in keys])
        return len(stale)
