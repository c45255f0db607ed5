"""One pool's kvctl segment as its governor uses it: the broker's limit shown there, an operator's
cap read from it, and the watcher targets the governor's own writes made.

kvcached's ``/dev/shm`` segment (``kvctl list``, kvtop) holds the pool's ``total_size``.  The
governor shows its limit there; a value someone else wrote (``kvctl limit``) is an operator's
cap.  The segment may be shared (an SGLang server's TP ranks, pools of servers started in one
process group): :func:`.segment.exchange` tells the governors' writes from an operator's, under
the segment's lock, and keeps the cap for every pool on it, numbering each new cap (``seq``).
This object keeps what one pool knows of that exchange; the governor decides what a cap does.

kvcached's watcher turns any change of ``total_size`` into a sticky resize target (per-layer
bytes): the targets this pool's own writes made are remembered (:meth:`KvctlSegment.own_target`),
so that one is never applied once the pool runs ungoverned.  A segment or record that is not
this user's own private file (:mod:`.shm_files`) is never read for a cap nor written: one
warning per reason, and :attr:`KvctlSegment.unsafe` says why.
"""

from __future__ import annotations

from typing import Callable

from .. import announce
from . import segment, shm_files
from .geometry import PoolGeometry

log = announce.logger("kvcached_broker.adapters")


class KvctlSegment:
    def __init__(self, geometry: PoolGeometry, key: Callable[[], str]):
        self.geometry = geometry
        self._key = key  # the pool's name in log lines (it may change once the manager is known)
        self.policy = shm_files.Policy.from_env()
        #: this process's part in the segment (:func:`.segment.attach`, taken before kvcached opened it)
        self.member: segment.Membership | None = None
        self.unsafe = ""  # why the segment or its record is not trusted (empty: trusted)
        self._shown_bytes: int | None = None  # total_size this pool last wrote
        self._seq: int | None = None  # the segment's cap sequence last taken (None: nothing shown yet)
        self._own_targets: set[int] = set()

    def read(self) -> segment.Shared | None:
        """The segment's cap state, if it changed since this pool last took it; None otherwise, or
        before this pool first showed its limit (the segment holds kvcached's start-up value)."""
        if self._seq is None:
            return None
        return self._taken(self._exchange())

    def show(self, limit_bytes: int) -> segment.Shared | None:
        """Show ``limit_bytes`` as the pool's ``total_size`` (nothing if shown already); the cap
        state, if it changed.  The first write joins the segment: a ``total_size`` equal to the
        pool's virtual size is kvcached's own start-up write, not an operator's cap."""
        if limit_bytes == self._shown_bytes:
            return None
        joining = self._seq is None
        virtual_pages = self.geometry.virtual_pages
        own_start = (lambda total: self.geometry.pages_of(total) == virtual_pages) if joining else None
        shared = self._exchange(limit_bytes, own_start)
        if shared is None:
            return None
        self._shown_bytes = limit_bytes
        if joining:
            self._seq = -1  # take whatever cap the segment's governors hold
        taken = self._taken(shared)
        self._note_own_target()
        return taken

    def show_lifted(self) -> None:
        """Ungoverned: the segment shows kvcached alone's limit, the pool's virtual size (as a
        governor's write, so the governors of pools sharing the segment take it for no cap)."""
        size = self.geometry.limit_bytes(self.geometry.virtual_pages)
        try:
            if self._exchange(size) is not None:
                self._shown_bytes = size
                self._note_own_target()
        except OSError as exc:
            log.warning("event=kvcached_segment_unwritten pool=%s error=%r", self._key(), str(exc))

    def own_target(self, target: int) -> bool:
        """Whether a kvctl watcher ``target`` (per-layer bytes) is one this pool's writes made."""
        return target in self._own_targets

    def untrusted(self, why: str) -> None:
        """The segment (or its record) is not this user's own private file: no cap is taken from it
        and nothing is written there (said once per reason)."""
        if why != self.unsafe:
            log.warning("event=kvcached_shm_unsafe pool=%s file=%r detail=not_trusted_kvctl_caps_ignored_"
                        "the_grant_still_bounds_the_pool", self._key(), why)
        self.unsafe = why

    def leave(self) -> None:
        """The pool shut down: this process's part in the segment ends (kvcached removes the segment)."""
        if self.member is not None:
            self.member.leave()

    def _exchange(self, show_bytes: int | None = None,
                  own_start: Callable[[int], bool] | None = None) -> segment.Shared | None:
        """:func:`.segment.exchange` on this pool's segment; None (no value taken, nothing
        written) if the segment is gone or not this user's own."""
        try:
            shared = segment.exchange(self.geometry.ipc_name, show_bytes, own_start=own_start,
                                      policy=self.policy, member=self.member)
        except shm_files.UnsafeFile as exc:
            self.untrusted(str(exc))
            return None
        self.unsafe = ""
        return shared

    def _taken(self, shared: segment.Shared | None) -> segment.Shared | None:
        """``shared`` if its cap is new to this pool (the limit is shown again after it)."""
        if shared is None or shared.seq == self._seq:
            return None
        self._seq = shared.seq
        self._shown_bytes = None
        return shared

    def _note_own_target(self) -> None:
        if self._shown_bytes is not None:
            self._own_targets.add(self._shown_bytes // (self.geometry.num_layers * self.geometry.num_kv_buffers))
