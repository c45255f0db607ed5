"""The state store alone (``broker/checkpoint.py`` and ``broker/state_records.py``): the journal
and snapshot formats on disk, replay by ``seq``, and what a load makes of each kind of damage.

The files are written and read as documented, independently of the store:
journal records ``[u32 length][u32 CRC-32 of the payload][MessagePack payload]``
(little-endian), snapshot ``KVBSNAP2`` + ``u32 CRC-32`` + MessagePack payload.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from pathlib import Path

import msgspec
import pytest

from kvcached_broker.broker.checkpoint import CheckpointError, StateStore
from kvcached_broker.client import protocol as proto
from kvcached_broker.broker.state_records import (
    CloseRecord,
    FenceRecord,
    HoldRecord,
    LimitRecord,
    SessionRecord,
    Snapshot,
    UnlimitRecord,
)

FRAME = struct.Struct("<II")


def frame(record_or_payload) -> bytes:
    """One journal record in the documented format."""
    payload = record_or_payload if isinstance(record_or_payload, bytes) else msgspec.msgpack.encode(record_or_payload)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def snapshot_bytes(snapshot: Snapshot | bytes) -> bytes:
    payload = snapshot if isinstance(snapshot, bytes) else msgspec.msgpack.encode(snapshot)
    return b"KVBSNAP2" + struct.pack("<I", zlib.crc32(payload)) + payload


def read_frames(data: bytes) -> list[tuple[int, int, dict]]:
    """``(offset, length, decoded map)`` of every record; each must pass its checksum."""
    out, offset = [], 0
    while offset < len(data):
        length, crc = FRAME.unpack_from(data, offset)
        payload = data[offset + 8 : offset + 8 + length]
        assert len(payload) == length and zlib.crc32(payload) == crc
        out.append((offset, length, msgspec.msgpack.decode(payload)))
        offset += 8 + length
    return out


def session(i: int = 1, **kw) -> SessionRecord:
    fields = dict(id=f"s-{i:08x}", token=f"token-{i:04d}-abcdefgh", nonce=f"nonce-{i:04d}-xyz", instance=f"inst{i}",
                  pid=1000 + i, pid_verified=True, page_bytes=2 << 20, pools={"weights": i << 30}, granted_pages=i)
    fields.update(kw)
    return SessionRecord(**fields)


def hold(i: int, pages: int) -> HoldRecord:
    return HoldRecord(session_id=f"s-{i:08x}", pools={"weights": i << 30}, granted_pages=pages)


def every_kind() -> list:
    return [
        session(1, uid=1000, pid_start_ticks=12345, usage={"swa_kv_pool": 1 << 20}, holds={"kv_sizing_hold": 1 << 30},
                client="test 1.0", adapter=proto.AdapterInfo(runtime="sglang", runtime_version="0.5.13", patches=["p"])),
        hold(1, 7),
        LimitRecord(instance="inst1", max_bytes=8 << 30, min_bytes=1 << 30, weight=2.0, revision=3, source="config"),
        UnlimitRecord(instance="inst1"),
        FenceRecord(token="token-0001-abcdefgh", session_id="s-00000001"),
        CloseRecord(session_id="s-00000001"),
    ]


@pytest.fixture
def state_dir(tmp_path) -> Path:
    return tmp_path / "state"


def reopen(state_dir: Path, device: int = 0):
    store = StateStore(state_dir, device)
    loaded = store.open()
    return store, loaded


def write_journal(state_dir: Path, data: bytes, device: int = 0) -> Path:
    state_dir.mkdir(mode=0o700, exist_ok=True)
    path = state_dir / f"gpu{device}.journal"
    path.write_bytes(data)
    return path


def healthy(loaded) -> bool:
    return ((loaded.torn_bytes, loaded.damaged_records, loaded.damaged_bytes, loaded.snapshot_damage, loaded.missing,
             loaded.lost_records) == (0, 0, 0, None, [], 0))


# ----------------------------------------------------------------------------- append and reload
def test_append_then_reload_gives_back_every_kind_of_record_in_order(state_dir):
    store, loaded = reopen(state_dir)
    assert loaded.snapshot is None and loaded.records == [] and healthy(loaded) and not loaded.damaged
    records = every_kind()
    store.append(records[:2])
    store.append([])  # nothing to write: no record, no seq
    store.append(records[2:])
    assert [r.seq for r in records] == [1, 2, 3, 4, 5, 6] and store.seq == 6
    store.close()

    again, loaded = reopen(state_dir)
    assert loaded.records == records and healthy(loaded)
    assert [type(r) for r in loaded.records] == [type(r) for r in every_kind()]
    assert again.seq == 6 and again.journal_bytes == (state_dir / "gpu0.journal").stat().st_size
    again.close()


def test_the_journal_is_in_the_documented_format(state_dir):
    store, _ = reopen(state_dir)
    store.append([session(1), hold(1, 4)])
    store.append([hold(1, 9)])
    store.close()
    data = (state_dir / "gpu0.journal").read_bytes()
    frames = read_frames(data)
    assert [f[2]["kind"] for f in frames] == ["session", "hold", "hold"]
    assert [f[2]["seq"] for f in frames] == [1, 2, 3]
    assert frames[2][2]["granted_pages"] == 9 and frames[0][2]["token"] == "token-0001-abcdefgh"
    assert store.journal_bytes == len(data) == sum(8 + f[1] for f in frames)


def test_a_journal_written_by_hand_loads(state_dir):
    """The reader depends on the format, not on the store's encoder."""
    records = [session(2, seq=1), HoldRecord(session_id="s-00000002", granted_pages=3, seq=2)]
    write_journal(state_dir, b"".join(frame(r) for r in records))
    store, loaded = reopen(state_dir)
    assert loaded.records == records and healthy(loaded) and store.seq == 2
    store.close()


