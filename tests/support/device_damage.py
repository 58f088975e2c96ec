"""The adversary's device harness (issue 34 section 3): damage a copy of a device directory, run
a user's session through the `fctkit` command line in-process, and class what the user saw.

A session is ``device query``, ``status``, ``check``, ``repair``, ``query`` again, then
``upgrade --bundle`` (a newer version) and ``add``, each through :func:`fctkit.cli.main` as a
user runs it: an exception escaping it other than ``SystemExit`` is a *traceback*. Between
``check`` and ``repair`` the device is opened with the Python API to learn which rows it could
still read (their embeddings equal the pristine device's); the rows among those that ``repair``
dropped are *intact rows deleted by repair*.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
import sqlite3
import traceback
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from fctkit.cli import main
from fctkit.edge_runtime import Device

DAMAGED_EXIT, ERROR_EXIT = 3, 2
EVERY_ROW = 5000
#: the primary classes, worst first; a trial gets the first that applies
OUTCOMES = ("traceback", "silent wrong", "reported", "refused", "unaffected")
#: flags the issue names as defects ("status exits non-zero when check would", "a damaged installed
#: bundle is repairable", "when repair itself fails it tells the user to run repair"); the other flags are reported only
DEFECT_FLAGS = ("status exit 0, check reports damage", "damaged bundle, no way back", "failed repair advises repair")


@dataclass(frozen=True)
class CliRun:
    """One `fctkit` command: its exit code, its output, and the exception that escaped (a traceback)."""

    code: int
    stdout: str
    stderr: str
    error: str = ""


def fctkit(*args: str) -> CliRun:
    """``fctkit ARGS`` in this process, the way the console script runs it (``main``)."""
    with CliRunner().isolation() as (stdout, stderr, _):
        code, error = 0, ""
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            code, error = -1, f"{type(exc).__name__}: {str(exc)[:160]} ({Path(frame.filename).name}:{frame.lineno})"
        return CliRun(
            code, stdout.getvalue().decode("utf-8", "replace"), stderr.getvalue().decode("utf-8", "replace"), error
        )


def query(root: Path, queries: Path) -> CliRun:
    """``device query`` ranking every row (k above the gallery's size): a label or a row gone shows in the answers."""
    return fctkit("device", "query", "--dir", str(root), "-k", str(EVERY_ROW), str(queries))


def answers_of(run: CliRun) -> list[list[tuple[str, float, str | None]]]:
    """The matches ``device query`` printed for an array of queries (one JSON list a line)."""
    return [
        [(m["item_id"], round(m["distance"], 4), m["label"]) for m in json.loads(line)]
        for line in run.stdout.splitlines()
    ]


@dataclass(frozen=True)
class Pristine:
    """An undamaged device directory and what a user sees on it."""

    root: Path
    enrolled: bool
    queries: Path  # a .npy of queries
    new_items: Path  # an .npz to `device add` after repair
    next_bundle: Path  # the newer bundle to `device upgrade --bundle` to after repair
    answers: list = field(default_factory=list)
    embeddings: dict[str, bytes] = field(default_factory=dict)  # item id -> embedding bytes
    pages: dict[int, str] = field(default_factory=dict)  # gallery.sqlite page -> the table or index it holds
    page_size: int = 4096

    @classmethod
    def of(cls, root: Path, *, enrolled: bool, queries: Path, new_items: Path, next_bundle: Path) -> Pristine:
        run = query(root, queries)
        assert run.code == 0 and not run.error, run
        with closing(sqlite3.connect(root / "gallery.sqlite")) as db:
            pages = dict(db.execute("SELECT pageno, name FROM dbstat"))
            (page_size,) = db.execute("PRAGMA page_size").fetchone()
        return cls(
            root,
            enrolled,
            queries,
            new_items,
            next_bundle,
            answers_of(run),
            readable_embeddings(root),
            pages,
            page_size,
        )

    def place(self, name: Path, offset: int) -> str:
        """The file, and for the gallery the table or index whose page holds ``offset``."""
        if str(name) != "gallery.sqlite":
            return str(name)
        return f"gallery.sqlite ({self.pages.get(offset // self.page_size + 1, 'free page')})"


def readable_embeddings(root: Path) -> dict[str, bytes]:
    """Item id -> embedding bytes of the rows the device can open (the Python API)."""
    with Device.open(root) as device:
        device.progress = False
        rows = device.searchable()[1]
        return {item: np.asarray(rows.embeddings[k], "<f4").tobytes() for k, item in enumerate(rows.item_ids)}


def _safe_embeddings(root: Path) -> dict[str, bytes] | None:
    try:
        return readable_embeddings(root)
    except Exception:
        return None


@dataclass
class Trial:
    """What one session on a damaged copy showed."""

    where: str
    runs: dict[str, CliRun] = field(default_factory=dict)
    outcome: str = ""
    flags: list[str] = field(default_factory=list)
    intact_deleted: list[str] = field(default_factory=list)

    def detail(self) -> str:
        errors = {name: run.error for name, run in self.runs.items() if run.error}
        codes = " ".join(f"{name}={run.code}" for name, run in self.runs.items())
        said = next(
            (
                f"{name} said {run.stderr.strip().splitlines()[-1][:200]!r}"
                for name, run in self.runs.items()
                if run.code == ERROR_EXIT and run.stderr.strip()
            ),
            "",
        )
        return f"{self.where}: {self.outcome} [{', '.join(self.flags)}] {codes} {errors or ''} {said}"[:900]


def session(pristine: Pristine, root: Path, where: str, genuine: Path | None = None) -> Trial:
    """The user's session on the damaged copy ``root`` of ``pristine``, classed. ``genuine``:
    the signed bundle whose installed copy was damaged, offered again after repair
    (``device upgrade --bundle``) as the way back the issue asks for."""
    trial, d = Trial(where), ("--dir", str(root))
    trial.runs["query"] = query(root, pristine.queries)
    trial.runs["status"] = fctkit("device", "status", *d)
    trial.runs["check"] = fctkit("device", "check", *d)
    readable = _safe_embeddings(root) or {}
    intact = {item for item, embedding in readable.items() if pristine.embeddings.get(item) == embedding}
    trial.runs["repair"] = fctkit("device", "repair", *d)
    after = _safe_embeddings(root)
    if genuine is not None:
        trial.runs["offer genuine bundle"] = fctkit("device", "upgrade", *d, "--bundle", str(genuine), "--quiet")
    trial.runs["query again"] = query(root, pristine.queries)
    trial.runs["upgrade"] = fctkit("device", "upgrade", *d, "--bundle", str(pristine.next_bundle), "--quiet")
    trial.runs["add"] = fctkit("device", "add", *d, str(pristine.new_items), "--no-upload", "--quiet")
    if after is not None:
        trial.intact_deleted = sorted(intact - set(after))
    _classify(trial, pristine, after is None)
    return trial


def _classify(trial: Trial, pristine: Pristine, unreadable_after_repair: bool) -> None:
    runs = trial.runs
    asked, status, check, repair = runs["query"], runs["status"], runs["check"], runs["repair"]
    first = (asked, status, check)
    answers = answers_of(asked) if asked.code == 0 and not asked.error else None
    if any(run.error for run in runs.values()):
        trial.outcome = "traceback"
    elif answers is not None and answers != pristine.answers:
        trial.outcome = "silent wrong"
    elif any(run.code == DAMAGED_EXIT for run in first):
        trial.outcome = "reported"
    elif any(run.code != 0 for run in first):
        trial.outcome = "refused"
    else:
        trial.outcome = "unaffected"
    flags = {
        "label null, exit 0": answers is not None and _labels_lost(answers, pristine.answers),
        "status exit 0, check reports damage": status.code == 0 and check.code == DAMAGED_EXIT,
        "check clean, another command fails": check.code == 0
        and any(runs[name].code == ERROR_EXIT for name in ("query", "status", "repair", "upgrade", "add")),
        "intact rows deleted by repair": bool(trial.intact_deleted),
        "repair failed": repair.code not in (0, DAMAGED_EXIT),
        "repair left damage": repair.code == DAMAGED_EXIT,
        "failed repair advises repair": repair.code != 0 and "device repair" in repair.stderr,
        "unreadable after repair": unreadable_after_repair,
        "upgrade fails after a clean repair": repair.code == 0 and runs["upgrade"].code != 0,
        "add fails after a clean repair": repair.code == 0 and runs["add"].code != 0,
        "damaged bundle, no way back": "offer genuine bundle" in runs
        and (runs["query again"].code != 0 or runs["upgrade"].code != 0),
        "full disk called damage": any("No space" in r.stderr and "damaged" in r.stderr for r in runs.values()),
    }
    trial.flags = [name for name, raised in flags.items() if raised]


def _labels_lost(answers: list, baseline: list) -> bool:
    labels = {item: label for found in baseline for item, _, label in found}
    return any(label is None and labels.get(item) is not None for found in answers for item, _, label in found)


@dataclass
class Tally:
    """Counts over trials: outcomes, flags, intact rows deleted, and the worst examples."""

    title: str
    outcomes: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)
    by_place: dict[str, Counter] = field(default_factory=dict)
    intact_rows_deleted: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def trials(self) -> int:
        return sum(self.outcomes.values())

    def add(self, trial: Trial, place: str) -> None:
        self.outcomes[trial.outcome] += 1
        self.flags.update(trial.flags)
        self.by_place.setdefault(place, Counter())[trial.outcome] += 1
        self.intact_rows_deleted += len(trial.intact_deleted)
        for kind in [trial.outcome, *trial.flags]:
            if kind not in ("reported", "refused", "unaffected"):
                self.examples.setdefault(kind, [])
                if len(self.examples[kind]) < 3:
                    self.examples[kind].append(trial.detail())

    def report(self) -> str:
        lines = [f"\n{self.title}: {self.trials} trials"]
        lines += [
            f"  {place:44s} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
            for place, c in sorted(self.by_place.items())
        ]
        lines.append("  total: " + ", ".join(f"{k} {self.outcomes[k]}" for k in OUTCOMES))
        lines.append("  flags: " + (", ".join(f"{k} {v}" for k, v in sorted(self.flags.items())) or "none"))
        lines.append(f"  intact rows deleted by repair: {self.intact_rows_deleted}")
        for kind, examples in sorted(self.examples.items()):
            lines += [f"  e.g. {kind}: {example}" for example in examples]
        return "\n".join(lines)

    def failures(self) -> list[str]:
        """What breaks the issue's targets: tracebacks, silent wrong answers, intact rows deleted,
        and the flags the issue names as defects (:data:`DEFECT_FLAGS`)."""
        bad = [f"{self.outcomes[k]} {k}" for k in ("traceback", "silent wrong") if self.outcomes[k]]
        if self.intact_rows_deleted:
            bad.append(f"{self.intact_rows_deleted} intact rows deleted by repair")
        return bad + [f"{self.flags[flag]} {flag}" for flag in DEFECT_FLAGS if self.flags[flag]]


