"""Endpoint discovery (docs/design.md, "Environment"), device resolution, sizes, and what the packages import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached_broker.client import BrokerClient, BrokerUnavailable
from kvcached_broker.client.device import DeviceResolutionError, resolve_device
from kvcached_broker.client.endpoint import EndpointError, resolve_endpoint, runtime_dir
from kvcached_broker.client.units import SizeError, format_bytes, parse_headroom, parse_size

from helpers import GIB, MIB


@pytest.mark.parametrize(
    "text,expected",
    [("80GiB", 80 * GIB), ("512MiB", 512 * MIB), ("1.5GiB", 3 * GIB // 2), ("2G", 2 * GIB), ("512M", 512 * MIB),
     ("4096", 4096), ("1KiB", 1024), ("1TiB", 1 << 40), (" 3 gib ", 3 * GIB)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80GB", "1MB", "-1GiB", "GiB", "1.0000000001KiB", "1e9", "", "99999999TiB", "1 parsec"])
def test_parse_size_refuses(text):
    with pytest.raises(SizeError) as info:
        parse_size(text)
    assert "\n" not in str(info.value)


def test_headroom_size_or_percent():
    assert parse_headroom("5%", 100 * GIB) == (5 * GIB, 0.05)
    assert parse_headroom("4GiB") == (4 * GIB, None)
    for bad in ("100%", "-1%", "x%"):
        with pytest.raises(SizeError):
            parse_headroom(bad)
    assert format_bytes(3 * GIB) == "3.00 GiB" and format_bytes(None) == "none" and format_bytes(12) == "12 B"


def test_runtime_dir_order():
    assert runtime_dir({"KVCACHED_BROKER_RUNTIME_DIR": "/x/y"}) == __import__("pathlib").Path("/x/y")
    if os.getuid() == 0:
        assert str(runtime_dir({})) == "/run/kvcached"
    else:
        assert str(runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7"})) == "/run/user/7/kvcached"


def test_endpoint_templates_and_off():
    env = {"KVCACHED_BROKER_RUNTIME_DIR": "/r"}
    assert resolve_endpoint(2, env=env) == "ipc:///r/gpu2.sock"
    assert resolve_endpoint(3, env={"KVCACHED_BROKER": "ipc:///b/gpu{device}.sock"}) == "ipc:///b/gpu3.sock"
    assert resolve_endpoint(0, uuid="GPU-abc", env={"KVCACHED_BROKER": "ipc:///b/{uuid}.sock"}) == "ipc:///b/GPU-abc.sock"
    assert resolve_endpoint(0, env={"KVCACHED_BROKER": "tcp://127.0.0.1:5555"}) == "tcp://127.0.0.1:5555"
    assert resolve_endpoint(0, env={"KVCACHED_BROKER": "off"}) is None
    for bad in ("ipc://relative", "http://x", "ipc:///b/{uuid}.sock", "ipc:///{nope}", "ipc:///" + "x" * 200):
        with pytest.raises(EndpointError):
            resolve_endpoint(0, env={"KVCACHED_BROKER": bad})


def test_cuda_visible_devices_maps_ordinals_to_physical_indices():
    assert resolve_device(1, env={"CUDA_VISIBLE_DEVICES": "3,5"}).index == 5
    assert resolve_device("cuda:0", env={"CUDA_VISIBLE_DEVICES": "3,5"}).index == 3
    assert resolve_device(2, env={}).index == 2
    with pytest.raises(DeviceResolutionError):
        resolve_device(2, env={"CUDA_VISIBLE_DEVICES": "3,5"})
    with pytest.raises(DeviceResolutionError):
        resolve_device(0, env={"CUDA_VISIBLE_DEVICES": "GPU-deadbeef"})  # no NVML here to resolve it
    with pytest.raises(DeviceResolutionError):
        resolve_device("gpu0", env={})


def test_client_finds_its_gpus_broker_through_the_environment(inproc_factory, monkeypatch):
    b = inproc_factory(device=1)
    monkeypatch.setenv("KVCACHED_BROKER", b.endpoint.replace("inproc1", "inproc{device}"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with BrokerClient.connect("env-m", device=0, credit_pages=0) as c:  # cuda:0 here is GPU 1
        assert c.endpoint == b.endpoint
        assert c.acquire(1) == 1
        assert c.status()["device"]["index"] == 1


def test_client_refuses_when_the_broker_is_off(monkeypatch):
    monkeypatch.setenv("KVCACHED_BROKER", "off")
    with pytest.raises(BrokerUnavailable):
        BrokerClient.connect("m")


def test_connect_to_a_missing_broker_raises_unavailable_in_bounded_time(short_tmp):
    with pytest.raises(BrokerUnavailable) as info:
        BrokerClient.connect("m", endpoint=f"ipc://{short_tmp}/none.sock", timeout_s=0.5)
    assert "none.sock" in str(info.value)


def test_wrong_argument_types_are_refused_before_any_request(inproc):
    from kvcached_broker.client import BadRequest

    with pytest.raises(BadRequest):
        BrokerClient.connect("m", endpoint=inproc.endpoint, tp_rank=2, tp_size=2)
    with BrokerClient.connect("m", endpoint=inproc.endpoint, credit_pages=0) as c:
        for bad in (0, -1, 1.5, True, "3"):
            with pytest.raises(BadRequest):
                c.acquire(bad)
        with pytest.raises(BadRequest):
            c.reserve({"weights": -1})
        with pytest.raises(BadRequest):
            c.reserve(["weights"])
    assert not inproc.ledger.sessions


def test_broker_and_client_never_import_torch():
    code = (
        "import sys; import kvcached_broker.client, kvcached_broker.broker.server, kvcached_broker.broker.cli;"
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_client_does_not_import_the_broker():
    code = "import sys; import kvcached_broker.client; assert not [m for m in sys.modules if m.startswith('kvcached_broker.broker')]"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_no_top_level_broker_client_or_adapters_module_is_installed(tmp_path):
    code = (
        "import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')];"
        "print([m for m in ('broker', 'client', 'adapters') if importlib.util.find_spec(m)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
