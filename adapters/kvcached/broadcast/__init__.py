"""Broadcast mode: vLLM's EngineCore owns a kvcached pool whose pages its TP workers map.

EngineCore maps nothing itself: kvcached's IPC listener maps every page in each TP worker, so
each worker's memory is its own GPU's and each worker holds its own grant.  This folder is the
second inter-process protocol of kvcached mode (the first is the broker's), kept apart from the
single-process governing in the folder above:

* ``board.py``: one small seqlocked file in ``/dev/shm`` per pool, one slot per TP x PP rank,
  each field written by one process (EngineCore: wanted level, ask, limit; a worker: grant,
  mapped pages, answer, pressure);
* ``doorbell.py``: a per-process abstract Unix datagram socket that wakes the other side;
* ``board_grants.py``: EngineCore's grants, read off the board (the least any counted worker
  holds), in place of a broker session;
* ``worker_grants.py``: each worker's grant, held through its own broker session and following
  EngineCore's wanted level;
* ``map_gate.py``: the hard bound in each worker: a map past its grant is refused at once.

``adapters/kvcached/README.md`` ("Broadcast mode") describes the protocol in full.
"""
