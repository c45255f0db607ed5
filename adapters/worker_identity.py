"""Who this worker is to its broker, and how it says so.

:class:`WorkerIdentity` names a worker process's session (runtime, device, TP rank, instance);
:func:`adapter_info` is what the broker shows as the session's ``adapter``; the
``adapter_active`` line (:func:`announce_active`, :func:`announce_process`) says once per
process which patches are applied and which broker it reaches.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..client import BrokerClient
from ..client.protocol import DEFAULT_PAGE_BYTES
from . import announce, instance, patching, startup_hook, versions


@dataclass
class WorkerIdentity:
    runtime: str  # "sglang" or "vllm"
    device: int | str
    tp_rank: int = 0
    tp_size: int = 1
    page_bytes: int = DEFAULT_PAGE_BYTES  # elastic KV pages of any size are counted in session pages
    instance: str | None = None
    #: Adapters batch their own elastic grants (kvcached mode grows a pool a batch at a time),
    #: so by default the client keeps no credit reserve of its own: a worker that only
    #: reserves holds no idle pages.
    credit_pages: int | None = 0

    def instance_name(self) -> str:
        return self.instance or instance.instance_name(self.runtime)


def adapter_info(runtime: str) -> dict[str, object]:
    """What the broker shows as this session's ``adapter``: runtime, version, applied patches."""
    return {
        "runtime": runtime,
        "runtime_version": versions.installed(runtime) or "",
        "patches": applied_patches(runtime)[:64],
    }


def applied_patches(runtime: str) -> list[str]:
    names = [r.patch for r in patching.results() if r.outcome in ("applied", "already") and r.patch.startswith(f"{runtime}_")]
    return sorted(set(names))


def failed_patches(runtime: str) -> list[str]:
    names = [r.patch for r in patching.results() if r.outcome == "failed" and r.patch.startswith(f"{runtime}_")]
    return sorted(set(names))


def announce_process(runtime: str, role: str) -> None:
    """The ``adapter_active`` line of a process that opens no session itself (vLLM's EngineCore).

    Its ``instance`` is ``KVCACHED_BROKER_INSTANCE``, or ``default`` where that is unset: the
    default comes from the workers' process group, which this process is not in, and each
    worker's own line shows it.
    """
    failed = failed_patches(runtime)
    announce.once(
        "active", logging.INFO, "adapter_active", runtime=runtime, version=versions.installed(runtime),
        pid=os.getpid(), hook="pth" if startup_hook.installed() else "explicit", role=role,
        instance="default" if instance.defaulted() else shown_instance(runtime),
        endpoint=os.environ.get("KVCACHED_BROKER", "").strip() or "default",
        patches=",".join(applied_patches(runtime)) or "none", failed=",".join(failed) or None,
    )


def shown_instance(runtime: str, name: str | None = None) -> str:
    """The instance name as the ``adapter_active`` line shows it (an invalid one, with why)."""
    try:
        return name or instance.instance_name(runtime)
    except instance.InstanceNameError as exc:
        return f"invalid ({exc})"


def announce_active(identity: WorkerIdentity, client: BrokerClient | None) -> None:
    runtime = identity.runtime
    failed = failed_patches(runtime)
    name = shown_instance(runtime, identity.instance)
    announce.once(
        "active", logging.INFO, "adapter_active", runtime=runtime, version=versions.installed(runtime),
        pid=os.getpid(), hook="pth" if startup_hook.installed() else "explicit", instance=name,
        endpoint=client.endpoint if client is not None else "none",
        session=client.session_id if client is not None else "none",
        patches=",".join(applied_patches(runtime)) or "none", failed=",".join(failed) or None,
    )
    if identity.instance is None and instance.defaulted():
        announce.once("instance", logging.WARNING, "instance_default", instance=name,
                      detail="KVCACHED_BROKER_INSTANCE is unset: give every rank of this server the same name there")
