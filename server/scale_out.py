"""The scale-out backend: metadata in PostgreSQL, contents in an S3-compatible bucket, so any
number of identical ``fctkit serve`` replicas can run behind one load balancer.

A replica keeps nothing of its own but a scratch folder (publish staging, uploads being
hashed). What one replica does that others must see at once travels by PostgreSQL's
LISTEN/NOTIFY on :data:`~.database.EVENTS_CHANNEL`: ``version:N`` (a publish: watchers on every
replica get it) and ``revoked:DEVICE`` (a revocation: every replica ends the device's open
streams). After losing the database connection a replica reconnects and catches up on what it
missed (``on_connected``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from .database import EVENTS_CHANNEL
from .jsonlog import log_event
from .object_store import BucketLocation, S3ContentStore, S3Partials, check_bucket, s3_client
from .storage import ServerStorage
from .storage_schema import open_postgres

GARBAGE_GRACE_S = 3600.0  # an unreferenced object younger than this may belong to a publish or upload still in flight


class ScaleOutStorage(ServerStorage):
    """:class:`~.storage.Storage` on PostgreSQL (``database_url``) and a bucket (``object_store``, s3://BUCKET/PREFIX)."""

    def __init__(
        self, database_url: str, object_store: str, *, s3_endpoint_url: str | None = None, max_connections: int = 20
    ) -> None:
        location = BucketLocation.parse(object_store)
        client = s3_client(s3_endpoint_url, max_connections=max(64, max_connections))
        check_bucket(client, location)
        self.database_url = database_url
        scratch = Path(tempfile.mkdtemp(prefix="fctkit-replica-"))
        db = open_postgres(database_url, max_connections=max_connections)
        self._database, self._client = db, client
        super().__init__(
            db,
            S3ContentStore(client, location, "artifacts"),
            S3ContentStore(client, location, "blobs"),
            S3Partials(client, location, scratch),
            scratch,
            garbage_grace_s=GARBAGE_GRACE_S,
        )

    def round_trips(self) -> dict[str, int]:
        """Database round trips and object-store requests made so far (logged at shutdown)."""
        return {
            "database_round_trips": self._database.round_trips,
            "object_store_requests": self._client.fctkit_requests.count,
        }

    def listen(
        self, on_event: Callable[[str], None], on_connected: Callable[[], None], on_lost: Callable[[], None]
    ) -> Coroutine[Any, Any, None]:
        def connected() -> None:
            self._database.reachable = True
            on_connected()

        def lost() -> None:
            self._database.reachable = False
            on_lost()

        return listen_for_events(self.database_url, on_event, connected, lost)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


async def listen_for_events(
    database_url: str, on_event: Callable[[str], None], on_connected: Callable[[], None], on_lost: Callable[[], None]
) -> None:
    """LISTEN on one connection of its own and hand every payload to ``on_event``; when the
    connection drops call ``on_lost`` and reconnect (backing off to 5 s), calling ``on_connected``
    after each (re)connect."""
    import psycopg

    delay = 0.1
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as connection:
                await connection.execute(f"LISTEN {EVENTS_CHANNEL}")
                on_connected()
                delay = 0.1
                async for notification in connection.notifies():
                    on_event(notification.payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database went away: say so (health), reconnect, catch up
            on_lost()
            log_event(
                "event listener lost the database; reconnecting", logging.WARNING, error=str(exc), retry_in_s=delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
