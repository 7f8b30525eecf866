"""Short versions of bench_scale's scenarios, run through the benchmark's own code (no timing assertions).

- (c): the demo's scenario at a few hundred rollouts checkpointing to S3 (moto's server on
  127.0.0.1): every rollout restored or started over, each result equal to the uninterrupted
  run's, the checkpoint verified on S3, and each Gym server's memory read around the commit
  and the restore.
- The command line: ``--scenario b`` with a few small sessions, its exit status and ``--json``;
  the scenarios chosen and the options passed through to the stack and the demo.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import pytest
from rich.console import Console

from benchmarks.bench_scale import build_parser
from benchmarks.bench_scale import main as bench_scale
from benchmarks.scale_demo import DemoKnobs, run_demo_scenario
from gymckpt import transport

if TYPE_CHECKING:
    from pathlib import Path

    from gymckpt.testing.moto import MotoEndpoint

GYM = {"environment", "model", "agent", "resources"}


def test_a_few_hundred_rollouts_checkpointed_to_s3_come_back_equal(tmp_path: Path, moto_endpoint: MotoEndpoint) -> None:
    bucket = "scale-scenario-c"
    moto_endpoint.create_bucket(bucket)
    knobs = DemoKnobs(rollouts=200, timeout=300.0, profile=False, sample_seconds=0.2)
    with open(os.devnull, "w") as sink:
        run = run_demo_scenario(
            "c",
            knobs,
            1,
            tmp_path,
            Console(file=sink),
            store_url=f"s3://{bucket}/checkpoints",
            storage_options=moto_endpoint.storage_options(),
        )
    assert run.ok, run.error  # the demo compared every result and verified the checkpoint on S3
    assert run.store == "s3"
    assert (run.lost, run.differing) == (0, 0)
    assert run.exported > 0
    assert run.continued == run.exported
    assert run.finished_before + run.exported + run.restarted + run.started_after_restore == run.rollouts
    assert {name.partition("/")[0] for name in run.bytes_by_participant} == GYM
    assert run.bytes_written == sum(run.bytes_by_participant.values()) > 0
    for phase in ("commit", "restore"):
        windows = run.memory[phase]
        assert set(windows) == GYM, (phase, windows)
        for name, memory in windows.items():
            assert 0 < memory.rss_before <= memory.peak, (phase, name, memory)
        assert sum(memory.records_bytes for memory in windows.values()) == run.bytes_written
    assert set(run.participant_lines["commit"]) == GYM
    for phase in ("commit", "restore"):  # the controller's call to each server holds the server's own time
        assert set(run.call_seconds[phase]) == GYM, run.call_seconds
        for name, line in run.participant_lines[phase].items():
            assert run.call_seconds[phase][name] >= float(line.partition(" ")[0]) - 0.01, (phase, name, line)


def test_the_command_line_runs_scenario_b_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    arguments = ["--scenario", "b", "--sessions", "4", "--session-bytes", "20000"]
    status = bench_scale([*arguments, "--dir", str(tmp_path / "runs"), "--json", str(out)])
    assert status == 0
    figures = json.loads(out.read_text())
    assert (figures["a"], figures["c"], figures["c_commit_ratio"]) == ([], [], None)
    sessions = figures["b"]
    assert (sessions["ok"], sessions["lost"], sessions["differing"]) == (True, 0, 0)
    assert (sessions["sessions"], sessions["records"]) == (4, 4)
    assert sessions["bytes_written"] > 4 * 20_000
    assert sessions["write_fsync_seconds"] > 0  # the machine's own write of those bytes, beside the checkpoint
    for phase in ("commit", "restore"):
        (memory,) = sessions["memory"][phase].values()
        assert memory["records_bytes"] == sessions["bytes_written"]
        assert memory["peak"] >= memory["rss_before"] > 0
        assert memory["bound"] > memory["rss_before"]
    assert not list((tmp_path / "runs").iterdir())  # a run that passed leaves nothing behind


def test_scenarios_and_pass_through_options_are_read_from_the_command_line() -> None:
    given = ["--scenario", "c,a", "--stack-option", "prompt_tokens=300", "--demo-option", "checkpoint_turn=2"]
    args = build_parser().parse_args([*given, "--stack-option", "label=long text", "--sessions", "20"])
    assert args.scenario == ["a", "c"]
    assert dict(args.stack_option) == {"prompt_tokens": 300, "label": "long text"}
    assert dict(args.demo_option) == {"checkpoint_turn": 2}
    assert (args.sessions, args.session_bytes) == (20, 350_000)
    for wrong in (["--scenario", "d"], ["--scenario", ""], ["--stack-option", "novalue"], ["--checkpoint-turn", "-1"]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(wrong)
        assert exited.value.code == 2


def test_connection_pools_fit_the_stack_into_the_descriptors() -> None:
    from benchmarks.bench_scale import connection_pools

    for descriptors in (20_000, 65_536, 4_096):
        pools = connection_pools(descriptors, 16_000)
        # the environment and the agent hold two connections per rollout inside the agent, their pools to the
        # resources server and the awaited lanes beside them; the trainer's pool is no larger than the data pool
        beside = pools.resources + 2 * transport.AWAITED_POOL_LIMIT
        assert 2 * pools.data + beside <= descriptors - 1_000, (descriptors, pools)
        assert pools.trainer == pools.data > 0 and pools.resources > 0, (descriptors, pools)
    assert connection_pools(20_000, 300).data == 300  # a short run: every rollout inside the agent at once
    assert connection_pools(20_000, 16_000).data >= 9_000  # the acceptance wants 8,000 past their first turn
    # the generations decoding at once stay at a server's own bound, however many rollouts fit inside the agent
    assert connection_pools(20_000, 16_000).inference == transport.DOWNSTREAM_POOL_LIMIT
    assert connection_pools(20_000, 300).inference == 300


def test_the_models_pool_to_the_inference_backend_is_the_servers_bound_split_over_its_workers() -> None:
    from gymckpt.stack.harness import default_stack_spec

    def model_config(**options: int) -> dict[str, object]:
        spec = default_stack_spec(token="t", data_pool_limit=9_000, **options)
        return next(server["config"] for server in spec["servers"] if server["name"] == "model")

    assert model_config(inference_pool_limit=1_024)["data_connector_limit"] == 1_024
    two = model_config(inference_pool_limit=1_023, workers=2)
    assert two["data_connector_limit"] == two["data_connector_limit_per_host"] == 512  # each worker's share
    assert model_config()["data_connector_limit"] == 9_000  # without it: the data pool


def test_a_data_pool_limit_reaches_every_gym_server_and_not_the_inference_backend() -> None:
    from gymckpt.stack.harness import StateSizes, default_stack_spec

    spec = default_stack_spec(token="t", data_pool_limit=9_000, sizes=StateSizes())
    configs = {server["name"]: server.get("config", {}) for server in spec["servers"]}
    for name in ("model", "resources", "agent", "environment"):
        assert configs[name]["data_connector_limit"] == configs[name]["data_connector_limit_per_host"] == 9_000
    own = default_stack_spec(token="t", data_pool_limit=9_000, resources_pool_limit=512)
    bounds = {server["name"]: server.get("config", {}).get("data_connector_limit_by_url") for server in own["servers"]}
    # the two that call the resources server give it a pool of its own
    calling = {"agent": {"{resources}": 512}, "environment": {"{resources}": 512}}
    assert bounds == {"inference": None, "model": None, "resources": None, **calling}
    assert configs["resources"]["output_chars"] == StateSizes().tool_output_chars  # kept beside the pool
    assert "data_connector_limit" not in configs["inference"]
    assert all(
        "data_connector_limit" not in server.get("config", {}) for server in default_stack_spec(token="t")["servers"]
    )


def test_the_stacks_servers_keep_idle_connections_to_one_another_within_half_their_keep_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every server of the reference stack is gymckpt's (keep-alive GYMCKPT_KEEP_ALIVE, 75 s): its callers
    keep an idle connection 30 s, not the 4 s kept for servers of unknown keep-alive; never past half
    the keep-alive, so a server never closes a connection its caller is about to reuse."""
    from gymckpt.stack.harness import STACK_IDLE_SECONDS, default_stack_spec

    def idle(**options: object) -> dict[str, object]:
        spec = default_stack_spec(token="t", **options)  # type: ignore[arg-type]
        return {
            server["name"]: server.get("config", {}).get("data_connector_idle_seconds") for server in spec["servers"]
        }

    monkeypatch.delenv(transport.KEEP_ALIVE_ENV, raising=False)
    callers = {"model", "agent", "environment"}  # the inference backend and the resources server call no one
    assert STACK_IDLE_SECONDS > transport.CLIENT_IDLE_SECONDS
    assert idle() == {name: STACK_IDLE_SECONDS if name in callers else None for name in idle()}
    monkeypatch.setenv(transport.KEEP_ALIVE_ENV, "10")
    assert {idle()[name] for name in callers} == {5.0}
    assert {idle(pool_idle_seconds=2.5)[name] for name in callers} == {2.5}
