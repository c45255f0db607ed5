"""What one broker lets sessions and their hellos take: the session quotas.

Each default is written here once; ``serve``'s options (broker/config.py) default to these.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..client import protocol as proto


@dataclass(frozen=True)
class SessionQuotas:
    #: A session not heard from for this long is ended and its memory freed.
    lease_s: float = proto.DEFAULT_LEASE_S
    max_sessions: int = 4096
    max_sessions_per_pid: int = 64
    #: So that one member of the socket group cannot fill the table and lock others out.
    max_sessions_per_uid: int = 1024
    hello_rate_per_s: float = 50.0
    hello_burst: int = 200
    #: The most a hello may ask for its own instance: a floor of this share of the budget,
    #: and this weight (an admin's ``limit`` or the config file may set anything).
    hello_max_floor_share: float = 0.5
    hello_max_weight: float = 4.0
    #: The highest reclaim priority a hello may give its own instance: by default a worker may
    #: volunteer to be asked for memory back first, never to be asked after the others.
    hello_max_priority: int = 0


#: The quotas of a broker given no options.
DEFAULT_QUOTAS = SessionQuotas()
