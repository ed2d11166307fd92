# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LedgerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Environment(_message.Message):
    __slots__ = ("env_id", "tenant", "effect_key", "allocated_at", "released_at", "billed_seconds")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_AT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_FIELD_NUMBER: _ClassVar[int]
    BILLED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    tenant: str
    effect_key: str
    allocated_at: float
    released_at: float
    billed_seconds: float
    def __init__(self, env_id: _Optional[str] = ..., tenant: _Optional[str] = ..., effect_key: _Optional[str] = ..., allocated_at: _Optional[float] = ..., released_at: _Optional[float] = ..., billed_seconds: _Optional[float] = ...) -> None: ...

class Notification(_message.Message):
    __slots__ = ("notification_id", "recipient", "message", "effect_key", "sent_at")
    NOTIFICATION_ID_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    notification_id: str
    recipient: str
    message: str
    effect_key: str
    sent_at: float
    def __init__(self, notification_id: _Optional[str] = ..., recipient: _Optional[str] = ..., message: _Optional[str] = ..., effect_key: _Optional[str] = ..., sent_at: _Optional[float] = ...) -> None: ...

class EffectCount(_message.Message):
    __slots__ = ("tool", "effect_key", "applications")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    APPLICATIONS_FIELD_NUMBER: _ClassVar[int]
    tool: str
    effect_key: str
    applications: int
    def __init__(self, tool: _Optional[str] = ..., effect_key: _Optional[str] = ..., applications: _Optional[int] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("seq", "tool", "effect_key", "call_id", "attempt_id", "operation_id", "trajectory_id", "arrived_at", "prior", "disposition", "reply", "deadline", "disposed_at")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_AT_FIELD_NUMBER: _ClassVar[int]
    PRIOR_FIELD_NUMBER: _ClassVar[int]
    DISPOSITION_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DISPOSED_AT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tool: str
    effect_key: str
    call_id: str
    attempt_id: str
    operation_id: str
    trajectory_id: str
    arrived_at: float
    prior: str
    disposition: str
    reply: str
    deadline: float
    disposed_at: float
    def __init__(self, seq: _Optional[int] = ..., tool: _Optional[str] = ..., effect_key: _Optional[str] = ..., call_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., arrived_at: _Optional[float] = ..., prior: _Optional[str] = ..., disposition: _Optional[str] = ..., reply: _Optional[str] = ..., deadline: _Optional[float] = ..., disposed_at: _Optional[float] = ...) -> None: ...

class Note(_message.Message):
    __slots__ = ("note_id", "title", "effect_key", "written_at", "deleted_at")
    NOTE_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_AT_FIELD_NUMBER: _ClassVar[int]
    DELETED_AT_FIELD_NUMBER: _ClassVar[int]
    note_id: str
    title: str
    effect_key: str
    written_at: float
    deleted_at: float
    def __init__(self, note_id: _Optional[str] = ..., title: _Optional[str] = ..., effect_key: _Optional[str] = ..., written_at: _Optional[float] = ..., deleted_at: _Optional[float] = ...) -> None: ...

class NoteRead(_message.Message):
    __slots__ = ("note_id", "effect_key", "read_at")
    NOTE_ID_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    READ_AT_FIELD_NUMBER: _ClassVar[int]
    note_id: str
    effect_key: str
    read_at: float
    def __init__(self, note_id: _Optional[str] = ..., effect_key: _Optional[str] = ..., read_at: _Optional[float] = ...) -> None: ...

class LedgerReply(_message.Message):
    __slots__ = ("environments", "notifications", "effects", "billed_seconds", "test_runs", "searches", "deliveries", "effect_keys", "notes", "note_reads")
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    EFFECTS_FIELD_NUMBER: _ClassVar[int]
    BILLED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TEST_RUNS_FIELD_NUMBER: _ClassVar[int]
    SEARCHES_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEYS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    NOTE_READS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[Environment]
    notifications: _containers.RepeatedCompositeFieldContainer[Notification]
    effects: _containers.RepeatedCompositeFieldContainer[EffectCount]
    billed_seconds: float
    test_runs: int
    searches: int
    deliveries: _containers.RepeatedCompositeFieldContainer[Delivery]
    effect_keys: str
    notes: _containers.RepeatedCompositeFieldContainer[Note]
    note_reads: _containers.RepeatedCompositeFieldContainer[NoteRead]
    def __init__(self, environments: _Optional[_Iterable[_Union[Environment, _Mapping]]] = ..., notifications: _Optional[_Iterable[_Union[Notification, _Mapping]]] = ..., effects: _Optional[_Iterable[_Union[EffectCount, _Mapping]]] = ..., billed_seconds: _Optional[float] = ..., test_runs: _Optional[int] = ..., searches: _Optional[int] = ..., deliveries: _Optional[_Iterable[_Union[Delivery, _Mapping]]] = ..., effect_keys: _Optional[str] = ..., notes: _Optional[_Iterable[_Union[Note, _Mapping]]] = ..., note_reads: _Optional[_Iterable[_Union[NoteRead, _Mapping]]] = ...) -> None: ...

class SetFaultsRequest(_message.Message):
    __slots__ = ("service", "plan_json")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    service: str
    plan_json: str
    def __init__(self, service: _Optional[str] = ..., plan_json: _Optional[str] = ...) -> None: ...

class SetFaultsReply(_message.Message):
    __slots__ = ("applied_json",)
    APPLIED_JSON_FIELD_NUMBER: _ClassVar[int]
    applied_json: str
    def __init__(self, applied_json: _Optional[str] = ...) -> None: ...
