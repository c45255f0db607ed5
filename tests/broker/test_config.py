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
        '[limits.capped]\nmax = "2GiB"\n[limits.floored]\nmin = "4GiB"\nweight = 2\npriority = -5\n'
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
        assert by_name["floored"]["priority"] == -5 and by_name["capped"]["priority"] == 0
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
        ('[limits.x]\npriority = 1001\n', "limits.x.priority"),
        ('[limits.x]\npriority = 1.5\n', "limits.x.priority"),
        ("lease = [\n", "not valid TOML"),
        ("hello_max_floor_share = 2\n", "key 'hello_max_floor_share'"),
        ('hello_max_floor_share = "lots"\n', "key 'hello_max_floor_share'"),
        ("hello_max_weight = 0\n", "key 'hello_max_weight'"),
        ("hello_max_priority = 1001\n", "key 'hello_max_priority'"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(short_tmp, text, needle):
    config = short_tmp / "bad.toml"
    config.write_text(text)
    out = BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="8GiB", args=["--config", str(config)]).expect_refusal()
    assert out.returncode == 2
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_bounds_on_a_hellos_limits_come_from_the_config_file(short_tmp):
    """Issue 26, item 5: what a worker's hello may ask for its own instance is an admin's to bound."""
    config = short_tmp / "gpu0.toml"
    config.write_text('simulate = "16GiB"\nheadroom = 0\nhello_max_floor_share = "25%"\nhello_max_weight = 2\n'
                      'hello_max_priority = 5\n')
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    with BrokerLauncher(endpoint, simulate=None, args=["--config", str(config)]) as broker:
        assert broker.status()["broker"]["hello_limits"] == {"max_floor_share": 0.25, "max_weight": 2.0,
                                                              "max_priority": 5}
        with BrokerClient.connect("greedy", endpoint=endpoint, page_bytes=GIB, credit_pages=0,
                                  limits={"min_bytes": 16 * GIB, "weight": 1e6, "priority": 1000}) as c:
            inst = next(i for i in c.status()["instances"] if i["name"] == "greedy")
            assert (inst["min_bytes"], inst["weight"], inst["priority"]) == (4 * GIB, 2.0, 5)


def test_bad_environment_value_names_the_variable(short_tmp):
    out = BrokerLauncher(f"ipc://{short_tmp}/g.sock", simulate="8GiB",
                         extra_env={"KVCACHED_BROKER_LEASE_S": "-2"}).expect_refusal()
    assert out.returncode == 2 and "KVCACHED_BROKER_LEASE_S" in out.stderr


# ------------------------------------------------------ bad input: one line, a usage exit
def _refusal(short_tmp, *, args=(), env=None, endpoint=None):
    endpoint = endpoint or f"ipc://{short_tmp}/gpu0.sock"
    return BrokerLauncher(endpoint, simulate="8GiB", args=list(args), extra_env=env).expect_refusal()


def _one_line(out, argparse: bool = False) -> str:
    """The error line: the only line, or for a flag argparse refused, the one after its usage."""
    lines = out.stderr.strip().splitlines()
    if argparse:
        assert lines[0].startswith("usage:") and "error: argument" in lines[-1], out.stderr[-3000:]
        return lines[-1]
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"\x00\xff\xfe\x01 binary", "not UTF-8 text"),
        (b"a = " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
        (b"b = " + b"{ a = " * 3000 + b"1" + b" }" * 3000 + b"\n", "nested too deeply"),
    ],
)
def test_a_binary_or_deeply_nested_config_file_is_a_one_line_usage_error(short_tmp, content, needle):
    """These gave tracebacks (a UnicodeDecodeError; a RecursionError, 3,002 lines)."""
    config = short_tmp / "bad.toml"
    config.write_bytes(content)
    out = _refusal(short_tmp, args=["--config", str(config)])
    assert out.returncode == 2 and needle in _one_line(out)


def test_a_config_file_too_large_to_be_one_is_refused_unread(short_tmp):
    config = short_tmp / "huge.toml"
    with open(config, "wb") as f:
        f.truncate(64 << 20)  # sparse: nothing a real config file would be
    out = _refusal(short_tmp, args=["--config", str(config)])
    assert out.returncode == 2 and "larger than" in _one_line(out)


@pytest.mark.parametrize(
    "where,value,needle",
    [
        ("config", "g" * 10_000_000, "larger than"),  # aborted the process inside the group lookup
        ("config", "g" * 900_000, "key 'socket_group'"),
        ("env", "g" * 100_000, "KVCACHED_BROKER_SOCKET_GROUP"),
        ("env", "9" * 10_000, "KVCACHED_BROKER_SOCKET_GROUP"),  # a ValueError from int()
        ("env", "no\nline", "KVCACHED_BROKER_SOCKET_GROUP"),
        ("cli", "x:y", "--socket-group"),
    ],
)
def test_an_impossible_group_name_is_a_one_line_usage_error(short_tmp, where, value, needle):
    args, env = [], None
    if where == "config":
        config = short_tmp / "group.toml"
        config.write_text(f'socket_group = "{value}"\n')
        args = ["--config", str(config)]
    elif where == "env":
        env = {"KVCACHED_BROKER_SOCKET_GROUP": value}
    else:
        args = ["--socket-group", value]
    out = _refusal(short_tmp, args=args, env=env)
    assert out.returncode == 2 and needle in _one_line(out, argparse=where == "cli")


def test_a_missing_curve_dir_is_a_usage_error_and_the_broker_exits(short_tmp):
    """It printed an error and then hung (the socket was left open, so the context never ended)."""
    from helpers import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    out = _refusal(short_tmp, args=["--curve-dir", str(short_tmp / "no-such-dir")], endpoint=endpoint)
    assert out.returncode == 2 and "no-such-dir" in _one_line(out, argparse=True)
    out = _refusal(short_tmp, env={"KVCACHED_BROKER_CURVE_DIR": str(short_tmp / "no-such-dir")}, endpoint=endpoint)
    assert out.returncode == 2 and "KVCACHED_BROKER_CURVE_DIR" in _one_line(out)
    empty = short_tmp / "empty-curve"
    empty.mkdir()
    out = _refusal(short_tmp, args=["--curve-dir", str(empty)], endpoint=endpoint)
    assert out.returncode == 1 and "server.key_secret" in _one_line(out)
