# mypy: ignore-errors
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_STATE_UNSPECIFIED: _ClassVar[ProbeState]
    ESTABLISHED: _ClassVar[ProbeState]
    ESTABLISHED_ABSENT: _ClassVar[ProbeState]
    UNKNOWN: _ClassVar[ProbeState]

class CancelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CANCEL_STATE_UNSPECIFIED: _ClassVar[CancelState]
    FENCED: _ClassVar[CancelState]
    CANCELLED: _ClassVar[CancelState]
    ALREADY_APPLIED: _ClassVar[CancelState]
    ALREADY_ABSENT: _ClassVar[CancelState]
    NOT_CANCELLABLE: _ClassVar[CancelState]
PROBE_STATE_UNSPECIFIED: ProbeState
ESTABLISHED: ProbeState
ESTABLISHED_ABSENT: ProbeState
UNKNOWN: ProbeState
CANCEL_STATE_UNSPECIFIED: CancelState
FENCED: CancelState
CANCELLED: CancelState
ALREADY_APPLIED: CancelState
ALREADY_ABSENT: CancelState
NOT_CANCELLABLE: CancelState

class InvokeRequest(_message.Message):
    __slots__ = ("tool", "arguments_json", "effect_key", "operation_id", "attempt_id", "deadline_epoch_s", "trajectory_id", "call_id", "fence")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_EPOCH_S_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    tool: str
    arguments_json: str
    effect_key: str
    operation_id: str
    attempt_id: str
    deadline_epoch_s: float
    trajectory_id: str
    call_id: str
    fence: int
    def __init__(self, tool: _Optional[str] = ..., arguments_json: _Optional[str] = ..., effect_key: _Optional[str] = ..., operation_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., deadline_epoch_s: _Optional[float] = ..., trajectory_id: _Optional[str] = ..., call_id: _Optional[str] = ..., fence: _Optional[int] = ...) -> None: ...

class InvokeReply(_message.Message):
    __slots__ = ("result_json", "deduplicated", "effect_key")
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    result_json: str
    deduplicated: bool
    effect_key: str
    def __init__(self, result_json: _Optional[str] = ..., deduplicated: _Optional[bool] = ..., effect_key: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("tool", "effect_key")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    tool: str
    effect_key: str
    def __init__(self, tool: _Optional[str] = ..., effect_key: _Optional[str] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("state", "result_json", "fence", "detail")
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: ProbeState
    result_json: str
    fence: int
    detail: str
    def __init__(self, state: _Optional[_Union[ProbeState, str]] = ..., result_json: _Optional[str] = ..., fence: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("tool", "effect_key")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    tool: str
    effect_key: str
    def __init__(self, tool: _Optional[str] = ..., effect_key: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("state", "fence", "detail")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: CancelState
    fence: int
    detail: str
    def __init__(self, state: _Optional[_Union[CancelState, str]] = ..., fence: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
