"""Failover: three replicas over one PostgreSQL database and bucket; clients hold every
address (round_robin + gRPC's retry policy, the kit's resume on top). While downloads, vault
uploads and replica pushes run, a replica is killed with SIGKILL every few tenths of a second
and restarted (at least one keeps serving), ``FCTKIT_FAILOVER_KILLS`` times (50 by default). Then: no acknowledged upload or push is lost or
changed, no record is stored twice, every download and upload completed (the interrupted ones
through the other replica) with identical bytes. The counts are printed for the benchmark pages."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

from fctkit.protos.client import FctkitClient, _artifact_digest
from fctkit.protos.resumable_transfer import stream_download
from fctkit.protos.retry_policy import RetryPolicy
from tests.server.conftest import ADMIN_TOKEN, enrolled_client
from tests.server.test_replica_compaction import _record

KILLS = int(os.environ.get("FCTKIT_FAILOVER_KILLS", "50"))
# ~22 s without progress before a call gives up: with a second test process on the same 2 cores, a
# restarted replica can take seconds to listen again while the others are killed in turn
PATIENT = RetryPolicy(attempts=24, initial_backoff_s=0.1, max_backoff_s=1.0)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []

    def add(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + amount


def _download(client: FctkitClient, version: int, artifact, tally: Tally) -> None:
    opened = client._artifact_stream(version, artifact.name)

    def open_stream(position: int):
        if position:
            tally.add("downloads resumed mid-stream")
        return opened(position)

    sink = _HashingSink()
    transfer = stream_download(open_stream, _artifact_digest, sink, 0, hashlib.sha256(), client.retry)
    assert transfer.sha256 == artifact.sha256 and sink.digest.hexdigest() == artifact.sha256  # identical bytes
    tally.add("downloads completed")


class _HashingSink:
    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.digest.update(data)


def _kill_and_restart(replicas, kills: int, tally: Tally) -> None:
    """SIGKILL a serving replica every 0.2-0.5 s and start it again on its port (without waiting
    for it), never the last one serving."""
    rng = random.Random(21)
    for _ in range(kills):
        time.sleep(rng.uniform(0.2, 0.5))
        while len(serving := [r for r in replicas if r.listening()]) < 2:
            time.sleep(0.05)
        victim = rng.choice(serving)
        victim.process.kill()
        victim.process.wait()
        tally.add("kills")
        victim.launch()  # same port: the clients' address list stays right


def test_sigkilled_replicas_lose_no_acknowledged_write(start_replicas, archives):
    replicas = start_replicas(3)
    with FctkitClient(replicas[0].target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[1])
        artifact = max(admin.list_versions()[0].artifacts, key=lambda a: a.size)  # the 2.5 MB embed graph
    both = ",".join(r.target for r in replicas)
    first, _ = enrolled_client(replicas[0], name="camera")
    token = first._metadata[0][1].removeprefix("Bearer ")
    first.close()
    tally, stop = Tally(), threading.Event()
    uploaded: dict[str, bytes] = {}
    pushed: dict[int, int] = {}  # change id -> sequence the server acknowledged

    def run(work) -> None:
        with FctkitClient(both, token, retry=PATIENT) as client:
            k = 0
            while not stop.is_set():
                try:
                    work(client, k)
                except Exception as exc:
                    tally.errors.append(f"{work.__name__}: {exc!r}")
                k += 1

    def downloads(client: FctkitClient, k: int) -> None:
        _download(client, 1, artifact, tally)

    def uploads(client: FctkitClient, k: int) -> None:
        data = random.Random(k).randbytes(3_000_000)  # three part objects: kills land mid-upload
        transfer = client.upload_blob(data, f"photo-{k}")
        uploaded[transfer.sha256] = data  # acknowledged
        tally.add("uploads completed")
        if transfer.resumed_from:
            tally.add("uploads resumed from a held offset")

    def pushes(client: FctkitClient, k: int) -> None:
        records = [_record(k * 20 + j + 1, f"item-{k}-{j}", size=64, fill=k % 251) for j in range(20)]
        response = client.push_records(records)
        pushed.update(zip((r.change_id for r in records), response.sequences))  # acknowledged
        tally.add("pushes completed")

    workers = [
        threading.Thread(target=run, args=(work,), daemon=True) for work in (downloads, downloads, uploads, pushes)
    ]
    for worker in workers:
        worker.start()
    _kill_and_restart(replicas, KILLS, tally)
    for replica in replicas:
        replica.wait_listening()
    time.sleep(1.0)
    stop.set()
    for worker in workers:
        worker.join(120)
        assert not worker.is_alive(), "a client call hung"

    with FctkitClient(both, token, retry=PATIENT) as client:
        for sha256, data in uploaded.items():
            assert client.read_blob(sha256) == data, f"acknowledged blob {sha256} lost or changed"
        records = [r for response in client.pull_records() for r in response.records]
    change_ids = [r.change_id for r in records]
    assert len(change_ids) == len(set(change_ids)), "a record was stored twice"
    stored = {r.change_id: r.sequence for r in records}
    assert all(stored.get(change_id) == sequence for change_id, sequence in pushed.items()), (
        "an acknowledged push was lost"
    )
    counts = tally.counts
    print(f"\nfailover: {counts} errors={len(tally.errors)} acknowledged blobs={len(uploaded)} records={len(pushed)}")
    assert not tally.errors, tally.errors[:5]
    assert counts["kills"] == KILLS >= 1
    assert (
        counts.get("downloads completed", 0)
        and counts.get("uploads completed", 0)
        and counts.get("pushes completed", 0)
    )