def test_compaction_is_asked_for_once_the_journal_is_large(state_dir):
    store = StateStore(state_dir, 0, compact_after_bytes=300)
    store.open()
    store.append([hold(1, 1)])
    assert not store.needs_compaction()
    while store.journal_bytes < 300:
        store.append([hold(1, 2)])
    assert store.needs_compaction()
    store.write_snapshot(Snapshot(device_uuid="GPU-x"))
    assert not store.needs_compaction() and store.journal_bytes == 0
    store.close()


def test_devices_keep_separate_files(state_dir):
    zero, _ = reopen(state_dir, 0)
    one, _ = reopen(state_dir, 1)
    zero.append([hold(1, 1)])
    one.append([hold(2, 2), hold(2, 3)])
    zero.close()
    one.close()
    assert [r.granted_pages for r in reopen(state_dir, 0)[1].records] == [1]
    assert [r.granted_pages for r in reopen(state_dir, 1)[1].records] == [2, 3]


# ----------------------------------------------------------------------------- snapshot and seq
def _snapshot_state(i: int = 1) -> Snapshot:
    return Snapshot(device_uuid="GPU-1234", sessions=[session(i)], limits=[LimitRecord(instance="inst1", weight=3.0)],
                    fenced=[FenceRecord(token="token-9999-fencedxx", session_id="s-00000009")])


def test_a_snapshot_empties_the_journal_and_later_records_replay_on_top(state_dir):
    store, _ = reopen(state_dir)
    store.append([session(1), hold(1, 2), hold(1, 3)])
    state = _snapshot_state()
    store.write_snapshot(state)
    assert state.seq == 3 and (state_dir / "gpu0.journal").stat().st_size == 0
    data = (state_dir / "gpu0.snapshot").read_bytes()
    assert data[:8] == b"KVBSNAP2" and struct.unpack_from("<I", data, 8)[0] == zlib.crc32(data[12:])
    assert msgspec.msgpack.decode(data[12:])["seq"] == 3
    assert not list(state_dir.glob("*.tmp*"))  # renamed into place
    store.append([hold(1, 5)])
    store.close()

    again, loaded = reopen(state_dir)
    assert loaded.snapshot == state and healthy(loaded)
    assert [(r.seq, r.granted_pages) for r in loaded.records] == [(4, 5)]
    assert again.seq == 4
    again.append([hold(1, 6)])
    again.close()
    assert [r.seq for r in reopen(state_dir)[1].records] == [4, 5]


