"""The Ray launcher's parts that need no cluster: the ``ray:`` block, checkpoint locations, the lifeline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gymckpt.errors import SettingsError
from gymckpt.stack import load_stack
from gymckpt.stack.lifeline import group_members
from gymckpt.stack.ray_plan import RayOptions, checkpoint_locations, local_path

SERVERS = ["inference", "environment"]


def test_the_ray_block_is_read_with_its_defaults() -> None:
    assert RayOptions.from_block(None, SERVERS) == RayOptions()
    options = RayOptions.from_block(
        {
            "address": "10.0.0.5:6379",
            "placement": "pack",
            "cpus_per_server": 2,
            "checkpoint_dir": "s3://b/run",
            "resources": {"inference": {"gpu_host": 1}},
            "log_dir": "/var/log/gymckpt",
        },
        SERVERS,
    )
    assert options.strategy == "PACK" and options.cpus_per_server == 2.0
    assert options.log_dir == "/var/log/gymckpt" and RayOptions().log_dir is None
    assert options.resources == {"inference": {"gpu_host": 1.0}}


@pytest.mark.parametrize(
    ("block", "key", "why"),
    [
        ({"placment": "spread"}, "ray.placment", "did you mean 'placement'"),
        ({"placement": "scatter"}, "ray.placement", "give spread or pack"),
        ({"cpus_per_server": 0}, "ray.cpus_per_server", "positive"),
        ({"cpus_per_server": True}, "ray.cpus_per_server", "positive"),
        ({"resources": {"agent": {"x": 1}}}, "ray.resources.agent", "names no server"),
        ({"resources": {"inference": {"x": -1}}}, "ray.resources.inference", "positive amount"),
        ({"checkpoint_dir": ""}, "ray.checkpoint_dir", "s3:// URL or a path"),
        ({"log_dir": "logs"}, "ray.log_dir", "absolute path"),
        ({"log_dir": 3}, "ray.log_dir", "absolute path"),
    ],
)
def test_a_bad_ray_block_is_refused_naming_the_key(block: dict[str, object], key: str, why: str) -> None:
    with pytest.raises(SettingsError) as caught:
        RayOptions.from_block(block, SERVERS, "stack.yaml")
    assert [problem for problem, _ in caught.value.problems] == [key]
    assert why in str(caught.value) and str(caught.value).startswith("stack.yaml: ")


def test_object_stores_need_no_probe_and_paths_do() -> None:
    assert local_path("s3://bucket/run") is None and local_path("gs://bucket/run") is None
    assert local_path("/mnt/shared/run") == "/mnt/shared/run"
    assert local_path("file:///mnt/shared/run") == "/mnt/shared/run"
    assert local_path("memory://run") == "memory://run"  # one process's memory: the probe refuses it
    options = RayOptions(checkpoint_dir="s3://b/run")
    assert checkpoint_locations(options, {"allowed_roots": ["/a", "/b"]}) == [
        ("ray.checkpoint_dir", "s3://b/run"),
        ("checkpoint.allowed_roots[0]", "/a"),
        ("checkpoint.allowed_roots[1]", "/b"),
    ]


def test_a_one_machine_stack_file_may_hold_a_ray_block_and_a_misspelled_one_is_refused() -> None:
    spec = {"ray": {"placement": "spread"}, "servers": [{"name": "c", "kind": "counter"}]}
    with load_stack(spec) as stack:
        assert list(stack.servers) == ["c"]
    with pytest.raises(SettingsError, match="did you mean 'ray'"):
        load_stack({"rya": {}, "servers": [{"name": "c", "kind": "counter"}]})


def test_the_ray_stack_refuses_a_bad_ray_block_before_touching_a_cluster() -> None:
    pytest.importorskip("ray")
    from gymckpt.stack.ray import RayStack

    with pytest.raises(SettingsError, match=r"ray\.placement"):
        RayStack({"ray": {"placement": "x"}, "servers": [{"name": "c", "kind": "counter"}]}, address="127.0.0.1:1")
    with pytest.raises(SettingsError, match="names no server"):
        RayStack({"servers": [{"name": "c", "kind": "counter", "config": {"x": "{nobody}"}}]}, address="127.0.0.1:1")


def test_the_head_gone_is_one_typed_error_naming_ray_gcs_fault_tolerance() -> None:
    pytest.importorskip("ray")
    from gymckpt.errors import RayHeadLost
    from gymckpt.stack.ray import RayStack

    stack = RayStack({"servers": [{"name": "c", "kind": "counter"}]}, address="127.0.0.1:1")
    with socket.socket() as closed:  # a port nothing listens on: the head's GCS, gone
        closed.bind(("127.0.0.1", 0))
        stack._gcs_address = f"127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(RayHeadLost) as caught:
            stack.check_head()
    message = str(caught.value)
    assert message.startswith("Ray's head node is gone") and "\n" not in message
    assert "external GCS store" in message and "cannot recover" in message


# --- the lifeline: no server outlives its host actor

#: a command that starts a grandchild in its group and waits (a server and its worker)
FAMILY = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"


def _wait_empty(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        assert time.monotonic() < deadline, f"process group {pgid} still has {group_members(pgid)}"
        time.sleep(0.02)


def _lifeline(command: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    read_end, write_end = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "gymckpt.stack.lifeline", "--", *command],
        stdin=read_end,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    os.close(read_end)
    return process, write_end


def test_the_whole_group_dies_when_the_lifeline_closes() -> None:
    process, write_end = _lifeline([sys.executable, "-c", FAMILY])
    try:
        deadline = time.monotonic() + 30
        while (
            len(group_members(process.pid)) < 3
        ):  # lifeline (not counted: group_members skips only us), child, grandchild
            assert time.monotonic() < deadline, "the family did not start"
            time.sleep(0.02)
    finally:
        os.close(write_end)  # what the kernel does when the host actor dies, however it dies
    assert process.wait(30) == 137
    _wait_empty(process.pid)


def test_a_command_that_exits_takes_its_group_along_and_its_status_is_kept() -> None:
    command = (
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); sys.exit(3)"
    )
    process, write_end = _lifeline([sys.executable, "-c", command])
    try:
        assert process.wait(30) == 3
        _wait_empty(process.pid)
    finally:
        os.close(write_end)


def test_stack_up_ray_refuses_a_bad_ray_block_in_one_line_before_joining_a_cluster(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text("ray: {placement: scatter}\nservers:\n  - {name: c, kind: counter}\n")
    done = subprocess.run(
        [sys.executable, "-m", "gymckpt", "stack", "up", str(stack_file), "--ray", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {stack_file}: ray.placement: "), done.stderr


#: a process owning a "cluster": SIGTERM must reach its teardown, and a second one must not cut that short
_TERMINATED = """
import os, signal, sys
from gymckpt.testing.raycluster import Terminated, sigterm_unwinds
with sigterm_unwinds():
    try:
        print("ready", flush=True)
        sys.stdin.readline()  # the test sends SIGTERM meanwhile
        print("not interrupted", flush=True)
    except Terminated as exc:
        print(f"terminated: {exc}", flush=True)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM, during the teardown
        print("teardown done", flush=True)
