from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpgradeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPGRADE_STATE_UNSPECIFIED: _ClassVar[UpgradeState]
    UPGRADE_STATE_IDLE: _ClassVar[UpgradeState]
    UPGRADE_STATE_DOWNLOADING: _ClassVar[UpgradeState]
    UPGRADE_STATE_UPGRADING: _ClassVar[UpgradeState]
    UPGRADE_STATE_BACKFILLING: _ClassVar[UpgradeState]
    UPGRADE_STATE_FAILED: _ClassVar[UpgradeState]
UPGRADE_STATE_UNSPECIFIED: UpgradeState
UPGRADE_STATE_IDLE: UpgradeState
UPGRADE_STATE_DOWNLOADING: UpgradeState
UPGRADE_STATE_UPGRADING: UpgradeState
UPGRADE_STATE_BACKFILLING: UpgradeState
UPGRADE_STATE_FAILED: UpgradeState

class CreateEnrolmentCodeRequest(_message.Message):
    __slots__ = ("ttl_seconds", "label", "owner")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    label: str
    owner: str
    def __init__(self, ttl_seconds: _Optional[int] = ..., label: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class CreateEnrolmentCodeResponse(_message.Message):
    __slots__ = ("code", "expires_at", "owner_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    code: str
    expires_at: str
    owner_id: str
    def __init__(self, code: _Optional[str] = ..., expires_at: _Optional[str] = ..., owner_id: _Optional[str] = ...) -> None: ...

class EnrolRequest(_message.Message):
    __slots__ = ("code", "device_name", "owner_key_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    code: str
    device_name: str
    owner_key_id: str
    def __init__(self, code: _Optional[str] = ..., device_name: _Optional[str] = ..., owner_key_id: _Optional[str] = ...) -> None: ...

class EnrolResponse(_message.Message):
    __slots__ = ("device_id", "token", "publisher_public_key", "publisher_key_id", "owner_id")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    token: str
    publisher_public_key: bytes
    publisher_key_id: str
    owner_id: str
    def __init__(self, device_id: _Optional[str] = ..., token: _Optional[str] = ..., publisher_public_key: _Optional[bytes] = ..., publisher_key_id: _Optional[str] = ..., owner_id: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("version", "gallery_size", "upgrade_state", "target_version", "progress", "detail", "root_version", "trust_stale", "seconds_since_fresh", "health", "reverted_from", "revert_method")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GALLERY_SIZE_FIELD_NUMBER: _ClassVar[int]
    UPGRADE_STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ROOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUST_STALE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_FRESH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    REVERTED_FROM_FIELD_NUMBER: _ClassVar[int]
    REVERT_METHOD_FIELD_NUMBER: _ClassVar[int]
    version: int
    gallery_size: int
    upgrade_state: UpgradeState
    target_version: int
    progress: float
    detail: str
    root_version: int
    trust_stale: bool
    seconds_since_fresh: int
    health: UpgradeHealth
    reverted_from: int
    revert_method: str
    def __init__(self, version: _Optional[int] = ..., gallery_size: _Optional[int] = ..., upgrade_state: _Optional[_Union[UpgradeState, str]] = ..., target_version: _Optional[int] = ..., progress: _Optional[float] = ..., detail: _Optional[str] = ..., root_version: _Optional[int] = ..., trust_stale: _Optional[bool] = ..., seconds_since_fresh: _Optional[int] = ..., health: _Optional[_Union[UpgradeHealth, _Mapping]] = ..., reverted_from: _Optional[int] = ..., revert_method: _Optional[str] = ...) -> None: ...

class UpgradeHealth(_message.Message):
    __slots__ = ("version", "rows_upgraded", "failures", "seconds", "sample_size", "mean_cosine", "p10_cosine", "recall_at_1", "mean_reciprocal_rank", "median_rank", "gallery_rows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_UPGRADED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEAN_COSINE_FIELD_NUMBER: _ClassVar[int]
    P10_COSINE_FIELD_NUMBER: _ClassVar[int]
    RECALL_AT_1_FIELD_NUMBER: _ClassVar[int]
    MEAN_RECIPROCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_RANK_FIELD_NUMBER: _ClassVar[int]
    GALLERY_ROWS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rows_upgraded: int
    failures: int
    seconds: float
    sample_size: int
    mean_cosine: float
    p10_cosine: float
    recall_at_1: float
    mean_reciprocal_rank: float
    median_rank: float
    gallery_rows: int
    def __init__(self, version: _Optional[int] = ..., rows_upgraded: _Optional[int] = ..., failures: _Optional[int] = ..., seconds: _Optional[float] = ..., sample_size: _Optional[int] = ..., mean_cosine: _Optional[float] = ..., p10_cosine: _Optional[float] = ..., recall_at_1: _Optional[float] = ..., mean_reciprocal_rank: _Optional[float] = ..., median_rank: _Optional[float] = ..., gallery_rows: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("recorded_at", "latest_version")
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    recorded_at: str
    latest_version: int
    def __init__(self, recorded_at: _Optional[str] = ..., latest_version: _Optional[int] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("device_id", "name", "label", "enrolled_at", "last_report_at", "version", "gallery_size", "upgrade_state", "target_version", "progress", "detail", "vault_bytes", "vault_blobs", "owner_id", "revoked_at", "root_version", "trust_stale", "seconds_since_fresh")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ENROLLED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GALLERY_SIZE_FIELD_NUMBER: _ClassVar[int]
    UPGRADE_STATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    VAULT_BYTES_FIELD_NUMBER: _ClassVar[int]
    VAULT_BLOBS_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    ROOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUST_STALE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_FRESH_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    name: str
    label: str
    enrolled_at: str
    last_report_at: str
    version: int
    gallery_size: int
    upgrade_state: UpgradeState
    target_version: int
    progress: float
    detail: str
    vault_bytes: int
    vault_blobs: int
    owner_id: str
    revoked_at: str
    root_version: int
    trust_stale: bool
    seconds_since_fresh: int
    def __init__(self, device_id: _Optional[str] = ..., name: _Optional[str] = ..., label: _Optional[str] = ..., enrolled_at: _Optional[str] = ..., last_report_at: _Optional[str] = ..., version: _Optional[int] = ..., gallery_size: _Optional[int] = ..., upgrade_state: _Optional[_Union[UpgradeState, str]] = ..., target_version: _Optional[int] = ..., progress: _Optional[float] = ..., detail: _Optional[str] = ..., vault_bytes: _Optional[int] = ..., vault_blobs: _Optional[int] = ..., owner_id: _Optional[str] = ..., revoked_at: _Optional[str] = ..., root_version: _Optional[int] = ..., trust_stale: _Optional[bool] = ..., seconds_since_fresh: _Optional[int] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "version", "upgrade_state", "stale_seconds", "owner_id")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPGRADE_STATE_FIELD_NUMBER: _ClassVar[int]
    STALE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    version: int
    upgrade_state: UpgradeState
    stale_seconds: int
    owner_id: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., version: _Optional[int] = ..., upgrade_state: _Optional[_Union[UpgradeState, str]] = ..., stale_seconds: _Optional[int] = ..., owner_id: _Optional[str] = ...) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices", "next_page_token")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    next_page_token: str
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RevokeDeviceRequest(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class RevokeDeviceResponse(_message.Message):
    __slots__ = ("revoked_at",)
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    revoked_at: str
    def __init__(self, revoked_at: _Optional[str] = ...) -> None: ...
