"""The parts of the GPU check, in the order they run.  A part is a function of a :class:`~.context.PartContext`.

To add a part, write ``run(ctx)`` in a module of its own (it records figures, assumptions and
checks on ``ctx.record``, raises :class:`~.record.Skip` if it cannot run here) and add one
:class:`Part` to :func:`registered`.  The runner gives each part a process of its own and a
time limit, so a part that fails, hangs or crashes never stops the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import part_broker, part_colocated, part_costs, part_pages, part_pools
from .context import PartContext


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    limit_s: float  # its own time limit (the runner may give it less, to end within the budget)
    run: Callable[[PartContext], None]
    #: it needs kvcached built with its CUDA extension (a GPU run waits for the build first)
    needs_kvcached: bool = False


def registered() -> list[Part]:
    """Every part, in the order they run."""
    return [
        Part("broker_nvml", "a broker on the device: measured, unreported and external against the device",
             100.0, part_broker.run),
        Part("process_cost", "what a process costs before it allocates: context, allocator, cuBLAS, NCCL",
             90.0, part_costs.run),
        Part("vmm_pages", "the driver's cost per 2 MiB page: create, map, set access, unmap, release; and OOM",
             60.0, part_pages.run),
        Part("kvcached_pools", "kvcached mode: two pools under the broker, mapped <= granted, the hand-over",
             200.0, part_pools.run, needs_kvcached=True),
        Part("colocated_start", "the co-located start of the whole-footprint issue (issue 25)",
             90.0, part_colocated.run),
    ]


def by_name(names: list[str] | None) -> list[Part]:
    """The registered parts named (all of them for None), in run order; ValueError (one line)
    naming an unknown one."""
    parts = registered()
    if names is None:
        return parts
    known = {p.name for p in parts}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}: the parts are {', '.join(p.name for p in parts)}")
    return [p for p in parts if p.name in names]