def test_a_crash_between_the_snapshot_rename_and_the_journal_truncate_replays_nothing_twice(state_dir):
    store, _ = reopen(state_dir)
    store.append([session(1), hold(1, 2), hold(1, 3)])
    journal = state_dir / "gpu0.journal"
    before_snapshot = journal.read_bytes()
    store.write_snapshot(_snapshot_state())
    store.close()
    journal.write_bytes(before_snapshot)  # as if the truncate never happened

    again, loaded = reopen(state_dir)
    assert loaded.snapshot.seq == 3 and loaded.records == [] and healthy(loaded)
    assert again.seq == 3
    again.append([hold(1, 8)])  # after the old records, in the same file
    again.close()
    _, loaded = reopen(state_dir)
    assert [(r.seq, r.granted_pages) for r in loaded.records] == [(4, 8)]


def test_an_old_seq_record_after_a_snapshot_is_not_replayed(state_dir):
    store, _ = reopen(state_dir)
    store.append([session(1), hold(1, 2)])
    store.write_snapshot(_snapshot_state())  # seq 2
    store.close()
    journal = state_dir / "gpu0.journal"
    with open(journal, "ab") as f:
        f.write(frame(HoldRecord(session_id="s-00000001", granted_pages=99, seq=2)))  # already in the snapshot
        f.write(frame(HoldRecord(session_id="s-00000001", granted_pages=1, seq=1)))
        f.write(frame(HoldRecord(session_id="s-00000001", granted_pages=5, seq=3)))
    again, loaded = reopen(state_dir)
    assert [(r.seq, r.granted_pages) for r in loaded.records] == [(3, 5)] and healthy(loaded)
    assert again.seq == 3
    again.close()


def test_records_with_skipped_sequence_numbers_still_load_in_file_order(state_dir):
    """A broker numbers its records one by one: the seqs missing are records lost (issue 26, item 1)."""
    seqs = [1, 2, 5, 9, 7, 40]
    write_journal(state_dir, b"".join(frame(HoldRecord(session_id="s-1", granted_pages=s, seq=s)) for s in seqs))
    store, loaded = reopen(state_dir)
    assert [r.seq for r in loaded.records] == seqs and loaded.lost_records == 40 - 6 and loaded.damaged
    assert store.seq == 40  # the largest, so new records never reuse a seq
    store.append([hold(1, 0)])
    assert store.seq == 41
    store.close()
    assert [r.seq for r in reopen(state_dir)[1].records] == seqs + [41]


def test_skipped_sequence_numbers_after_a_snapshot_keep_only_the_newer(state_dir):
    state_dir.mkdir()
    (state_dir / "gpu0.snapshot").write_bytes(snapshot_bytes(Snapshot(seq=10, device_uuid="GPU-1")))
    seqs = [4, 11, 10, 25, 3]
    write_journal(state_dir, b"".join(frame(HoldRecord(session_id="s-1", granted_pages=s, seq=s)) for s in seqs))
    store, loaded = reopen(state_dir)
    assert [r.seq for r in loaded.records] == [11, 25] and store.seq == 25
    assert loaded.lost_records == 25 - 10 - 2 and loaded.damaged
    store.close()


# ------------------------------------------- files and records a broker that ran here left (issue 26, item 1)
def _ran_here(state_dir: Path, *, snapshot_sessions: int = 1, records: int = 2) -> None:
    """A broker's start (a snapshot) and the records it wrote after it; then it stops (killed)."""
    store, _ = reopen(state_dir)
    store.append([session(i) for i in range(1, snapshot_sessions + 1)])
    store.write_snapshot(Snapshot(device_uuid="GPU-1", sessions=[session(i) for i in range(1, snapshot_sessions + 1)]))
    store.append([hold(1, 5 + i) for i in range(records)])
    store.close()


@pytest.mark.parametrize("deleted", [["gpu0.snapshot"], ["gpu0.journal"], ["gpu0.snapshot", "gpu0.journal"]])
def test_a_state_file_deleted_where_a_broker_ran_is_damage(state_dir, deleted):
    """It used to load as a first start: nothing damaged, nothing logged."""
    _ran_here(state_dir)
    for name in deleted:
        (state_dir / name).unlink()
    store, loaded = reopen(state_dir)
    store.close()
    assert loaded.damaged
    if deleted == ["gpu0.snapshot"]:  # its records (seqs 2 and 3) now follow nothing: seq 1 is gone
        assert loaded.lost_records == 1 and loaded.missing == []
    else:
        assert loaded.missing == deleted


