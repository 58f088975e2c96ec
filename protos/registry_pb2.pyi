from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_ACTION_UNSPECIFIED: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_PAUSE: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_RESUME: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_COMPLETE: _ClassVar[RolloutAction]
ROLLOUT_ACTION_UNSPECIFIED: RolloutAction
ROLLOUT_ACTION_PAUSE: RolloutAction
ROLLOUT_ACTION_RESUME: RolloutAction
ROLLOUT_ACTION_COMPLETE: RolloutAction

class ArtifactInfo(_message.Message):
    __slots__ = ("name", "role", "file", "sha256", "size", "source_version", "target_version", "precision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    file: str
    sha256: str
    size: int
    source_version: int
    target_version: int
    precision: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., file: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., source_version: _Optional[int] = ..., target_version: _Optional[int] = ..., precision: _Optional[str] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("version", "parents", "mode", "distance", "normalize", "embedding_dim", "side_info_dim", "artifacts", "created_at", "published_at", "publisher_key_id", "manifest_sha256", "gate_forced")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    SIDE_INFO_DIM_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    GATE_FORCED_FIELD_NUMBER: _ClassVar[int]
    version: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    mode: str
    distance: str
    normalize: bool
    embedding_dim: int
    side_info_dim: int
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    created_at: str
    published_at: str
    publisher_key_id: str
    manifest_sha256: str
    gate_forced: bool
    def __init__(self, version: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ..., mode: _Optional[str] = ..., distance: _Optional[str] = ..., normalize: _Optional[bool] = ..., embedding_dim: _Optional[int] = ..., side_info_dim: _Optional[int] = ..., artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ..., created_at: _Optional[str] = ..., published_at: _Optional[str] = ..., publisher_key_id: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., gate_forced: _Optional[bool] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("after_version", "page_size", "known_timestamp_version")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TIMESTAMP_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    page_size: int
    known_timestamp_version: int
    def __init__(self, after_version: _Optional[int] = ..., page_size: _Optional[int] = ..., known_timestamp_version: _Optional[int] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions", "more", "latest_version", "timestamp", "latest_root_version", "withdrawals", "confirmed_versions", "timestamp_unchanged")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWALS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    more: bool
    latest_version: int
    timestamp: bytes
    latest_root_version: int
    withdrawals: _containers.RepeatedScalarFieldContainer[bytes]
    confirmed_versions: _containers.RepeatedScalarFieldContainer[int]
    timestamp_unchanged: bool
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., more: _Optional[bool] = ..., latest_version: _Optional[int] = ..., timestamp: _Optional[bytes] = ..., latest_root_version: _Optional[int] = ..., withdrawals: _Optional[_Iterable[bytes]] = ..., confirmed_versions: _Optional[_Iterable[int]] = ..., timestamp_unchanged: _Optional[bool] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("version", "manifest", "signature", "co_signatures")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CO_SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: bytes
    signature: bytes
    co_signatures: bytes
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., co_signatures: _Optional[bytes] = ...) -> None: ...

class PlanUpgradeRequest(_message.Message):
    __slots__ = ("from_version", "to_version")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    to_version: int
    def __init__(self, from_version: _Optional[int] = ..., to_version: _Optional[int] = ...) -> None: ...

class UpgradeHop(_message.Message):
    __slots__ = ("source_version", "target_version", "bundle_version", "identity", "forward", "side_forward")
    SOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    SIDE_FORWARD_FIELD_NUMBER: _ClassVar[int]
    source_version: int
    target_version: int
    bundle_version: int
    identity: bool
    forward: ArtifactInfo
    side_forward: ArtifactInfo
    def __init__(self, source_version: _Optional[int] = ..., target_version: _Optional[int] = ..., bundle_version: _Optional[int] = ..., identity: _Optional[bool] = ..., forward: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., side_forward: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

class PlanUpgradeResponse(_message.Message):
    __slots__ = ("from_version", "to_version", "hops")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    to_version: int
    hops: _containers.RepeatedCompositeFieldContainer[UpgradeHop]
    def __init__(self, from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., hops: _Optional[_Iterable[_Union[UpgradeHop, _Mapping]]] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("version", "artifact_name", "offset", "chunk_size")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    version: int
    artifact_name: str
    offset: int
    chunk_size: int
    def __init__(self, version: _Optional[int] = ..., artifact_name: _Optional[str] = ..., offset: _Optional[int] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class ArtifactHeader(_message.Message):
    __slots__ = ("version", "artifact", "offset")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    version: int
    artifact: ArtifactInfo
    offset: int
    def __init__(self, version: _Optional[int] = ..., artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class DownloadArtifactResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ArtifactHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[ArtifactHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...

class KeepAlive(_message.Message):
    __slots__ = ("server_time", "latest_version")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    server_time: str
    latest_version: int
    def __init__(self, server_time: _Optional[str] = ..., latest_version: _Optional[int] = ...) -> None: ...

class WatchVersionsResponse(_message.Message):
    __slots__ = ("published", "keepalive")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    published: VersionInfo
    keepalive: KeepAlive
    def __init__(self, published: _Optional[_Union[VersionInfo, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAlive, _Mapping]] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("archive_size", "archive_sha256", "rollout_percent", "rollout_no_guard")
    ARCHIVE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_PERCENT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_NO_GUARD_FIELD_NUMBER: _ClassVar[int]
    archive_size: int
    archive_sha256: str
    rollout_percent: float
    rollout_no_guard: bool
    def __init__(self, archive_size: _Optional[int] = ..., archive_sha256: _Optional[str] = ..., rollout_percent: _Optional[float] = ..., rollout_no_guard: _Optional[bool] = ...) -> None: ...

class PublishBundleRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class PublishBundleResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ...) -> None: ...

class GetTrustRequest(_message.Message):
    __slots__ = ("after_root_version",)
    AFTER_ROOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_root_version: int
    def __init__(self, after_root_version: _Optional[int] = ...) -> None: ...

class GetTrustResponse(_message.Message):
    __slots__ = ("roots", "latest_root_version", "timestamp")
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    roots: _containers.RepeatedScalarFieldContainer[bytes]
    latest_root_version: int
    timestamp: bytes
    def __init__(self, roots: _Optional[_Iterable[bytes]] = ..., latest_root_version: _Optional[int] = ..., timestamp: _Optional[bytes] = ...) -> None: ...

class PublishRootRequest(_message.Message):
    __slots__ = ("root",)
    ROOT_FIELD_NUMBER: _ClassVar[int]
    root: bytes
    def __init__(self, root: _Optional[bytes] = ...) -> None: ...

class PublishRootResponse(_message.Message):
    __slots__ = ("root_version", "fingerprint")
    ROOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    root_version: int
    fingerprint: str
    def __init__(self, root_version: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class RolloutCohort(_message.Message):
    __slots__ = ("device_ids",)
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutGuard(_message.Message):
    __slots__ = ("halt_below", "halt_min_devices", "measure", "max_failure_rate")
    HALT_BELOW_FIELD_NUMBER: _ClassVar[int]
    HALT_MIN_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    MAX_FAILURE_RATE_FIELD_NUMBER: _ClassVar[int]
    halt_below: float
    halt_min_devices: int
    measure: str
    max_failure_rate: float
    def __init__(self, halt_below: _Optional[float] = ..., halt_min_devices: _Optional[int] = ..., measure: _Optional[str] = ..., max_failure_rate: _Optional[float] = ...) -> None: ...

class SetRolloutRequest(_message.Message):
    __slots__ = ("version", "percent", "action", "cohort", "guard", "remove_guard")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    COHORT_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_GUARD_FIELD_NUMBER: _ClassVar[int]
    version: int
    percent: float
    action: RolloutAction
    cohort: RolloutCohort
    guard: RolloutGuard
    remove_guard: bool
    def __init__(self, version: _Optional[int] = ..., percent: _Optional[float] = ..., action: _Optional[_Union[RolloutAction, str]] = ..., cohort: _Optional[_Union[RolloutCohort, _Mapping]] = ..., guard: _Optional[_Union[RolloutGuard, _Mapping]] = ..., remove_guard: _Optional[bool] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class HealthSummary(_message.Message):
    __slots__ = ("devices", "median", "min", "p10")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    P10_FIELD_NUMBER: _ClassVar[int]
    devices: int
    median: float
    min: float
    p10: float
    def __init__(self, devices: _Optional[int] = ..., median: _Optional[float] = ..., min: _Optional[float] = ..., p10: _Optional[float] = ...) -> None: ...

class RolloutStage(_message.Message):
    __slots__ = ("stage", "percent", "started_at", "offered", "downloaded", "upgraded", "failed", "reverted", "health", "recall_at_1", "expected_shortfall", "median_rank", "mean_reciprocal_rank", "revert_methods")
    class RevertMethodsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADED_FIELD_NUMBER: _ClassVar[int]
    UPGRADED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REVERTED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RECALL_AT_1_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHORTFALL_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_RANK_FIELD_NUMBER: _ClassVar[int]
    MEAN_RECIPROCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    REVERT_METHODS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    percent: float
    started_at: str
    offered: int
    downloaded: int
    upgraded: int
    failed: int
    reverted: int
    health: HealthSummary
    recall_at_1: HealthSummary
    expected_shortfall: HealthSummary
    median_rank: HealthSummary
    mean_reciprocal_rank: HealthSummary
    revert_methods: _containers.ScalarMap[str, int]
    def __init__(self, stage: _Optional[int] = ..., percent: _Optional[float] = ..., started_at: _Optional[str] = ..., offered: _Optional[int] = ..., downloaded: _Optional[int] = ..., upgraded: _Optional[int] = ..., failed: _Optional[int] = ..., reverted: _Optional[int] = ..., health: _Optional[_Union[HealthSummary, _Mapping]] = ..., recall_at_1: _Optional[_Union[HealthSummary, _Mapping]] = ..., expected_shortfall: _Optional[_Union[HealthSummary, _Mapping]] = ..., median_rank: _Optional[_Union[HealthSummary, _Mapping]] = ..., mean_reciprocal_rank: _Optional[_Union[HealthSummary, _Mapping]] = ..., revert_methods: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("version", "state", "percent", "cohort_size", "halt_below", "halt_min_devices", "halt_reason", "stages", "gate_cases_json", "updated_at", "withdrawn_reason", "revert_to", "confirmed_at", "gate_override_reason", "guard_measure", "health_expectation_json", "max_failure_rate", "failure_rate", "failure_owners")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    COHORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    HALT_BELOW_FIELD_NUMBER: _ClassVar[int]
    HALT_MIN_DEVICES_FIELD_NUMBER: _ClassVar[int]
    HALT_REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    GATE_CASES_JSON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_REASON_FIELD_NUMBER: _ClassVar[int]
    REVERT_TO_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_AT_FIELD_NUMBER: _ClassVar[int]
    GATE_OVERRIDE_REASON_FIELD_NUMBER: _ClassVar[int]
    GUARD_MEASURE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_EXPECTATION_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_FAILURE_RATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_RATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_OWNERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: str
    percent: float
    cohort_size: int
    halt_below: float
    halt_min_devices: int
    halt_reason: str
    stages: _containers.RepeatedCompositeFieldContainer[RolloutStage]
    gate_cases_json: str
    updated_at: str
    withdrawn_reason: str
    revert_to: int
    confirmed_at: str
    gate_override_reason: str
    guard_measure: str
    health_expectation_json: str
    max_failure_rate: float
    failure_rate: float
    failure_owners: int
    def __init__(self, version: _Optional[int] = ..., state: _Optional[str] = ..., percent: _Optional[float] = ..., cohort_size: _Optional[int] = ..., halt_below: _Optional[float] = ..., halt_min_devices: _Optional[int] = ..., halt_reason: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[RolloutStage, _Mapping]]] = ..., gate_cases_json: _Optional[str] = ..., updated_at: _Optional[str] = ..., withdrawn_reason: _Optional[str] = ..., revert_to: _Optional[int] = ..., confirmed_at: _Optional[str] = ..., gate_override_reason: _Optional[str] = ..., guard_measure: _Optional[str] = ..., health_expectation_json: _Optional[str] = ..., max_failure_rate: _Optional[float] = ..., failure_rate: _Optional[float] = ..., failure_owners: _Optional[int] = ...) -> None: ...

class ConfirmVersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class WithdrawRequest(_message.Message):
    __slots__ = ("withdrawal",)
    WITHDRAWAL_FIELD_NUMBER: _ClassVar[int]
    withdrawal: bytes
    def __init__(self, withdrawal: _Optional[bytes] = ...) -> None: ...

class WithdrawResponse(_message.Message):
    __slots__ = ("version", "revert_to")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REVERT_TO_FIELD_NUMBER: _ClassVar[int]
    version: int
    revert_to: int
    def __init__(self, version: _Optional[int] = ..., revert_to: _Optional[int] = ...) -> None: ...
