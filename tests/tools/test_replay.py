"""The replay tool (tools/replay.py, `kvcached-broker replay`): a generated trace under every policy, and a bad trace."""

from __future__ import annotations

import subprocess
import sys


def test_replay_tool_runs_a_small_trace_under_every_policy(tmp_path):
    trace = tmp_path / "trace.jsonl"
    cli = [sys.executable, "-m", "kvcached_broker.broker.cli", "replay"]
    assert subprocess.run(cli + ["--generate", str(trace), "--duration", "8"], capture_output=True).returncode == 0
    out = subprocess.run(cli + [str(trace), "--speed", "8", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    results = json.loads((tmp_path / "r.json").read_text())
    assert {(r["policy"], r["model"]) for r in results} == {
        (p, m) for p in ("static", "fcfs", "policy") for m in ("llama-a", "llama-b", "llama-c", "deepseek-v4")}
    for r in results:
        assert 0 <= r["served_gib_s"] <= r["asked_gib_s"] + 1e-6
    assert "worst model" in out.stdout


def test_replay_refuses_a_bad_trace(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"kind": "gpu", "total_bytes": 1}\n')
    out = subprocess.run([sys.executable, "-m", "kvcached_broker.broker.cli", "replay", str(trace)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "bad.jsonl:1" in out.stderr