print("default restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


def test_sigterm_runs_the_teardown_of_a_cluster_owner_once() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _TERMINATED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdin is not None
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(15)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert out.splitlines() == ["terminated: signal 15", "teardown done", "default restored: True"]
    assert process.returncode == 0


#: a driver as run_driver runs it: its request and result files are its last two arguments
_DRIVER = """
import json, signal, sys
request = json.loads(open(sys.argv[-2]).read())
if request["then"] == "answer":
    open(sys.argv[-1], "w").write(json.dumps({"echo": request["value"]}))
elif request["then"] == "cut short":
    open(sys.argv[-1], "w").write(json.dumps({"echo": request["value"]})[:-3])
elif request["then"] == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("hanging", flush=True)
    signal.pause()
sys.exit(request.get("status", 0))
"""


@pytest.mark.parametrize(
    ("request_body", "bound", "expected"),
    [
        ({"then": "answer", "value": 7}, 60.0, (0, {"echo": 7}, False, None)),
        ({"then": "exit", "status": 3}, 60.0, (3, None, False, "the controller exited 3 without a result")),
        (
            {"then": "cut short", "value": 7, "status": 1},
            60.0,
            (1, None, False, "the controller exited 1 with a result file that is not JSON ("),
        ),
        ({"then": "hang"}, 0.5, (-15, None, True, "the controller did not finish within 0.5 s and was stopped")),
    ],
)
def test_a_driver_is_run_to_its_result_or_stopped_past_its_bound(
    tmp_path: Path, request_body: dict[str, object], bound: float, expected: tuple[object, ...]
) -> None:
    from gymckpt.testing.raycluster import run_driver

    (tmp_path / "result.json").write_text('{"stale": true}')  # an earlier run's result is never taken for this one's
    run = run_driver([sys.executable, "-c", _DRIVER], request_body, tmp_path, bound=bound)
    returncode, result, timed_out, failure = expected
    assert (run.returncode, run.result, run.timed_out) == (returncode, result, timed_out)
    if failure is not None:
        assert run.failure(bound).startswith(failure), run.failure(bound)