def test_a_snapshot_deleted_after_a_start_with_an_empty_journal_is_missing(state_dir):
    _ran_here(state_dir, records=0)
    (state_dir / "gpu0.snapshot").unlink()
    store, loaded = reopen(state_dir)
    store.close()
    assert loaded.missing == ["gpu0.snapshot"] and loaded.damaged


def test_a_first_start_and_a_journal_that_begins_at_seq_1_are_no_damage(state_dir):
    store, loaded = reopen(state_dir)  # nothing here yet: a first start
    assert healthy(loaded)
    store.append([session(1), hold(1, 3)])  # the first snapshot (seq 0) held nothing
    store.close()
    store, loaded = reopen(state_dir)
    store.close()
    assert healthy(loaded) and [r.seq for r in loaded.records] == [1, 2]


def test_the_first_record_lost_with_its_length_frame_is_counted_by_its_seq(state_dir):
    _ran_here(state_dir, records=3)
    journal = state_dir / "gpu0.journal"
    data = bytearray(journal.read_bytes())
    data[0] ^= 0x01  # one bit of the first record's length
    journal.write_bytes(bytes(data))
    store, loaded = reopen(state_dir)
    store.close()
    assert [r.granted_pages for r in loaded.records] == [6, 7] and loaded.lost_records == 1 and loaded.damaged


def test_a_zero_filled_journal_is_damage(state_dir):
    _ran_here(state_dir)
    journal = state_dir / "gpu0.journal"
    journal.write_bytes(bytes(len(journal.read_bytes())))
    store, loaded = reopen(state_dir)
    store.close()
    assert loaded.records == [] and loaded.damaged_bytes and loaded.damaged


# ----------------------------------------------------------------------------- damage
def _three_records(state_dir: Path) -> tuple[bytes, list]:
    """A journal of three records; returns its bytes and the records."""
    store, _ = reopen(state_dir)
    records = [session(1), hold(1, 2), hold(1, 3)]
    store.append(records)
    store.close()
    return (state_dir / "gpu0.journal").read_bytes(), records


def test_a_torn_tail_is_dropped_counted_and_cut_off_at_every_byte_offset(state_dir):
    data, records = _three_records(state_dir)
    last_at = read_frames(data)[-1][0]
    journal = state_dir / "gpu0.journal"
    for cut in range(last_at + 1, len(data)):
        journal.write_bytes(data[:cut])
        store, loaded = reopen(state_dir)
        assert loaded.records == records[:2], cut
        assert loaded.torn_bytes == cut - last_at, cut
        assert (loaded.damaged_records, loaded.damaged_bytes, loaded.damaged) == (0, 0, False), cut
        assert journal.stat().st_size == last_at == store.journal_bytes, cut  # truncated on open
        assert store.seq == 2
        store.append([hold(1, 4)])  # a new record starts where the intact ones end
        store.close()
        _, after = reopen(state_dir)
        assert [r.granted_pages for r in after.records] == [1, 2, 4] and healthy(after), cut


def test_a_flipped_bit_anywhere_in_a_payload_damages_only_that_record(state_dir):
    data, records = _three_records(state_dir)
    offset, length, _ = read_frames(data)[1]  # the middle record
    journal = state_dir / "gpu0.journal"
    for byte in range(offset + 8, offset + 8 + length):
        bit = byte % 8  # every byte, each bit position in turn
        damaged = bytearray(data)
        damaged[byte] ^= 1 << bit
        journal.write_bytes(bytes(damaged))
        store, loaded = reopen(state_dir)
        assert loaded.records == [records[0], records[2]], (byte, bit)
        assert (loaded.damaged_records, loaded.damaged_bytes) == (1, 8 + length), (byte, bit)
        assert loaded.torn_bytes == 0 and loaded.damaged and store.seq == 3
        store.close()
    assert journal.stat().st_size == len(data)  # damage is reported, never cut away


