"""``make bench-ray``'s options: the state each rollout carries and the checkpoint's trigger, for both sides."""

from __future__ import annotations

import pytest

from benchmarks.bench_ray import _sizes, _trigger, build_parser
from gymckpt.demo.launch import TurnTrigger
from gymckpt.stack.harness import StateSizes


def test_realistic_state_by_count_unless_told_otherwise() -> None:
    args = build_parser().parse_args([])
    assert (args.state, args.checkpoint_turn) == ("realistic", 0)
    assert _sizes(args) == StateSizes() and _trigger(args) is None

    args = build_parser().parse_args(["--state", "compact", "--checkpoint-turn", "2"])
    assert _sizes(args) == StateSizes.compact()
    assert _trigger(args) == TurnTrigger(turn=2, share=0.5)


@pytest.mark.parametrize("wrong", [["--state", "big"], ["--checkpoint-turn", "-1"], ["--checkpoint-turn", "two"]])
def test_a_refused_option_is_exit_status_2(wrong: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(wrong)
    assert exited.value.code == 2
