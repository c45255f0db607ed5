"""The records the broker keeps on disk: one typed schema for the journal and the snapshot.

Every record is a msgspec Struct tagged by ``kind`` and validated as it is read, with the
wire protocol's own bounded types, so a damaged record that still decodes but no longer
makes sense (an unknown key, a negative size, a pool name with a flipped bit that breaks its
pattern) is refused like a record whose checksum fails (see ``checkpoint``).

* ``SessionRecord``: everything needed to restore a session (identity and holdings);
* ``HoldRecord``: a session's new holdings (absolute, so a replay is idempotent);
* ``CloseRecord``: a session ended;
* ``LimitRecord`` / ``UnlimitRecord``: an instance's limits changed or were dropped;
* ``FenceRecord``: an evicted session's token, refused from then on.

Units: ``*_bytes`` ints of bytes, ``*_pages`` ints of pages.
"""

from __future__ import annotations

from typing import Annotated, Union

from msgspec import Meta, Struct

from ..client import protocol as proto
from .accounts import LimitSource

Ticks = Annotated[int, Meta(ge=0)]
Uid = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
Seq = Annotated[int, Meta(ge=0)]


class Record(Struct, tag_field="kind", kw_only=True, forbid_unknown_fields=True, gc=False):
    #: Position in the journal since the first snapshot; a snapshot holds every record up to its own.
    seq: Seq = 0


class SessionRecord(Record, tag="session", kw_only=True):
    id: proto.PublicId
    token: proto.Token
    nonce: proto.Token
    instance: proto.Name
    pid: proto.Pid
    pid_verified: bool
    pid_start_ticks: Ticks | None = None
    uid: Uid | None = None
    rank: Annotated[int, Meta(ge=0, lt=proto.MAX_TP_SIZE)] = 0
    tp_size: Annotated[int, Meta(ge=1, le=proto.MAX_TP_SIZE)] = 1
    page_bytes: proto.PageBytes
    pools: proto.PoolMap = {}
    granted_pages: proto.Pages = 0
    reserve_pages: proto.Pages = 0
    usage: proto.PoolMap = {}
    holds: proto.PoolMap = {}
    client: proto.FreeText = ""
    adapter: proto.AdapterInfo | None = None
    report_mapping: bool = False
    unmapped_pages: proto.Pages = 0
    phase: proto.Phase = ""


class HoldRecord(Record, tag="hold", kw_only=True):
    session_id: proto.PublicId
    pools: proto.PoolMap = {}
    granted_pages: proto.Pages = 0
    reserve_pages: proto.Pages = 0
    usage: proto.PoolMap = {}
    holds: proto.PoolMap = {}
    unmapped_pages: proto.Pages = 0
    phase: proto.Phase = ""


class CloseRecord(Record, tag="close", kw_only=True):
    session_id: proto.PublicId


class LimitRecord(Record, tag="limit", kw_only=True):
    instance: proto.Name
    max_bytes: proto.Bytes | None = None
    min_bytes: proto.Bytes = 0
    weight: proto.Weight = 1.0
    revision: Annotated[int, Meta(ge=0)] = 0
    source: LimitSource = "admin"
    priority: proto.Priority = 0
    owner_uid: Uid | None = None  # the uid whose hello set them (source "hello")


class UnlimitRecord(Record, tag="unlimit", kw_only=True):
    instance: proto.Name


class FenceRecord(Record, tag="fence", kw_only=True):
    token: proto.Token
    session_id: proto.PublicId


JournalRecord = Union[SessionRecord, HoldRecord, CloseRecord, LimitRecord, UnlimitRecord, FenceRecord]


class Snapshot(Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """The whole state at journal position ``seq``."""

    seq: Seq = 0
    device_uuid: Annotated[str, Meta(max_length=96)]
    sessions: list[SessionRecord] = []
    limits: list[LimitRecord] = []
    fenced: list[FenceRecord] = []
