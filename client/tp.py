"""Tensor-parallel grants: every rank of a TP group ends up holding the same page count.

Each rank talks to its own GPU's broker.  A rank's grant is useless unless every other rank
got as many, because a KV page id means the same slot on every rank.  So each rank asks, the
group min-reduces what was granted (a caller-supplied collective, e.g. ``torch.distributed``
MIN over the CPU group), and each releases what it got beyond the minimum.
"""

from __future__ import annotations

from typing import Callable

from .errors import BrokerError


def tp_acquire(
    acquire: Callable[[int, int | None], int],
    release: Callable[[int], None],
    pages: int,
    reduce_min: Callable[[int], int],
    min_pages: int | None = None,
) -> int:
    """Acquire on this rank, agree on the group minimum, release the surplus; return it.

    ``reduce_min`` is called exactly once on every path, so a rank whose broker fails still
    takes part in the collective (contributing 0) and the group never deadlocks; the error is
    re-raised on that rank afterwards.
    """
    failure: BrokerError | None = None
    try:
        local = acquire(pages, min_pages)
    except BrokerError as exc:
        local, failure = 0, exc
    agreed = int(reduce_min(local))
    if not 0 <= agreed <= local:
        if local:
            release(local)
        raise BrokerError(
            f"reduce_min returned {agreed}, which is not between 0 and this rank's grant of {local}",
            code="bad_request",
        )
    if local > agreed:
        release(local - agreed)
    if failure is not None:
        raise failure
    return agreed
