"""The adapter's lines reach stderr whatever logging configuration the runtime applied.

A real session is opened on a real broker after the harshest configuration a runtime can
apply: ``dictConfig`` with ``disable_existing_loggers`` (which disables every logger it does
not name), a root logger at CRITICAL with no handler, and ``logging.disable``.
"""

from __future__ import annotations

import logging
import logging.config
import types

import pytest

from kvcached_broker.adapters import process_state, sessions, worker_identity

from helpers import GIB, adapter_line, connect_to


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
    process_state.reset()
    sessions.set_client_factory(connect_to(b.endpoint))
    yield b
    process_state.reset()
    sessions.set_client_factory(None)


def _lines(err: str, event: str) -> list[str]:
    return [line for line in err.splitlines() if f"event={event}" in line]


def test_one_active_line_and_one_instance_warning_past_any_logging_configuration(
    adapter_broker, silenced_logging, monkeypatch, capsys
):
    monkeypatch.delenv("KVCACHED_BROKER_INSTANCE", raising=False)
    first = sessions.session(worker_identity.WorkerIdentity("sglang", 0))
    sessions.session(worker_identity.WorkerIdentity("sglang", 1))  # a second device in the process: no second line
    err = capsys.readouterr().err
    (active,) = _lines(err, "adapter_active")
    (unset,) = _lines(err, "instance_default")
    name = worker_identity.WorkerIdentity("sglang", 0).instance_name()
    assert adapter_line(active, "INFO", "adapter_active") and f"instance={name}" in active
    assert f"endpoint={adapter_broker.endpoint}" in active and f"session={first.client.session_id}" in active
    assert "runtime=sglang" in active and "hook=explicit" in active
    assert adapter_line(unset, "WARNING", "instance_default") and f"instance={name}" in unset
    assert "KVCACHED_BROKER_INSTANCE is unset" in unset


def test_no_instance_warning_when_the_name_is_set(adapter_broker, monkeypatch, capsys):
    monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", "named")
    sessions.session(worker_identity.WorkerIdentity("vllm", 0))
    err = capsys.readouterr().err
    assert len(_lines(err, "adapter_active")) == 1 and _lines(err, "instance_default") == []


def test_the_broker_shows_which_adapter_opened_each_session(adapter_broker, monkeypatch):
    monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", "named")
    sessions.session(worker_identity.WorkerIdentity("vllm", 0))
    (inst,) = adapter_broker.status()["instances"]
    adapter = inst["sessions"][0]["adapter"]
    assert adapter == worker_identity.adapter_info("vllm") and adapter["runtime"] == "vllm"


@pytest.mark.parametrize("name", ["llama-a", None])
def test_a_process_without_a_session_names_its_instance_in_its_active_line(monkeypatch, capsys, name):
    """vLLM's EngineCore: the same line as a worker's, ``instance=`` included (``default`` when
    the variable is unset: the default comes from the workers' process group, which it is not in)."""
    if name is None:
        monkeypatch.delenv("KVCACHED_BROKER_INSTANCE", raising=False)
    else:
        monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", name)
    process_state.reset()
    worker_identity.announce_process("vllm", "engine_core")
    (active,) = _lines(capsys.readouterr().err, "adapter_active")
    assert f"instance={name or 'default'} " in active and "role=engine_core" in active
    assert adapter_line(active, "INFO", "adapter_active") and " event=adapter_active runtime=vllm " in active
    process_state.reset()


#: vLLM's logging configuration (vllm/logger.py, DEFAULT_LOGGING_CONFIG, applied at import): its
#: own logger with a handler and propagate=False, the root logger bare
VLLM_LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"vllm": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO",
                          "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
}


def _sglang_logging(level: str) -> None:
    """SGLang's configure_logger (sglang/srt/utils): basicConfig(force=True) at --log-level."""
    logging.basicConfig(level=getattr(logging, level.upper()), format="[%(asctime)s] %(message)s", force=True)


@pytest.fixture
def restored_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.disable(logging.NOTSET)
    for existing in logging.Logger.manager.loggerDict.values():
        if isinstance(existing, logging.Logger):
            existing.disabled = False


@pytest.mark.parametrize("configure", ["vllm", "sglang_error", "sglang_info", "disabled"])
def test_every_adapter_info_and_warning_line_reaches_stderr_once_with_prefix_level_and_time(
        configure, restored_logging, capsys, tmp_path, monkeypatch):
    """The adapters' own INFO and WARNING lines (a patch applied, a patch that failed) under each
    runtime's logging configuration: on stderr, once each, ``kvcached-broker: LEVEL TIME event=...``;
    never dropped by vLLM's config (INFO) or SGLang's level, never bare through lastResort, never
    a second copy through SGLang's root handler."""
    from kvcached_broker.adapters.patching import Patch, apply_patch

    if configure == "vllm":
        logging.config.dictConfig(VLLM_LOGGING)
    elif configure.startswith("sglang"):
        _sglang_logging(configure.split("_")[1])
    else:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": True, "root": {"level": "CRITICAL"}})
        logging.disable(logging.CRITICAL)
    capsys.readouterr()
    module = types.ModuleType("fake_runtime_module")

    def broken(mod):
        raise RuntimeError("no such hook")

    apply_patch(Patch("fake_ok", "pytest", module.__name__, lambda mod: None), module)
    apply_patch(Patch("fake_broken", "pytest", module.__name__, broken, required=False), module)
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if "event=patch" in line]
    assert len(lines) == 2, out + err
    (applied,) = [line for line in lines if "patch=fake_ok" in line]
    (failed,) = [line for line in lines if "patch=fake_broken" in line]
    assert adapter_line(applied, "INFO", "patch") and applied in err
    assert adapter_line(failed, "WARNING", "patch") and failed in err
