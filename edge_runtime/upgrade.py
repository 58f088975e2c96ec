"""Crash-safe, resumable in-place upgrade of a gallery along a planned path.

The plan (target version, mode, hops) is written to the gallery before the first batch;
each batch takes the next rows (by row id) not yet in the target space, moves them through
every hop from their own version tag (h and g hop by hop, or the direct adapter when the
plan has one) and writes them back with their new tag in **one transaction**, each row
guarded by the tag it was computed from. A process killed at any moment leaves every row
either untouched or fully upgraded, and a restart takes the same next batch, so the result
is bit-for-bit that of an uninterrupted run (same batch size and threads).

Guarantees while an upgrade runs (zero downtime):

* **forward mode** — new vectors go into the *staged* vector table; queries keep using the
  old query model against the live (old) vectors, complete and exact, until the switch
  commits (one transaction makes the staged table live and sets the new query version).
  Rows added meanwhile are embedded with the old model and upgraded before the switch; a
  row embedded by a process that still ran the old model after the switch is refused.
* **unified mode** (λ-orth) — the query model switches first to B(φ_new); rows are rewritten
  in place with F where the bundle has one, and every row, adapted or not, stays comparable.
* **compatible mode** — identity hops only change the version tags.

Readers in other processes see one consistent snapshot per query (SQLite WAL); they are
never blocked by the upgrade's writes. Not guaranteed: a query issued while the switch
commits is answered by whichever version its snapshot saw (old or new, never a mix).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tqdm import tqdm

from fctkit.errors import DeviceError, GalleryError, InputError
from fctkit.feature_checks import nonfinite_items, nonfinite_message
from fctkit.protos.bundle import check_version_is_newer

from .backfill import record_uncertainty
from .engine import Engine
from .gallery import Gallery
from .gallery.rows import LoadedRows, UpgradedRows, rows_by_tag, take_rows
from .revert_records import (
    ROLLBACK_KEY,
    not_withdrawn,
    refuse_withdrawn,
    revert_meta,
    rollback_meta,
    withdrawal_log,
)
from .scoring import transition_for
from .sqlite_file import file_bytes, require_room
from .upgrade_check import UpgradeRun
from .upgrade_plan import UpgradePlan, hop_list, plan_to, server_hops, transform_rows
from .work_window import Window

if TYPE_CHECKING:
    from fctkit.protos.client import FctkitClient

    from .device_parts import DeviceParts

REPORT_EVERY_S = 2.0  # upgrade progress reports to the fleet service, at most this often


class DeviceUpgrade:
    """The upgrades of one device's gallery: resumed after a crash, offline over installed
    bundles, or along the server's plan. ``after()`` runs once a plan has finished (the device
    places replica records that waited for the version and refreshes its search);
    ``report(progress)``, when given, tells the fleet service how far the rows are;
    ``check(run)``, when given, runs before ``after()`` with what the finished upgrade did (the
    health check of :mod:`.upgrade_check`: it never raises). ``window`` bounds this call's work
    (:mod:`.work_window`): when it is spent the upgrade pauses after a committed batch, its plan
    recorded, and the next call resumes it (:meth:`resume`, the path a crash takes)."""

    def __init__(
        self,
        parts: DeviceParts,
        *,
        batch_size: int,
        after: Callable[[], None],
        report: Callable[[int, float], None] | None = None,
        check: Callable[[UpgradeRun], object] | None = None,
        window: Window | None = None,
    ) -> None:
        self.parts, self.gallery, self.bundles = parts, parts.gallery, parts.bundles
        self.batch_size, self.after, self.report, self.check = batch_size, after, report, check
        self.clock = (window or Window()).clock()

    def resume(self) -> int:
        """Finish the upgrade a crash interrupted (0 when none was under way), unless its target was
        withdrawn since (:meth:`_not_finished`)."""
        state = self.gallery.upgrade_state
        if state is None:
            return 0
        plan = UpgradePlan.from_state(state)
        return self._not_finished(plan) if withdrawal_log(self.gallery).withdrawn(plan.target) else self.finish(plan)

    def _not_finished(self, plan: UpgradePlan) -> int:
        """An interrupted upgrade to a withdrawn version: in forward mode given up (its staged vectors
        dropped; queries never left the version before it), else refused (its queries switched at its
        start: a sync takes the device back, :mod:`.revert`). Returns 0 rows upgraded."""
        if plan.mode != "forward":
            raise DeviceError(
                f"the upgrade under way goes to v{plan.target}, which was withdrawn by its publishers: it is not "
                "finished; run `fctkit device sync --dir DIR` to go back from where it stopped"
            )
        self.gallery.give_up_staged({"upgrade": None})
        return 0

    def offline(self, bundle_dirs: Sequence[str | os.PathLike[str]] | None) -> int:
        """Resume, then install ``bundle_dirs`` (or apply bundles installed but never applied) and
        upgrade to the newest over the installed bundles; a device without a model just installs."""
        done = self.resume()
        if self.gallery.upgrade_state is not None:
            return done  # the window was spent while resuming: the rest waits for the next call
        query_version = self.parts.version
        if bundle_dirs is None:  # installed by a run that stopped before its plan (withdrawn versions are not)
            targets = not_withdrawn(self.gallery, self.parts.pending_versions())
        else:  # room is checked once they verified, and only for work to do (the same command again does none)
            targets = self.bundles.install_all(
                bundle_dirs,
                query_version,
                lambda more: self._require_room(more, "installing the bundles and upgrading the gallery"),
            )
        if not targets or max(targets) <= query_version:
            return done  # nothing newer: already applied (the same command run again after a crash)
        target = max(targets)
        if query_version == 0:
            self.gallery.set_meta({"query_version": str(target)})
            return done
        installed = ", ".join(f"v{v}" for v in self.bundles.versions())
        plan = plan_to(
            self.gallery,
            target,
            self.bundles.engine(target).manifest.mode,
            lambda source: self.bundles.hops(source, target),
            f"the installed bundles ({installed}) hold no adapter path",
            self.bundles.manifest,
        )
        return done + self.start(plan)

    def server_plan(self, client: FctkitClient, target: int) -> UpgradePlan:
        """The server's plan to ``target`` from every version the rows are in, its bundles downloaded."""
        query_version = self.parts.version
        self.bundles.download(client, target, query_version)

        def fetch(bundles: set[int]) -> None:
            for bundle in sorted(bundles):
                self.bundles.download(client, bundle, query_version)

        return plan_to(
            self.gallery,
            target,
            self.bundles.engine(target).manifest.mode,
            server_hops(client, target),
            "the server publishes no adapter path",
            self.bundles.manifest,
            fetch=fetch,
        )

    def start(self, plan: UpgradePlan) -> int:
        """Record ``plan`` (a newer version only; none may be under way) and run it. In unified and
        compatible mode the queries switch to the target at once."""
        if self.gallery.upgrade_state is not None:
            raise DeviceError("another upgrade is in progress: run `fctkit device upgrade` to finish it first")
        check_version_is_newer(plan.target, self.parts.version or None)
        refuse_withdrawn(self.gallery, plan.target)
        if any(h.forward is not None for h in plan.hops):
            self._require_room(0, f"upgrading the gallery's rows to v{plan.target}")
        record_uncertainty(
            self.parts, self.bundles.engine(plan.target)
        )  # FastFill σ needs φ_old, ψ: before the rewrite
        meta: dict[str, str | None] = {"upgrade": plan.to_json()}
        if plan.mode != "forward":
            meta["query_version"] = str(plan.target)
        self.gallery.set_meta(meta)
        return self.finish(plan)

    def _require_room(self, more: int, what: str) -> None:
        """An upgrade rewrites every row: measured, its staged rows, pointers and log take up to
        about the gallery file's own size again; refused before anything is written without it."""
        require_room(self.gallery.path.parent, file_bytes(self.gallery.path) + more, what)

    def finish(self, plan: UpgradePlan) -> int:
        """Run the recorded ``plan`` to its end (resuming where it stopped) and make the target the
        version answering queries: in forward mode by switching the staged vectors live, with a
        transition when the bundle declares one; unless the window is spent first (paused: the plan
        stays recorded, nothing switches). Returns the rows upgraded now."""
        started = time.monotonic()
        engines = {b: self.bundles.engine(b) for b in {h.bundle for h in plan.hops if h.forward is not None}}
        rewrite = any(h.forward is not None for h in plan.hops)  # identity hops only (compatible): rows stay untouched
        if rewrite and self.gallery.damaged_pointers():  # rows are read by their pointers: none may be skipped or lost
            raise GalleryError(
                f"rows of {self.gallery.path} point to the wrong vectors (`fctkit device check --dir DIR` lists "
                "them): run `fctkit device repair --dir DIR`, then the upgrade again (it resumes)"
            )
        if rewrite and plan.mode == "forward":
            self.gallery.unstage_damaged()  # staged again from their live rows below, never switched live damaged
        left = self.gallery.remaining(plan.target) if rewrite else 0
        total = len(self.gallery)  # progress: rows in the target's space, of all rows
        if self.report is not None:
            self.report(plan.target, 0.0)
        last_report, moved = [time.monotonic()], [0]  # a disabled bar (no progress shown) counts nothing

        def on_batch(rows: int) -> None:
            bar.update(rows)
            moved[0] += rows
            self.clock.window.tell(total - left + moved[0], total)
            if self.report is not None and time.monotonic() - last_report[0] > REPORT_EVERY_S:
                self.report(plan.target, moved[0] / max(left, 1))
                last_report[0] = time.monotonic()

        with tqdm(
            total=left, desc=f"upgrade {hop_list(plan.hops)}", unit="row", disable=not self.parts.progress or left == 0
        ) as bar:
            done = (
                run_upgrade(
                    self.gallery, plan, engines, batch_size=self.batch_size, on_batch=on_batch, stop=self.clock.spent
                )
                if rewrite
                else 0
            )
        if self.clock.stopped:
            return done  # paused at a batch boundary: a consistent gallery, resumed by the next call
        if plan.mode == "forward":
            version = self.gallery.query_version
            target = self.bundles.engine(plan.target).manifest
            transition = transition_for(target, self.bundles.manifest(version), version)
            rollback = rollback_meta(target, version)  # a window: every row keeps its vectors (:mod:`.revert`)
            self.gallery.switch_to(
                plan.target,
                {
                    "upgrade": None,
                    "transition": None if transition is None else transition.to_json(),
                    **rollback,
                    **revert_meta(None),
                },
                keep_previous=None if transition is None else transition.previous_version,
                keep_rollback=rollback[ROLLBACK_KEY] is not None,
            )
        else:  # rows rewritten in place: no vectors kept, a withdrawal reverts through backward or the vault
            self.gallery.drop_rollback({ROLLBACK_KEY: None, **revert_meta(None)})  # before the upgrade record goes
            self.gallery.extras.drop(
                "previous_embedding", {"upgrade": None, "query_version": str(plan.target), "transition": None}
            )
        if self.check is not None:
            self.check(UpgradeRun(plan.target, done, self.gallery.remaining(plan.target), time.monotonic() - started))
        self.after()
        return done


