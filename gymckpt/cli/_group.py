"""The ``gymckpt`` group: every command, each from its own module."""

from __future__ import annotations

import click

from gymckpt._version import __version__
from gymckpt.cli._errors import Group
from gymckpt.cli.collect import collect_command
from gymckpt.cli.demo import demo_command
from gymckpt.cli.inspect import inspect_command
from gymckpt.cli.serve import serve_command, stack_group
from gymckpt.cli.verify import verify_command

__all__ = ["main"]


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gymckpt")
def main() -> None:
    """Partial-rollout checkpointing for RL environment servers.

    \b
    gymckpt verify ./checkpoints/ckpt-7        check a checkpoint offline
    gymckpt inspect ./checkpoints/ckpt-7       list its participants
    gymckpt demo                               checkpoint in-flight rollouts, crash, restore, continue
    gymckpt serve KIND --port N [--workers N]  run one reference server
    gymckpt serve --app MODULE:ATTR --workers N  run your own FastAPI app the same way
    gymckpt stack up STACK.yaml                run a whole stack of them
    gymckpt collect DATA.jsonl --environment URL --out R.jsonl --checkpoint-dir DIR
                                               run a dataset, surviving preemption
    """


main.add_command(verify_command)
main.add_command(inspect_command)
main.add_command(serve_command)
main.add_command(stack_group)
main.add_command(demo_command)
main.add_command(collect_command)
