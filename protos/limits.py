"""Wire limits of the ``fctkit.v1`` protocol (documented in ``protos/proto-src/fctkit/v1/common.proto``).

The server enforces them (INVALID_ARGUMENT naming the field); the client library stays
within them.
"""

from __future__ import annotations

MAX_CHUNK_BYTES = 1 << 20
"""Data bytes in one Chunk message (1 MiB)."""

MAX_MESSAGE_BYTES = 2 << 20
"""The server refuses any message bigger than this (2 MiB), far below gRPC's 4 MiB default."""

MAX_MANIFEST_BYTES = 1 << 20
"""A bundle manifest, so that GetManifest stays a single small message."""

MAX_ARTIFACTS_PER_BUNDLE = 32
MAX_VERSIONS_PAGE = 100
MAX_BLOBS_PAGE = 1000
MAX_DEVICES_PAGE = 500
MAX_LISTED_ITEMS = 1_000_000
"""Blobs (ListBlobs) or devices (ListDevices) a client takes from all the pages of one listing."""

MAX_LISTED_BYTES = 128 << 20
"""Wire bytes of all the pages of one ListBlobs or ListDevices listing (128 MiB; a million blobs take about 110 MiB)."""

MAX_NAME_CHARS = 256
"""Names, labels, item ids, artifact names."""

MAX_DETAIL_CHARS = 1024
MAX_ENROLMENT_TTL_S = 30 * 24 * 3600
DEFAULT_ENROLMENT_TTL_S = 24 * 3600
MAX_UINT63 = (1 << 63) - 1
"""Counters (sizes, gallery sizes) are stored as signed 64-bit integers."""

SHA256_HEX_CHARS = 64

MAX_RECORDS_PER_MESSAGE = 4096
"""Rows of sealed gallery records in one PushRecords / PullRecords message (a block counts its rows)."""

MAX_RECORD_BYTES = 64 << 10
"""One sealed single-row gallery record (nonce, ciphertext and tag): far above a 2,048-d float32 row."""

MAX_BLOCK_ROWS = 4096
"""Rows in one sealed block of records."""

MAX_RECORD_BATCH_BYTES = 1 << 20
"""Sealed bytes of the records in one PushRecords / PullRecords message (1 MiB); also the most one block may hold."""

MAX_ITEM_ID_BATCH_BYTES = 256 << 10
"""UTF-8 bytes of the item ids in one PushRecords / PullRecords message (keeps a message under 2 MiB)."""

MAX_RECORDS_PER_PUSH = 65536
"""Rows of the records in one PushRecords call."""
