"""fctkit.server — the gRPC server: registry, artifact streaming, encrypted image vault, fleet;
on one data directory (SQLite + files) or as replicas over PostgreSQL + S3 (``ScaleOutStorage``).

Run it with ``fctkit serve`` (see :mod:`fctkit.server.cli`) or in-process::

    server = FctkitServer(ServerConfig(data_dir=..., publisher_key=..., port=0))
    port = await server.start(); ...; await server.stop()
"""

from fctkit.protos.planner import PlannedHop, plan_upgrade
from fctkit.server.app import FctkitServer, ServerConfig, serve
from fctkit.server.scale_out import ScaleOutStorage
from fctkit.server.storage import SqliteStorage, Storage

__all__ = [
    "FctkitServer",
    "PlannedHop",
    "ScaleOutStorage",
    "ServerConfig",
    "SqliteStorage",
    "Storage",
    "plan_upgrade",
    "serve",
]
