"""The configuration file and environment (broker/config.py): options, limits, precedence, errors."""

from __future__ import annotations

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB


def test_config_file_options_limits_and_precedence(short_tmp):
    config = short_tmp / "gpu0.toml"
    config.write_text(
        'simulate = "16GiB"\nheadroom = "1GiB"\nlease = 3\n'
        '[limits.capped]\nmax = "2GiB"\n[limits.floored]\nmin = "4GiB"\nweight = 2\n'
    )
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    with BrokerLauncher(endpoint, simulate=None, args=["--config", str(config), "--headroom", "2GiB"],
                        extra_env={"KVCACHED_BROKER_LEASE_S": "4"}) as broker:
        status = broker.status()
        assert status["total_bytes"] == 16 * GIB  # file
        assert status["headroom_bytes"] == 2 * GIB  # CLI beats file
        assert status["broker"]["lease_s"] == 4.0  # env beats file
        by_name = {i["name"]: i for i in status["instances"]}
        assert by_name["capped"]["max_bytes"] == 2 * GIB
        assert by_name["floored"]["min_bytes"] == 4 * GIB and by_name["floored"]["weight"] == 2.0
        with BrokerClient.connect("capped", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as c:
            assert c.acquire(3) == 0 and c.acquire(2) == 2  # the configured cap applies on arrival


@pytest.mark.parametrize(
    "text,needle",
    [
        ('lease = "soon"\n', "key 'lease'"),
        ('headroom = "5GB"\n', "key 'headroom'"),
        ('leese = 3\n', "unknown key 'leese'"),
        ('[limits.x]\nmax = "lots"\n', "limits.x.max"),
        ('[limits.x]\ncap = "1GiB"\n', "limits.x.cap"),
        ("lease = [\n", "not valid TOML"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(short_tmp, text, needle):
    config = short_tmp / "bad.toml"
    config.write_text(text)
    out = BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="8GiB", args=["--config", str(config)]).expect_refusal()
    assert out.returncode == 2
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_bad_environment_value_names_the_variable(short_tmp):
    out = BrokerLauncher(f"ipc://{short_tmp}/g.sock", simulate="8GiB",
                         extra_env={"KVCACHED_BROKER_LEASE_S": "-2"}).expect_refusal()
    assert out.returncode == 2 and "KVCACHED_BROKER_LEASE_S" in out.stderr
