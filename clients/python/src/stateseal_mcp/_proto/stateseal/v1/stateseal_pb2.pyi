from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPEN_MODE_CONSUME: _ClassVar[OpenMode]
    OPEN_MODE_RESERVE: _ClassVar[OpenMode]
OPEN_MODE_CONSUME: OpenMode
OPEN_MODE_RESERVE: OpenMode

class Binding(_message.Message):
    __slots__ = ("subject", "method", "params_digest", "params_json", "binding_version")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    BINDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    subject: str
    method: str
    params_digest: bytes
    params_json: str
    binding_version: int
    def __init__(self, subject: _Optional[str] = ..., method: _Optional[str] = ..., params_digest: _Optional[bytes] = ..., params_json: _Optional[str] = ..., binding_version: _Optional[int] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("binding", "state", "ttl_seconds", "single_use", "input_requests_json")
    BINDING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_USE_FIELD_NUMBER: _ClassVar[int]
    INPUT_REQUESTS_JSON_FIELD_NUMBER: _ClassVar[int]
    binding: Binding
    state: bytes
    ttl_seconds: int
    single_use: bool
    input_requests_json: str
    def __init__(self, binding: _Optional[_Union[Binding, _Mapping]] = ..., state: _Optional[bytes] = ..., ttl_seconds: _Optional[int] = ..., single_use: _Optional[bool] = ..., input_requests_json: _Optional[str] = ...) -> None: ...

class SealResponse(_message.Message):
    __slots__ = ("request_state", "expires_at_unix", "key_id")
    REQUEST_STATE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    request_state: str
    expires_at_unix: int
    key_id: str
    def __init__(self, request_state: _Optional[str] = ..., expires_at_unix: _Optional[int] = ..., key_id: _Optional[str] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("request_state", "binding", "mode", "lease_seconds", "attempt_id", "input_responses_json", "commit")
    REQUEST_STATE_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_RESPONSES_JSON_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    request_state: str
    binding: Binding
    mode: OpenMode
    lease_seconds: int
    attempt_id: str
    input_responses_json: str
    commit: str
    def __init__(self, request_state: _Optional[str] = ..., binding: _Optional[_Union[Binding, _Mapping]] = ..., mode: _Optional[_Union[OpenMode, str]] = ..., lease_seconds: _Optional[int] = ..., attempt_id: _Optional[str] = ..., input_responses_json: _Optional[str] = ..., commit: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("state", "expires_at_unix", "key_id", "consumed", "reservation", "lease_expires_at_unix", "lease_seconds", "input_responses_json", "dropped", "commits")
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_RESPONSES_JSON_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    expires_at_unix: int
    key_id: str
    consumed: bool
    reservation: str
    lease_expires_at_unix: int
    lease_seconds: int
    input_responses_json: str
    dropped: _containers.RepeatedCompositeFieldContainer[DroppedResponse]
    commits: _containers.RepeatedCompositeFieldContainer[CommitOutcome]
    def __init__(self, state: _Optional[bytes] = ..., expires_at_unix: _Optional[int] = ..., key_id: _Optional[str] = ..., consumed: _Optional[bool] = ..., reservation: _Optional[str] = ..., lease_expires_at_unix: _Optional[int] = ..., lease_seconds: _Optional[int] = ..., input_responses_json: _Optional[str] = ..., dropped: _Optional[_Iterable[_Union[DroppedResponse, _Mapping]]] = ..., commits: _Optional[_Iterable[_Union[CommitOutcome, _Mapping]]] = ...) -> None: ...

class CommitOutcome(_message.Message):
    __slots__ = ("reason", "code")
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    code: int
    def __init__(self, reason: _Optional[str] = ..., code: _Optional[int] = ...) -> None: ...

class DroppedResponse(_message.Message):
    __slots__ = ("key", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    reason: str
    def __init__(self, key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation",)
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    reservation: str
    def __init__(self, reservation: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("reservation", "lease_seconds")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reservation: str
    lease_seconds: int
    def __init__(self, reservation: _Optional[str] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease_expires_at_unix", "lease_seconds")
    LEASE_EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at_unix: int
    lease_seconds: int
    def __init__(self, lease_expires_at_unix: _Optional[int] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation",)
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    reservation: str
    def __init__(self, reservation: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
