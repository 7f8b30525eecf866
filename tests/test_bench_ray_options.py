"""``make bench-ray``'s options: the state each rollout carries and the checkpoint's trigger, for both sides."""

from __future__ import annotations

import pytest

from benchmarks import bench_ray
from benchmarks.bench_ray import _pool_limits, _sizes, _trigger, build_parser
from gymckpt.demo.launch import TurnTrigger
from gymckpt.stack.harness import StateSizes


def test_realistic_state_by_count_unless_told_otherwise() -> None:
    args = build_parser().parse_args([])
    assert (args.state, args.checkpoint_turn) == ("realistic", 0)
    assert _sizes(args) == StateSizes() and _trigger(args) is None

    args = build_parser().parse_args(["--state", "compact", "--checkpoint-turn", "2", "--checkpoint-share", "0.5"])
    assert _sizes(args) == StateSizes.compact()
    assert _trigger(args) == TurnTrigger(turn=2, share=0.5)


def test_by_turn_the_share_is_of_the_rollouts_that_fit_inside_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """As bench_scale's (a): at 20,000 descriptors 9,116 rollouts fit inside the agent at once, and the
    checkpoint waits for 0.92 of them at the turn; both sides get the pools that fit."""
    monkeypatch.setattr(bench_ray.resource, "getrlimit", lambda _: (20_000, 20_000))
    args = build_parser().parse_args(["--rollouts", "16000", "--checkpoint-turn", "2"])
    trigger = _trigger(args)
    assert trigger is not None and trigger.turn == 2
    assert round(trigger.share * 16_000) == round(0.92 * 9_116)
    # the generations decoding at once stay at a server's own bound
    assert _pool_limits(args) == {"data_pool_limit": 9_116, "resources_pool_limit": 512, "inference_pool_limit": 1_024}
    # fewer rollouts than fit: the share is of all of them
    args = build_parser().parse_args(["--rollouts", "2000", "--checkpoint-turn", "2"])
    assert _trigger(args) == TurnTrigger(turn=2, share=0.92)


@pytest.mark.parametrize(
    "wrong",
    [
        ["--state", "big"],
        ["--checkpoint-turn", "-1"],
        ["--checkpoint-turn", "two"],
        ["--scenario", "c"],
        ["--sessions", "0"],
    ],
)
def test_a_refused_option_is_exit_status_2(wrong: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(wrong)
    assert exited.value.code == 2