def test_a_flipped_bit_in_a_checksum_damages_only_that_record(state_dir):
    data, records = _three_records(state_dir)
    offset, length, _ = read_frames(data)[0]
    for bit in range(32):
        damaged = bytearray(data)
        damaged[offset + 4 + bit // 8] ^= 1 << (bit % 8)
        write_journal(state_dir, bytes(damaged))
        store, loaded = reopen(state_dir)
        assert loaded.records == records[1:] and loaded.damaged_records == 1 and loaded.damaged_bytes == 8 + length
        store.close()


def test_a_record_that_passes_its_checksum_but_not_the_schema_is_damaged(state_dir):
    bad = [
        msgspec.msgpack.encode({"kind": "hold", "seq": 2, "session_id": "s-1", "granted_pages": -1}),
        msgspec.msgpack.encode({"kind": "hold", "seq": 2, "session_id": "s-1", "surprise": 1}),
        msgspec.msgpack.encode({"kind": "teleport", "seq": 2}),
        msgspec.msgpack.encode({"kind": "hold", "seq": 2, "session_id": "s-1", "pools": {"bad name!": 1}}),
        msgspec.msgpack.encode([1, 2, 3]),
        b"\xc1",  # never valid MessagePack
        b"\x91" * 5000 + b"\x01",  # nested deeper than any record
    ]
    for payload in bad:
        good_before, good_after = HoldRecord(session_id="s-1", seq=1), HoldRecord(session_id="s-1", granted_pages=3, seq=3)
        write_journal(state_dir, frame(good_before) + frame(payload) + frame(good_after))
        store, loaded = reopen(state_dir)
        assert loaded.records == [good_before, good_after], payload[:20]
        assert (loaded.damaged_records, loaded.damaged_bytes, loaded.torn_bytes) == (1, 8 + len(payload), 0)
        store.close()


@pytest.mark.parametrize("length", [0, (16 << 20) + 1, 0xFFFFFFFF])
def test_a_length_frame_that_cannot_be_right_is_damage_and_the_read_resumes_after_it(state_dir, length):
    data, records = _three_records(state_dir)
    offset, next_offset = read_frames(data)[1][0], read_frames(data)[2][0]
    damaged = bytearray(data)
    struct.pack_into("<I", damaged, offset, length)
    journal = write_journal(state_dir, bytes(damaged))
    store, loaded = reopen(state_dir)
    assert loaded.records == [records[0], records[2]]  # the next good frame is found again
    assert loaded.damaged_bytes == next_offset - offset and loaded.damaged_records == 1 and loaded.torn_bytes == 0
    assert loaded.damaged
    assert journal.stat().st_size == len(data)  # not truncated: damage, not a torn write
    store.close()


def test_a_mid_journal_length_frame_that_points_past_the_end_is_damage_not_a_torn_tail(state_dir):
    """A length frame past the end of a file that goes on is damage, not the last write cut
    short: the answered records after it are read, and the file is not truncated."""
    data, records = _three_records(state_dir)
    damaged = bytearray(data)
    damaged[2] ^= 0x01  # one bit: the first record's length grows by 64 KiB, past the end
    journal = write_journal(state_dir, bytes(damaged))
    store, loaded = reopen(state_dir)
    store.close()
    second = read_frames(data)[1][0]
    assert loaded.records == records[1:]
    assert (loaded.damaged_records, loaded.damaged_bytes, loaded.torn_bytes) == (1, second, 0)
    assert journal.stat().st_size == len(data)  # the records after it are not destroyed


# ----------------------------------------------------------------------------- snapshot damage
def _snapshot_and_journal(state_dir: Path) -> tuple[Snapshot, list]:
    store, _ = reopen(state_dir)
    store.append([session(1), hold(1, 2)])
    state = _snapshot_state()
    store.write_snapshot(state)
    later = [hold(1, 7)]
    store.append(later)
    store.close()
    return state, later


def test_a_flipped_bit_anywhere_in_the_snapshot_is_reported_and_not_used(state_dir):
    _, later = _snapshot_and_journal(state_dir)
    path = state_dir / "gpu0.snapshot"
    data = path.read_bytes()
    for byte in range(len(data)):
        damaged = bytearray(data)
        damaged[byte] ^= 1 << (byte % 8)
        path.write_bytes(bytes(damaged))
        store, loaded = reopen(state_dir)
        assert loaded.snapshot is None and loaded.damaged, byte
        expected = "not a kvcached-broker snapshot of this format" if byte < 8 else "checksum mismatch"
        assert loaded.snapshot_damage == expected, byte
        assert loaded.records == later  # the journal still loads, from seq 0
        assert (loaded.damaged_records, loaded.damaged_bytes, loaded.torn_bytes) == (0, 0, 0)
        store.close()
    path.write_bytes(data)
    assert reopen(state_dir)[1].snapshot is not None  # and the original was fine


@pytest.mark.parametrize(
    "content",
    [b"", b"KVBSNAP", b"KVBSNAP2\x00", b"KVBSNAP1" + b"\x00" * 20, b'{"seq": 3, "device_uuid": "GPU-1"}',
     msgspec.msgpack.encode({"seq": 3, "device_uuid": "GPU-1"})],
    ids=["empty", "short_magic", "short_header", "old_format", "json", "bare_msgpack"],
)
def test_an_unknown_format_snapshot_is_reported_and_not_used(state_dir, content):
    _, later = _snapshot_and_journal(state_dir)
    (state_dir / "gpu0.snapshot").write_bytes(content)
    store, loaded = reopen(state_dir)
    assert loaded.snapshot is None and loaded.snapshot_damage == "not a kvcached-broker snapshot of this format"
    assert loaded.records == later and loaded.damaged
    store.close()


@pytest.mark.parametrize(
    "payload",
    [
        {"seq": 1},  # no device_uuid
        {"seq": 1, "device_uuid": "GPU-1", "extra": True},
        {"seq": -1, "device_uuid": "GPU-1"},
        {"seq": 1, "device_uuid": "GPU-1", "sessions": [{"kind": "hold", "session_id": "s-1"}]},
    ],
)
def test_a_snapshot_with_a_good_checksum_and_bad_content_is_reported_and_not_used(state_dir, payload):
    state_dir.mkdir()
    (state_dir / "gpu0.snapshot").write_bytes(snapshot_bytes(msgspec.msgpack.encode(payload)))
    store, loaded = reopen(state_dir)
    assert loaded.snapshot is None and loaded.snapshot_damage.startswith("invalid content (")
    assert store.seq == 0
    store.close()


# ----------------------------------------------------------------------------- the state directory
def test_the_state_directory_and_files_are_private(tmp_path):
    state_dir = tmp_path / "deep" / "state"
    store, _ = reopen(state_dir)
    store.append([hold(1, 1)])
    store.write_snapshot(Snapshot(device_uuid="GPU-1"))
    store.close()
    assert stat.S_IMODE(state_dir.stat().st_mode) & 0o077 == 0
    for name in ("gpu0.journal", "gpu0.snapshot", "gpu0.secret"):
        assert stat.S_IMODE((state_dir / name).stat().st_mode) == 0o600, name


def test_a_symlinked_state_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "state"
    link.symlink_to(real)
    with pytest.raises(CheckpointError, match="is not a directory"):
        StateStore(link, 0).open()
    assert not list(real.iterdir())  # nothing was written through the link


def test_a_dangling_symlink_or_a_file_is_refused(tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="cannot create state directory"):
        StateStore(dangling, 0).open()
    plain = tmp_path / "file"
    plain.write_text("")
    with pytest.raises(CheckpointError, match="cannot create state directory"):
        StateStore(plain, 0).open()


def test_a_world_writable_state_directory_is_refused(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    os.chmod(state_dir, 0o777)
    with pytest.raises(CheckpointError, match="world-writable"):
        StateStore(state_dir, 0).open()
    assert not (state_dir / "gpu0.journal").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_state_directory_owned_by_another_user_is_refused(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, 65534, 65534)
    with pytest.raises(CheckpointError, match="owned by uid 65534"):
        StateStore(state_dir, 0).open()
    assert not (state_dir / "gpu0.journal").exists()


# ------------------------------------------------- the state files themselves (issue 26, item 8)
@pytest.mark.parametrize("name", ["gpu0.journal", "gpu0.snapshot"])
def test_a_state_file_that_is_a_symlink_is_refused_not_followed(tmp_path, state_dir, name):
    """Even to a file that would load: a symlink could as well lead to /dev/zero (read until
    memory runs out) or to another user's file."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(frame(session(1)) if name.endswith("journal") else snapshot_bytes(Snapshot(device_uuid="G")))
    state_dir.mkdir(mode=0o700)
    (state_dir / name).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        StateStore(state_dir, 0).open()


def test_a_state_file_larger_than_any_state_is_refused_unread(state_dir):
    from kvcached_broker.broker.checkpoint import MAX_STATE_FILE_BYTES

    state_dir.mkdir(mode=0o700)
    with open(state_dir / "gpu0.journal", "wb") as f:
        f.truncate(MAX_STATE_FILE_BYTES + 1)  # sparse
    with pytest.raises(CheckpointError, match="more than a state file can"):
        StateStore(state_dir, 0).open()


def test_snapshot_temp_files_left_behind_are_removed_and_only_this_devices(state_dir):
    state_dir.mkdir(mode=0o700)
    for name in ("gpu0.snapshot.tmp4242", "gpu0.snapshot.tmp1", "gpu1.snapshot.tmp4242"):
        (state_dir / name).write_bytes(b"half a snapshot")
    store, _ = reopen(state_dir)
    store.write_snapshot(Snapshot(device_uuid="GPU-1"))
    store.close()
    assert sorted(p.name for p in state_dir.iterdir()) == [
        "gpu0.journal", "gpu0.secret", "gpu0.snapshot", "gpu1.snapshot.tmp4242"]


def test_a_snapshot_marked_stale_is_restored_and_reported_as_damage(state_dir):
    store, _ = reopen(state_dir)
    store.append([session(1), hold(1, 5)])
    store.write_snapshot(Snapshot(device_uuid="GPU-1", sessions=[session(1, granted_pages=5)]))
    store.append([session(2)])
    assert store.mark_stale()
    store.close()
    assert (state_dir / "gpu0.snapshot").read_bytes()[:8] == b"KVBSTALE"
    _, loaded = reopen(state_dir)
    assert [s.granted_pages for s in loaded.snapshot.sessions] == [5]  # the content is kept
    assert [r.id for r in loaded.records] == ["s-00000002"]
    assert loaded.damaged and loaded.snapshot_damage.startswith("stale")


# ------------------------------------------------------ the secret of the session tokens (issue 26, item 3)
def test_the_secret_is_made_once_private_and_kept_across_starts(state_dir):
    store, first = reopen(state_dir)
    store.close()
    path = state_dir / "gpu0.secret"
    assert len(first.secret) == 32 and first.secret_problem is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == first.secret
    store, again = reopen(state_dir)
    store.close()
    assert again.secret == first.secret
    store, other = reopen(state_dir, device=1)  # each device keys its own tokens
    store.close()
    assert other.secret != first.secret


def test_a_secret_other_users_can_read_refuses_the_start(state_dir):
    store, _ = reopen(state_dir)
    store.close()
    os.chmod(state_dir / "gpu0.secret", 0o640)
    with pytest.raises(CheckpointError, match=r"gpu0.secret can be read by other users \(mode 0640\)"):
        StateStore(state_dir, 0).open()


@pytest.mark.parametrize("content", [b"", b"short", bytes(33)])
def test_a_secret_of_the_wrong_size_is_replaced_and_said(state_dir, content):
    state_dir.mkdir(mode=0o700)
    path = state_dir / "gpu0.secret"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    store, loaded = reopen(state_dir)
    store.close()
    assert len(loaded.secret) == 32 and path.read_bytes() == loaded.secret
    assert loaded.secret_problem == f"the secret held {len(content)} bytes, not 32: replaced"


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_secret_that_is_not_a_regular_file_refuses_the_start(tmp_path, state_dir, kind):
    state_dir.mkdir(mode=0o700)
    path = state_dir / "gpu0.secret"
    if kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(bytes(32))
        path.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(path, 0o600)
    with pytest.raises(CheckpointError, match="symbolic link|not a regular file"):
        StateStore(state_dir, 0).open()


def test_marking_stale_without_a_snapshot_says_so(state_dir):
    store, _ = reopen(state_dir)
    assert store.mark_stale() is False
    store.close()