def run_upgrade(
    gallery: Gallery,
    plan: UpgradePlan,
    engines: Mapping[int, Engine],
    *,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
    stop: Callable[[int], bool] | None = None,
) -> int:
    """Upgrade every row not yet in ``plan.target``'s space; returns the rows upgraded now.
    ``on_batch(rows)`` is called after each committed batch; ``stop(rows taken)``, before each
    batch, ends the run early (after the batches taken commit) when it returns True.

    Batches are the next ``batch_size`` pending rows in row-id order, so a restart after a
    crash (which begins again at the lowest pending row) forms the same batches as an
    uninterrupted run. Three stages overlap: a second connection reads and decrypts the next
    batch (rows with higher ids, which no earlier batch touches), this thread transforms the
    current one, and a writer seals and commits the previous one (its own transaction, in
    order; the fsync waits there, not here). Rows added meanwhile get higher ids and are
    picked up; a final pass from the start catches anything else before returning."""
    staged = plan.mode == "forward"
    done, taken, last_row_id = 0, 0, 0
    reader = gallery.reader()
    writing: Future[int] | None = None

    def committed() -> None:  # the previous batch's write finished (its error, if any, raised here)
        nonlocal done, writing
        if writing is not None:
            rows, writing = writing.result(), None
            done += rows
            if on_batch is not None:
                on_batch(rows)

    def write(upgraded: list[UpgradedRows]) -> int:
        gallery.write_upgrades(upgraded, staged=staged)
        return sum(len(u.row_ids) for u in upgraded)

    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="fctkit-prefetch") as pool,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="fctkit-write") as writer,
    ):
        try:
            upcoming = pool.submit(reader.rows_to_upgrade, plan.target, 0, batch_size)
            while True:
                batch = upcoming.result()
                if batch.corrupt:
                    committed()
                    row_id, item_id, reason = batch.corrupt[0]
                    raise GalleryError(
                        f"row {row_id} ({item_id!r}) cannot be upgraded: {reason}; run "
                        f"`fctkit device check --dir DIR` to list every damaged row, "
                        f"`fctkit device repair --dir DIR` to restore them from the owner's replica or "
                        f"remove them, then the upgrade again (it resumes)"
                    )
                if not len(batch):
                    committed()
                    if last_row_id == 0 or gallery.remaining(plan.target) == 0:
                        return done
                    last_row_id = 0
                    upcoming = pool.submit(reader.rows_to_upgrade, plan.target, 0, batch_size)
                    continue
                if stop is not None and stop(taken):
                    committed()
                    return done
                taken += len(batch)
                last_row_id = int(batch.row_ids[-1])
                upcoming = pool.submit(reader.rows_to_upgrade, plan.target, last_row_id, batch_size)
                upgraded = _transform_batch(plan, engines, batch)
                committed()
                writing = writer.submit(write, upgraded)
        finally:
            if writing is not None:
                writing.exception()  # let a write in flight end before the connections close
            pool.shutdown(wait=True)
            reader.close()


