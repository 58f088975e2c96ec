from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOB_STATE_UNSPECIFIED: _ClassVar[BlobState]
    BLOB_STATE_ABSENT: _ClassVar[BlobState]
    BLOB_STATE_PARTIAL: _ClassVar[BlobState]
    BLOB_STATE_STORED: _ClassVar[BlobState]
BLOB_STATE_UNSPECIFIED: BlobState
BLOB_STATE_ABSENT: BlobState
BLOB_STATE_PARTIAL: BlobState
BLOB_STATE_STORED: BlobState

class BlobInfo(_message.Message):
    __slots__ = ("sha256", "size", "item_id", "created_at")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    item_id: str
    created_at: str
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ..., item_id: _Optional[str] = ..., created_at: _Optional[str] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("sha256", "size", "item_id", "offset")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    item_id: str
    offset: int
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ..., item_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class UploadBlobRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class UploadBlobResponse(_message.Message):
    __slots__ = ("blob", "already_stored", "used_bytes", "quota_bytes")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    blob: BlobInfo
    already_stored: bool
    used_bytes: int
    quota_bytes: int
    def __init__(self, blob: _Optional[_Union[BlobInfo, _Mapping]] = ..., already_stored: _Optional[bool] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class DownloadBlobRequest(_message.Message):
    __slots__ = ("sha256", "offset", "chunk_size")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    offset: int
    chunk_size: int
    def __init__(self, sha256: _Optional[str] = ..., offset: _Optional[int] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class DownloadBlobResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BlobInfo
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[BlobInfo, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class StatBlobRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class StatBlobResponse(_message.Message):
    __slots__ = ("state", "received", "blob")
    STATE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    state: BlobState
    received: int
    blob: BlobInfo
    def __init__(self, state: _Optional[_Union[BlobState, str]] = ..., received: _Optional[int] = ..., blob: _Optional[_Union[BlobInfo, _Mapping]] = ...) -> None: ...

class ListBlobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "owner_id")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    owner_id: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., owner_id: _Optional[str] = ...) -> None: ...

class ListBlobsResponse(_message.Message):
    __slots__ = ("blobs", "next_page_token", "used_bytes", "quota_bytes")
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    blobs: _containers.RepeatedCompositeFieldContainer[BlobInfo]
    next_page_token: str
    used_bytes: int
    quota_bytes: int
    def __init__(self, blobs: _Optional[_Iterable[_Union[BlobInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class DeleteBlobRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class DeleteBlobResponse(_message.Message):
    __slots__ = ("used_bytes",)
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    def __init__(self, used_bytes: _Optional[int] = ...) -> None: ...

class SealedRecord(_message.Message):
    __slots__ = ("change_id", "item_id", "version", "origin_version", "via", "tombstone", "sealed", "sequence", "item_ids", "superseded")
    CHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    change_id: int
    item_id: str
    version: int
    origin_version: int
    via: str
    tombstone: bool
    sealed: bytes
    sequence: int
    item_ids: _containers.RepeatedScalarFieldContainer[str]
    superseded: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, change_id: _Optional[int] = ..., item_id: _Optional[str] = ..., version: _Optional[int] = ..., origin_version: _Optional[int] = ..., via: _Optional[str] = ..., tombstone: _Optional[bool] = ..., sealed: _Optional[bytes] = ..., sequence: _Optional[int] = ..., item_ids: _Optional[_Iterable[str]] = ..., superseded: _Optional[_Iterable[int]] = ...) -> None: ...

class PushRecordsRequest(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[SealedRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[SealedRecord, _Mapping]]] = ...) -> None: ...

class PushRecordsResponse(_message.Message):
    __slots__ = ("stored", "already_stored", "last_sequence", "sequences", "stored_rows", "already_stored_rows")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STORED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_ROWS_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_stored: int
    last_sequence: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    stored_rows: int
    already_stored_rows: int
    def __init__(self, stored: _Optional[int] = ..., already_stored: _Optional[int] = ..., last_sequence: _Optional[int] = ..., sequences: _Optional[_Iterable[int]] = ..., stored_rows: _Optional[int] = ..., already_stored_rows: _Optional[int] = ...) -> None: ...

class PullRecordsRequest(_message.Message):
    __slots__ = ("after_sequence", "owner_id")
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    after_sequence: int
    owner_id: str
    def __init__(self, after_sequence: _Optional[int] = ..., owner_id: _Optional[str] = ...) -> None: ...

class PullRecordsResponse(_message.Message):
    __slots__ = ("records", "last_sequence")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[SealedRecord]
    last_sequence: int
    def __init__(self, records: _Optional[_Iterable[_Union[SealedRecord, _Mapping]]] = ..., last_sequence: _Optional[int] = ...) -> None: ...
