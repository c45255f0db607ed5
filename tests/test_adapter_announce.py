"""The adapter's lines reach stderr whatever logging configuration the runtime applied.

A real session is opened on a real broker after the harshest configuration a runtime can
apply: ``dictConfig`` with ``disable_existing_loggers`` (which disables every logger it does
not name), a root logger at CRITICAL with no handler, and ``logging.disable``.
"""

from __future__ import annotations

import logging
import logging.config

import pytest

from kvcached_broker.adapters import worker

from helpers import GIB, connect_to


@pytest.fixture
def silenced_logging():
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": True, "root": {"level": "CRITICAL"}})
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)
    for logger in logging.Logger.manager.loggerDict.values():
        if isinstance(logger, logging.Logger):
            logger.disabled = False
    logging.getLogger().setLevel(logging.WARNING)


@pytest.fixture
def adapter_broker(inproc_factory):
    b = inproc_factory(total_bytes=GIB)
    worker.reset()
    worker.client_factory = connect_to(b.endpoint)
    yield b
    worker.reset()
    worker.client_factory = None


def _lines(err: str, event: str) -> list[str]:
    return [line for line in err.splitlines() if f"event={event}" in line]


def test_one_active_line_and_one_instance_warning_past_any_logging_configuration(
    adapter_broker, silenced_logging, monkeypatch, capsys
):
    monkeypatch.delenv("KVCACHED_BROKER_INSTANCE", raising=False)
    first = worker.session(worker.WorkerIdentity("sglang", 0))
    worker.session(worker.WorkerIdentity("sglang", 1))  # a second device in the process: no second line
    err = capsys.readouterr().err
    (active,) = _lines(err, "adapter_active")
    (unset,) = _lines(err, "instance_default")
    name = worker.WorkerIdentity("sglang", 0).instance_name()
    assert active.startswith("kvcached-broker: INFO ") and f"instance={name}" in active
    assert f"endpoint={adapter_broker.endpoint}" in active and f"session={first.session_id}" in active
    assert "runtime=sglang" in active and "hook=explicit" in active
    assert unset.startswith("kvcached-broker: WARNING ") and f"instance={name}" in unset
    assert "KVCACHED_BROKER_INSTANCE is unset" in unset


def test_no_instance_warning_when_the_name_is_set(adapter_broker, monkeypatch, capsys):
    monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", "named")
    worker.session(worker.WorkerIdentity("vllm", 0))
    err = capsys.readouterr().err
    assert len(_lines(err, "adapter_active")) == 1 and _lines(err, "instance_default") == []


def test_the_broker_shows_which_adapter_opened_each_session(adapter_broker, monkeypatch):
    monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", "named")
    worker.session(worker.WorkerIdentity("vllm", 0))
    (inst,) = adapter_broker.status()["instances"]
    adapter = inst["sessions"][0]["adapter"]
    assert adapter == worker.adapter_info("vllm") and adapter["runtime"] == "vllm"


@pytest.mark.parametrize("name", ["llama-a", None])
def test_a_process_without_a_session_names_its_instance_in_its_active_line(monkeypatch, capsys, name):
    """vLLM's EngineCore: the same line as a worker's, ``instance=`` included (``default`` when
    the variable is unset: the default comes from the workers' process group, which it is not in)."""
    if name is None:
        monkeypatch.delenv("KVCACHED_BROKER_INSTANCE", raising=False)
    else:
        monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", name)
    worker.reset()
    worker.announce_process("vllm", "engine_core")
    (active,) = _lines(capsys.readouterr().err, "adapter_active")
    assert f"instance={name or 'default'} " in active and "role=engine_core" in active
    assert active.startswith("kvcached-broker: INFO event=adapter_active runtime=vllm ")
    worker.reset()