def damaged_copy(pristine: Path, dest: Path) -> Path:
    if dest.exists():
        gc.collect()  # a connection a failed command left to the collector must not close (and delete -shm) mid-rmtree
        shutil.rmtree(dest)
    shutil.copytree(pristine, dest)
    return dest


def flip_bit(path: Path, rng: random.Random) -> int:
    """Flip one random bit of the file at ``path``; returns the byte offset."""
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    data[offset] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return offset


# -- targeted flips of the gallery's plaintext values ----------------------------------------


def gallery_cells(gallery: Path) -> dict[tuple[str, str], list[int]]:
    """(table, column) -> the rowids of the gallery's rows, for every table with rows (sqlite_sequence included)."""
    with closing(sqlite3.connect(gallery)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        cells = {}
        for table in tables:
            rowids = [r[0] for r in db.execute(f'SELECT rowid FROM "{table}"')]
            for column in (r[1] for r in db.execute(f'PRAGMA table_info("{table}")')):
                if rowids:
                    cells[(table, column)] = rowids
    return cells


def mutate(value: object, rng: random.Random, kind: int) -> tuple[object, str]:
    """One plausible alteration of a stored value, and what it was; ``kind`` picks among them."""
    if isinstance(value, int):
        bit = rng.randrange(min(max(value.bit_length(), 1) + 1, 62))
        return [(value + 1, "+1"), (value - 1, "-1"), (value ^ (1 << bit), f"bit {bit}")][kind % 3]
    if value is None:
        return 0, "NULL -> 0"
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
    if not raw:
        return (b"\xff" if isinstance(value, bytes) else "x"), "empty -> one byte"
    data, at = bytearray(raw), rng.randrange(len(raw))
    if isinstance(value, str):
        changes = [(0xFF, "invalid UTF-8"), (0x00, "NUL"), ((data[at] + 1) % 128 or 1, "one character")]
        data[at], what = changes[kind % 3]
        if what == "one character":
            return data.decode("utf-8", "replace"), f"{what} @ {at}"
        return bytes(data), f"{what} @ {at}"  # bytes: stored as a BLOB, as a damaged page would give back
    if kind % 3 == 2:
        data[at], what = 0x00, "NUL separator"
    else:
        bit = rng.randrange(8)
        data[at] ^= 1 << bit
        what = f"bit {bit}"
    return bytes(data), f"{what} @ {at}"


def alter_cell(gallery: Path, table: str, column: str, rowid: int, rng: random.Random, kind: int) -> str | None:
    """Alter one value in the (closed) gallery file, commit and close; what was done, or None when SQLite refused it."""
    db = sqlite3.connect(gallery)
    try:
        (value,) = db.execute(f'SELECT "{column}" FROM "{table}" WHERE rowid = ?', (rowid,)).fetchone()
        new, what = mutate(value, rng, kind)
        db.execute(f'UPDATE "{table}" SET "{column}" = ? WHERE rowid = ?', (new, rowid))
        db.commit()
        return what
    except sqlite3.IntegrityError:
        return None
    finally:
        db.close()
