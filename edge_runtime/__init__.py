"""fctkit.edge_runtime — the on-device library. Runs without torch (numpy, onnxruntime,
grpcio, cryptography; faiss optional).

- :class:`Device` — a device directory: key, encrypted gallery, installed bundles, sync/upgrade;
  :meth:`Device.add_items` / :meth:`Device.query_items` take raw items (image file bytes, texts)
  when the installed bundle declares preprocessing (:mod:`.adding`; files read by :mod:`.item_sources`).
- :class:`Gallery` — the encrypted SQLite gallery (rows sealed with AES-256-GCM).
- :class:`Engine` — a verified bundle's ONNX graphs on ONNX Runtime (TensorRT → CUDA → CPU).
- :meth:`Device.backfill` — partial backfill from the vault (:mod:`.backfill`, :class:`BackfillResult`).
- :class:`Window` — bounds one upgrade or backfill call (seconds, rows) for background windows, with a
  progress callback; a spent window pauses it and the next call resumes (:mod:`.work_window`).
- :meth:`Device.sync` / :meth:`Device.replicate` — the owner's encrypted gallery replica
  (:mod:`.replication`, :class:`ReplicationResult`; records in :mod:`.records`);
  :meth:`Device.export_owner_key` and ``Device.init(owner_key_file=...)`` share the owner key.
- :class:`ExactIndex` — exact k-NN (numpy, or faiss when installed) with the bundle's distance.
- :mod:`.compatible_search` — search in "compatible" mode (BCT/BT²/CoReS bundles): older versions'
  rows as stored, compared on the manifest's prefix (:func:`comparable_dims`, :func:`compatible_rows`).
"""

from .adding import AddedItems
from .backfill import ORDERINGS, BackfillResult
from .compatible_search import comparable_dims, compatible_rows
from .device import Device, DeviceSettings, Match, SyncResult
from .engine import Engine, EngineConfig, select_providers
from .gallery import Gallery
from .gallery.rows import LoadedRows, NewRow, VersionTag
from .replication import ReplicationResult
from .search import ExactIndex, Neighbours
from .upgrade import run_upgrade
from .upgrade_plan import Hop, UpgradePlan
from .work_window import PAUSED_EXIT, Window

__all__ = [
    "ORDERINGS",
    "PAUSED_EXIT",
    "AddedItems",
    "BackfillResult",
    "Device",
    "DeviceSettings",
    "Engine",
    "EngineConfig",
    "ExactIndex",
    "Gallery",
    "Hop",
    "LoadedRows",
    "Match",
    "Neighbours",
    "NewRow",
    "ReplicationResult",
    "SyncResult",
    "UpgradePlan",
    "VersionTag",
    "Window",
    "comparable_dims",
    "compatible_rows",
    "run_upgrade",
    "select_providers",
]