def _transform_batch(plan: UpgradePlan, engines: Mapping[int, Engine], batch: LoadedRows) -> list[UpgradedRows]:
    """The batch's rows moved to the target, one group per version tag."""
    groups: list[UpgradedRows] = []
    for tag, rows in rows_by_tag(batch.tags).items():
        item_ids = [batch.item_ids[i] for i in rows]
        embeddings, side_infos = take_rows(batch.embeddings, rows), take_rows(batch.side_infos, rows)
        try:
            new_tag, embeddings, side_infos = transform_rows(plan, engines, tag, embeddings, side_infos)
        except InputError:
            _refuse_nonfinite(
                nonfinite_items(item_ids, embeddings, side_infos)
            )  # NaN side-info: lost, marked by repair
            raise
        _refuse_nonfinite(nonfinite_items(item_ids, embeddings))
        groups.append(UpgradedRows(batch.row_ids[rows].tolist(), item_ids, tag, new_tag, embeddings, side_infos))
    return groups


def _refuse_nonfinite(item_ids: Sequence[str]) -> None:
    if item_ids:
        raise GalleryError(
            nonfinite_message(item_ids, "cannot be upgraded") + ", or their side-info was lost to damage "
            "(`fctkit device repair` lists them as side_info_lost); remove them (`fctkit device remove "
            "--dir DIR ID...`) and add their originals again, then run the upgrade again (it resumes)"
        )
