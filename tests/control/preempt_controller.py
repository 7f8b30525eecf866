"""A controller for ``test_preemption.py``: rollouts in flight, a :class:`PreemptionGuard`, SIGTERM ends it.

Run as ``python -m tests.control.preempt_controller --result FILE --root DIR --grace S
--token T --inference URL --environment URL SERVER_URL...`` (the Gym servers' URLs). It
discovers the servers, sends one environment ``/run`` per ``--rollouts``, waits until each
made a model call (in flight), enters the guard (SIGTERM is a notice) and prints ``READY``
on stdout. On the notice the guard checkpoints; the script writes the
:class:`PreemptionResult` (and the episodes the guard was told were in flight) to FILE as
JSON and exits 0 when it was published within the grace, else 1. Logging goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

import aiohttp

from gymckpt import transport
from gymckpt.control.coordination import Coordinator
from gymckpt.control.preemption import PreemptionGuard
from gymckpt.stack.harness import task_for

#: the bound of every wait of this script (seconds)
WAIT = 120.0


async def wait_in_flight(http: aiohttp.ClientSession, inference: str, keys: list[str]) -> None:
    """Until the inference backend logged a model call of every key (bounded by :data:`WAIT`)."""
    deadline = time.monotonic() + WAIT
    while True:
        async with http.get(f"{inference}/calls") as response:
            calls = await response.json()
        started = {str(call["call_id"]).rsplit(":", 1)[0] for call in calls}
        if set(keys) <= started:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no model call of {sorted(set(keys) - started)} within {WAIT} s")
        await asyncio.sleep(0.05)


async def main(args: argparse.Namespace) -> int:
    keys = [f"pre-{index}" for index in range(args.rollouts)]
    told: list[list[str]] = []
    async with Coordinator(args.servers, token=args.token) as gym:
        (await gym.discover()).raise_for_problems()
        http = transport.client_session(timeout=aiohttp.ClientTimeout(total=WAIT))
        runs: dict[str, asyncio.Task[Any]] = {}
        try:

            async def run(key: str, index: int) -> Any:
                body = {"episode_id": key, "task": task_for(index)}
                async with http.post(f"{args.environment}/run", json=body) as response:
                    return await response.json()

            for index, key in enumerate(keys):
                runs[key] = asyncio.create_task(run(key, index))

            def in_flight() -> list[str]:
                keys_now = [key for key, run in runs.items() if not run.done()]
                told.append(keys_now)
                return keys_now

            await wait_in_flight(http, args.inference, keys)
            guard = PreemptionGuard(gym, grace_seconds=args.grace, checkpoint_root=args.root, in_flight=in_flight)
            async with guard:
                print("READY", flush=True)
                result = await asyncio.wait_for(guard.wait(), WAIT)
            report = {
                "checkpoint_id": result.checkpoint_id,
                "published": result.published,
                "seconds": result.seconds,
                "grace_seconds": result.grace_seconds,
                "within_grace": result.within_grace,
                "finished_open": result.finished_open,
                "continued": list(result.checkpoint.continued),
                "restarts": list(result.checkpoint.restarts),
                "stopped": result.checkpoint.stopped,
                "told_in_flight": told,
                "notices": guard.notices,
                "line": result.line(),
            }
            with open(args.result, "w") as out:
                json.dump(report, out)
            return 0 if result.ok else 1
        finally:
            for run in runs.values():
                run.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)
            await http.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="preempt_controller")
    parser.add_argument("servers", nargs="+")
    parser.add_argument("--result", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--inference", required=True)
    parser.add_argument("--environment", required=True)
    parser.add_argument("--rollouts", type=int, default=3)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
