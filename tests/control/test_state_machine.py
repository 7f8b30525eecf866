"""One control plane driven through random sequences of operations, checked against a plain model.

A Hypothesis ``RuleBasedStateMachine`` runs prepare, commit, publish, resume, renew,
retire, forget, lease expiry (an injected clock: real time plus the jumps the machine
makes), crash (a fresh control plane and participant, restored from the last *published*
checkpoint), restore, the controller's usual protocol, and the participant's own work
(steps, a step in flight, a readiness regression, a rollout that becomes a restart)
against one :class:`ControlPlane`, on one event loop owned by the machine, storing into a
local directory per run (under /dev/shm when there is one). Exports, writes, installs and
retires can be held past their deadline. A plain model (dicts, sets, lists) predicts
every reply and refusal; after every step the machine checks:

- the phase is the model's, and every phase change the plane made is one of C4's;
- admission, the lease, the marks and the participant's episodes are the model's;
- the manifests and ``checkpoint.json`` files in the store are exactly the ones the model
  committed and published: none appears after a resume returned, nor from a write that
  resume stopped (commits whose export or write is held are stopped by resume);
- a commit's records hold every episode of its scope the participant holds, as exported
  at the first commit (the cut, also after a failed store), byte for byte;
- a retired (marked) attempt never runs: ``run_step`` refuses it through ``plane.marks``;
- a restore installs the published records byte for byte, under the next attempt; an
  install that outlives its deadline keeps admission closed, and a retire waits for it.

The run must make at least ``MIN_STEPS`` rule steps and reach every scenario of
``MUST_SEE``. The held write needs one seam: :class:`ObservedPlane` overrides
``ControlPlane._store_for`` to wrap the local backend in a gate, and observes ``phase``
through a property. At the end, deterministic regressions for what the machine found.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from gymckpt import errors
from gymckpt.control.models import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    Phase,
    RestoreRequest,
    RetireRequest,
)
from gymckpt.control.participant import Participant
from gymckpt.control.plane import REMEMBERED_CHECKPOINTS, ControlPlane
from gymckpt.identity import capture_key, split_capture_key
from gymckpt.store import CheckpointStore, open_store, verify
from gymckpt.store._local import LocalBackend
from gymckpt.store.codec import encode_record, episode_id_of_line
from gymckpt.store.manifest import Manifest
from gymckpt.testing.participant import FakeParticipant, freed_by_retire
from gymckpt.testing.time import FakeClock

KIND = "environment"
INSTANCE = "env-0"
PARTICIPANT_DIR = f"gym/{KIND}/{INSTANCE}"
GRACE = 600.0
#: real seconds an operation that should finish at once may take (a generous bound, never reached)
LONG = 5.0
#: real seconds any one rule may take: a hang fails the run (and Hypothesis shrinks it) instead of stalling it
RULE_BOUND = 20.0

ROLLOUTS = ["r0", "r1", "r2", "r3"]
KEYS = st.builds(capture_key, st.sampled_from(ROLLOUTS), st.integers(0, 2))

LEGAL = {
    (Phase.IDLE, Phase.PREPARING),
    (Phase.PREPARING, Phase.PREPARED),
    (Phase.PREPARED, Phase.COMMITTED),
    (Phase.COMMITTED, Phase.IDLE),
    (Phase.PREPARING, Phase.IDLE),
    (Phase.PREPARED, Phase.IDLE),
    (Phase.IDLE, Phase.RESTORED),
    (Phase.RESTORED, Phase.IDLE),
}

#: every rule execution, over every example of the run
STEPS = 0
MIN_STEPS = 10_000
#: how often each scenario of interest ran, over the run (printed when the run fails its coverage check)
SEEN: Counter[str] = Counter()
#: scenarios every run must reach (each ran at least ~15 times in every measured run of 200 examples;
#: rarer ones, like a restart named in a scope or a restore from a missing directory, are only counted)
MUST_SEE = (
    "commit stored",
    "commit retried",
    "store retried after a failure",
    "commit conflicts with another manifest",
    "held export cancelled by resume",
    "held write stopped by resume",
    "lease expired: checkpoint",
    "lease expired: restore",
    "published",
    "restore compared byte for byte",
    "install outlived its restore",
    "retire waited for an install",
    "retire outlived its deadline",
    "retired attempt refused",
    "prepare waited for readiness",
)

_SPECIALS: list[Any] = [
    float("nan"),
    float("inf"),
    -float("inf"),
    2**70 + 1,
    -(2**65),
    "é\u2028😀",
    "\ud800",
    1.5,
    None,
    True,
    {"b": 1, "a": [float("nan")]},
]


def payload(key: str, step: int, salt: int) -> dict[str, Any]:
    """A small state with NaN, infinities, big ints, odd unicode, and a key order that varies."""
    items = [
        ("step", step),
        ("key", key),
        ("v", _SPECIALS[salt % len(_SPECIALS)]),
        ("nested", {"z": [salt, _SPECIALS[(salt * 7 + step) % len(_SPECIALS)]], "a": {"deep": [[[step]]]}}),
    ]
    shift = salt % len(items)
    return dict(items[shift:] + items[:shift])


def line(key: str, state: Any) -> bytes:
    return encode_record({"episode_id": key, "state": state})[1]


def refused_by(marks: dict[str, int], key: str) -> bool:
    rollout, attempt = split_capture_key(key)
    return attempt <= marks.get(rollout, -1)


def next_key(key: str) -> str:
    rollout, attempt = split_capture_key(key)
    return capture_key(rollout, attempt + 1)


def drop_up_to(state: dict[str, Any], keys: list[str]) -> None:
    """What the participant's retire frees: each key's attempt and every earlier one of its rollout."""
    for held in freed_by_retire(list(state), keys):
        del state[held]


def machine_clock() -> FakeClock:
    """Epoch seconds that run with real (monotonic) time from a fixed start, and jump when the machine says so."""
    return FakeClock(1_700_000_000.0, source=time.monotonic)


class MachineParticipant(FakeParticipant):
    """Episodes keyed by capture key; steps replace a state (never mutate it), so a cut stays put.

    The model's participant: a retire frees each key's attempt and every earlier one of its
    rollout (restarts among them too), and deleting restored episodes is a retire (the
    interface's default).
    """

    delete_restored = Participant.delete_restored

    def __init__(self) -> None:
        super().__init__(KIND, INSTANCE, frees_earlier_attempts=True)

    def free(self, key: str) -> None:
        super().free(key)
        self.restart_keys.discard(key)


class WriteGate:
    """Holds a records write after its bytes are durable and before it publishes (or fails it)."""

    def __init__(self, *, fail: bool) -> None:
        self.fail = fail
        self.entered = threading.Event()
        self.released = threading.Event()
        self.aborted = threading.Event()

    def enter(self) -> None:
        self.entered.set()
        if not self.fail:
            self.released.wait(60)
        if self.fail:
            raise errors.StorageError("injected: the storage failed before publication")

    def release(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.released.set()


class _GatedSink:
    def __init__(self, inner: Any, gate: WriteGate) -> None:
        self.inner = inner
        self.gate = gate

    def write(self, chunk: bytes | memoryview) -> None:
        self.inner.write(chunk)

    def finish(self) -> None:
        self.inner.finish()
        self.gate.enter()

    def publish(self, name: str) -> None:
        self.inner.publish(name)

    def abort(self) -> None:
        try:
            self.inner.abort()
        finally:
            self.gate.aborted.set()


class GatedLocalBackend(LocalBackend):
    def __init__(self, root: str, gate: WriteGate) -> None:
        super().__init__(root)
        self.gate = gate

    def open_sink(self, directory: str) -> Any:
        return _GatedSink(super().open_sink(directory), self.gate)


class ObservedPlane(ControlPlane):
    """Records every phase change; can hold the next commit's write behind a :class:`WriteGate`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.transitions: list[tuple[Phase, Phase]] = []
        self._observed: Phase | None = None
        self.write_gate: WriteGate | None = None
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def phase(self) -> Phase:
        assert self._observed is not None
        return self._observed

    @phase.setter
    def phase(self, value: Phase) -> None:
        if self._observed is not None and value != self._observed:
            self.transitions.append((self._observed, value))
        self._observed = value

    def _store_for(self, checkpoint_dir: str) -> CheckpointStore:
        store = super()._store_for(checkpoint_dir)
        gate, self.write_gate = self.write_gate, None
        if gate is None:
            return store
        store.close()
        return CheckpointStore(GatedLocalBackend(checkpoint_dir, gate))


def _quiet_abandoned_failures(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop "never retrieved" reports of the plane's own tasks failing as the machine meant them to
    (a commit whose write failed or was stopped, then abandoned by a crash); report anything else."""
    task = context.get("future")
    failure = context.get("exception")
    if (
        isinstance(task, asyncio.Task)
        and task.get_name().startswith("gymckpt-")
        and isinstance(failure, errors.GymckptError)
        and "never retrieved" in str(context.get("message", ""))
    ):
        return
    loop.default_exception_handler(context)


def _tmp_root() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="gymckpt-machine-", dir=base)


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet_abandoned_failures)
        self.root = Path(_tmp_root())
        self.clock = machine_clock()
        self.ids = 0
        self.salt = 0
        self.used_ids: list[str] = []
        # the store, as the model knows it (it outlives crashes)
        self.m_manifests: dict[str, str] = {}  # manifest path → sha256 of its bytes
        self.m_indexes: set[str] = set()  # checkpoint dirs with a checkpoint.json
        self.committed: dict[str, dict[str, Any]] = {}  # dir → {id, lines, published}
        self.published: dict[str, Any] | None = None
        self.write_gate: WriteGate | None = None
        self._new_process()

    # --- the process (plane + participant) and its model

    def _new_process(self) -> None:
        self.participant = MachineParticipant()
        self.plane = ObservedPlane(self.participant, lease_grace_seconds=GRACE, clock=self.clock)
        self.m_phase = Phase.IDLE
        self.m_open: str | None = None
        self.m_commit: dict[str, Any] | None = None
        self.m_resumed: deque[str] = deque(maxlen=REMEMBERED_CHECKPOINTS)
        self.m_export_failed: set[str] = set()
        self.m_fresh = True
        self.m_restore: dict[str, Any] | None = None
        self.m_marks: dict[str, int] = {}
        self.m_state: dict[str, Any] = {}
        self.m_busy: set[str] = set()
        self.m_restarts: set[str] = set()
        self.m_admission = True
        self.m_lease: float | None = None
        self.m_restored_keys: set[str] = set()
        #: held episodes whose attempt is refused without a retire having freed them: held when a
        #: restore marked them, or installed by a restore below an earlier retire's mark (never run)
        self.m_stale_held: set[str] = set()
        self.write_gate = None

    def _end_process(self) -> None:
        """The process dies: nothing of it runs on, and a held write never publishes."""
        if self.write_gate is not None:
            self.write_gate.release(fail=True)
            assert self.write_gate.aborted.wait(10), "the held write did not end"
            self.write_gate = None

        async def kill() -> None:
            await self.plane.close()
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        self.loop.run_until_complete(kill())

    def teardown(self) -> None:
        try:
            self._end_process()
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # --- helpers

    def step(self) -> None:
        global STEPS
        STEPS += 1

    def seen(self, scenario: str) -> None:
        SEEN[scenario] += 1

    def run(self, coro: Any) -> Any:
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, RULE_BOUND))
        except errors.GymckptError:
            raise  # DeadlineExceeded is a TimeoutError too
        except TimeoutError as exc:
            raise AssertionError(f"the operation hung for {RULE_BOUND} s") from exc

    def attempt(self, coro: Any) -> tuple[Any, BaseException | None]:
        try:
            return self.run(coro), None
        except errors.GymckptError as exc:
            return None, exc

    def expect(self, outcome: tuple[Any, BaseException | None], error: Any) -> Any:
        """Check an outcome: ``error`` is None (success), an error class, or a tuple of them."""
        result, raised = outcome
        if error is None:
            assert raised is None, f"expected success, got {raised!r}"
        else:
            assert isinstance(raised, error), f"expected {error}, got {raised!r} (result {result!r})"
        return result

    def new_id(self) -> str:
        self.ids += 1
        checkpoint_id = f"c{self.ids}"
        self.used_ids.append(checkpoint_id)
        return checkpoint_id

    def deadline(self, seconds: float = LONG) -> float:
        return self.clock() + seconds

    def dir_for(self, checkpoint_id: str) -> str:
        return str(self.root / checkpoint_id)

    def choose_id(self, data: Any, *, allow_new: bool) -> str:
        choices = []
        if self.m_open is not None:
            choices += [self.m_open] * 3
        if self.m_restore is not None:
            choices.append(self.m_restore["id"])
        if self.used_ids:
            choices.append(data.draw(st.sampled_from(self.used_ids), label="old id"))
        if allow_new or not choices:
            choices += ["new"] * 3
        chosen = data.draw(st.sampled_from(choices), label="id")
        return self.new_id() if chosen == "new" else chosen

    def next_payload(self, key: str, step: int) -> Any:
        self.salt += 1
        return payload(key, step, self.salt)

    @property
    def ready(self) -> bool:
        return not self.m_busy

    def store_files(self) -> tuple[dict[str, str], set[str]]:
        manifests: dict[str, str] = {}
        indexes: set[str] = set()
        for directory, _, files in os.walk(self.root):
            for name in files:
                path = os.path.join(directory, name)
                if name == "manifest.json":
                    manifests[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                elif name == "checkpoint.json":
                    indexes.add(str(Path(directory).parent))
        return manifests, indexes

    # --- the participant's own work

    @rule(
        data=st.data(),
        action=st.sampled_from(["run", "run", "begin", "begin", "end", "regress", "regress", "restart"]),
        keys=st.lists(KEYS, min_size=1, max_size=3),
    )
    def work(self, data: Any, action: str, keys: list[str]) -> None:
        """The participant's own work: a step, a step in flight, a regression, a restart."""
        self.step()
        if action == "begin" and any(k not in self.m_busy for k in self.m_state):
            self.begin_step(data)
        elif action == "end" and self.m_busy:
            self.end_step(data)
        elif action == "regress" and self.m_phase is Phase.PREPARED and self._regressable():
            self.regress(data)
        elif action == "restart" and self.m_admission and any(k not in self.m_restarts for k in self.m_state):
            self.mark_restart(data)
        else:
            for key in keys:
                self.run_step(key)

    def _regressable(self) -> list[str]:
        return sorted(k for k in self.m_state if k not in self.m_busy and k not in self.m_restarts)

    def run_step(self, key: str) -> None:
        """One step of an episode; refused for a retired attempt and while admission is closed."""

        async def work() -> str:
            self.plane.marks.check(key)  # the participant refuses a retired attempt's work
            if not self.participant.admission_open:
                raise errors.CheckpointParked("admission is closed")
            rollout, _ = split_capture_key(key)
            if key not in self.participant.state and any(
                split_capture_key(held)[0] == rollout for held in self.participant.state
            ):
                return "skipped"  # the harness never runs two attempts of one rollout at once
            if key in self.participant.busy:
                return "skipped"
            previous = self.participant.state.get(key)
            step = previous["step"] + 1 if previous is not None else 1
            self.participant.state[key] = self.next_payload(key, step)
            return "ran"

        if refused_by(self.m_marks, key):
            self.expect(self.attempt(work()), errors.StaleAttempt)
            self.seen("retired attempt refused")
            return
        if not self.m_admission:
            self.expect(self.attempt(work()), errors.CheckpointParked)
            return
        outcome = self.expect(self.attempt(work()), None)
        if outcome == "ran":
            self.m_state[key] = self.participant.state[key]
        else:
            rollout, _ = split_capture_key(key)
            assert key in self.m_busy or any(split_capture_key(held)[0] == rollout for held in self.m_state)

    def begin_step(self, data: Any) -> None:
        """A wait-mode step starts (admitted only while open): it blocks readiness until it ends."""
        key = data.draw(st.sampled_from(sorted(key for key in self.m_state if key not in self.m_busy)))

        async def begin() -> None:
            self.plane.marks.check(key)
            if not self.participant.admission_open:
                raise errors.CheckpointParked("admission is closed")
            self.participant.busy.add(key)
            self.participant.notify()

        if refused_by(self.m_marks, key):
            self.expect(self.attempt(begin()), errors.StaleAttempt)
            return
        if not self.m_admission:
            self.expect(self.attempt(begin()), errors.CheckpointParked)
            return
        self.expect(self.attempt(begin()), None)
        self.m_busy.add(key)

    def end_step(self, data: Any) -> None:
        """A step in flight completes (also while admission is closed): a new boundary."""
        key = data.draw(st.sampled_from(sorted(self.m_busy)))

        async def end() -> None:
            state = self.participant.state[key]
            self.participant.state[key] = self.next_payload(key, state["step"] + 1)
            self.participant.busy.discard(key)
            self.participant.notify()

        self.run(end())
        self.m_busy.discard(key)
        self.m_state[key] = self.participant.state[key]

    def regress(self, data: Any) -> None:
        """Readiness regresses after prepare (an execution leaves its boundary)."""
        key = data.draw(st.sampled_from(self._regressable()))

        async def regress() -> None:
            self.participant.busy.add(key)
            self.participant.notify()

        self.run(regress())
        self.m_busy.add(key)

    def mark_restart(self, data: Any) -> None:
        """An episode some server cannot capture becomes a restart (only while no checkpoint is open)."""
        key = data.draw(st.sampled_from(sorted(k for k in self.m_state if k not in self.m_restarts)))
        self.participant.restart_keys.add(key)
        self.m_restarts.add(key)

    # --- the controller's usual protocol

    @rule(
        data=st.data(),
        mode=st.sampled_from(["normal", "normal", "normal", "held_export", "held_write", "failing_store"]),
    )
    def controller(self, data: Any, mode: str) -> None:
        """The controller's next move in the usual protocol: prepare, commit, publish, resume."""
        self.step()
        if self.m_phase is Phase.RESTORED:
            assert self.m_restore is not None
            self._resume(self.m_restore["id"])
        elif self.m_open is None:
            # the controller dispatches rollouts, then checkpoints while they are in flight
            for key in data.draw(st.lists(KEYS, min_size=1, max_size=3), label="dispatch"):
                self.run_step(key)
            self._prepare(self.new_id(), finish_during=True)
        elif self.m_phase is Phase.PREPARING:
            self._prepare(self.m_open, finish_during=True)
        elif self.m_phase is Phase.PREPARED:
            held = self.m_commit is not None and self.m_commit["status"] in ("export_pending", "write_pending")
            if held and data.draw(st.booleans(), label="give up on the held commit"):
                self._resume(self.m_open)  # resume stops the held export or write
            else:
                self._commit(data, self.m_open, mode, release=True)
        else:
            directory = self.m_commit["args"][0] if self.m_commit is not None else ""
            if directory in self.committed and not self.committed[directory]["published"]:
                self._publish(directory)
            else:
                self._resume(self.m_open)

    # --- prepare

    @rule(data=st.data(), finish_during=st.booleans())
    def prepare(self, data: Any, finish_during: bool) -> None:
        self.step()
        self._prepare(self.choose_id(data, allow_new=True), finish_during)

    def _prepare(self, checkpoint_id: str, finish_during: bool) -> None:
        error: type[BaseException] | None = None
        if checkpoint_id in self.m_resumed:
            error = errors.StaleCheckpoint
        elif self.m_open is not None and self.m_open != checkpoint_id:
            error = errors.CheckpointConflict
        elif self.m_phase is Phase.RESTORED:
            assert self.m_restore is not None
            same = self.m_restore["id"] == checkpoint_id
            error = errors.InvalidPhase if same else errors.CheckpointConflict
        elif checkpoint_id in self.m_export_failed:
            error = errors.ExportFailed
        opens = error is None and self.m_open is None
        waits = error is None and (self.m_phase is Phase.PREPARING or opens)
        finish = finish_during and waits and bool(self.m_busy)
        # a prepare that must wait for a step in flight gives up after 100 ms (or the step ends meanwhile)
        deadline = self.deadline(0.1 if self.m_busy and not finish else LONG)
        request = ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline)

        async def go() -> Any:
            task = asyncio.ensure_future(self.plane.prepare(request))
            if finish:
                await asyncio.sleep(0)
                for key in sorted(self.participant.busy):
                    state = self.participant.state[key]
                    self.participant.state[key] = self.next_payload(key, state["step"] + 1)
                    self.participant.busy.discard(key)
                    self.participant.notify()
            return await task

        reply = self.expect(self.attempt(go()), error)
        if finish:
            self.seen("prepare waited for readiness")
            for key in sorted(self.m_busy):
                self.m_state[key] = self.participant.state[key]
            self.m_busy.clear()
        if error is not None:
            return
        if opens:
            self.m_fresh = False
            self.m_open = checkpoint_id
            self.m_commit = {"args": None, "status": None, "cut": None, "reply": None, "mode": None}
            self.m_phase = Phase.PREPARING
            self.m_admission = False
            self.m_lease = deadline + GRACE
        else:
            assert self.m_lease is not None
            self.m_lease = max(deadline, self.m_lease - GRACE) + GRACE
        if self.m_phase is Phase.PREPARING and self.ready:
            self.m_phase = Phase.PREPARED
        assert reply.phase == self.m_phase
        assert reply.report.ready == self.ready
        assert reply.report.blocker_count == (0 if self.ready else len(self.m_busy))
        assert reply.report.blockers == ([] if self.ready else sorted(self.m_busy))
        assert reply.report.restarts == sorted(self.m_restarts)

    # --- commit

    def _cut(self, scope: list[str]) -> list[tuple[str, Any]]:
        return [(key, self.m_state[key]) for key in scope if key in self.m_state]

    def _expected_manifest(self, checkpoint_id: str, cut: list[tuple[str, Any]]) -> tuple[Manifest, bytes]:
        records = b"".join(line(key, state) for key, state in cut)
        manifest = Manifest.build(
            directory=PARTICIPANT_DIR,
            kind=KIND,
            instance=INSTANCE,
            checkpoint_id=checkpoint_id,
            records_sha256=hashlib.sha256(records).hexdigest(),
            record_count=len(cut),
            records_bytes=len(records),
            episode_ids=[key for key, _ in cut],
            extra={},
            # the writer measures its longest line (newline included): 0 without records
            max_record_bytes=max((len(line(key, state)) for key, state in cut), default=0),
        )
        return manifest, records

    def _write_outcome(self, checkpoint_id: str, directory: str, commit: dict[str, Any]) -> type[BaseException] | None:
        """What storing the cut gives: success, or a conflict with a different manifest there."""
        manifest, _ = self._expected_manifest(checkpoint_id, commit["cut"])
        path = Path(directory) / PARTICIPANT_DIR / "manifest.json"
        if path.exists() and path.read_bytes() != manifest.raw:
            self.seen("commit conflicts with another manifest")
            return errors.ManifestConflict
        return None

    def _committed(self, checkpoint_id: str, directory: str, scope: list[str], reply: Any) -> None:
        """Check a successful commit against the cut and record it in the model."""
        commit = self.m_commit
        assert commit is not None
        manifest, records = self._expected_manifest(checkpoint_id, commit["cut"])
        assert reply.checkpoint_id == checkpoint_id
        assert reply.manifest == manifest.to_document()
        assert reply.manifest_path == manifest.path
        assert reply.manifest_sha256 == manifest.sha256
        assert reply.episode_ids == sorted(key for key in set(scope) if key in dict(commit["cut"]))
        # every episode of the scope the participant held at the cut is in the records, exactly
        assert reply.episode_ids == sorted(key for key in set(scope) if key in commit["held_at_cut"])
        stored = Path(directory) / PARTICIPANT_DIR
        assert (stored / "manifest.json").read_bytes() == manifest.raw
        assert (stored / reply.records_file).read_bytes() == records
        self.m_manifests[str(stored / "manifest.json")] = manifest.sha256
        self.seen("commit stored")
        commit["status"] = "done"
        commit["reply"] = reply
        self.committed.setdefault(
            directory,
            {
                "id": checkpoint_id,
                "lines": {key: line(key, state) for key, state in commit["cut"]},
                "published": False,
            },
        )
        self.m_phase = Phase.COMMITTED
        unscoped = sorted(self.m_restored_keys.difference(scope))
        if unscoped:
            drop_up_to(self.m_state, unscoped)
            self._forget_dropped()
        self.m_restored_keys.intersection_update(scope)

    def _forget_dropped(self) -> None:
        self.m_busy.intersection_update(self.m_state)
        self.m_restarts.intersection_update(self.m_state)

    @rule(
        data=st.data(),
        mode=st.sampled_from(["normal", "normal", "normal", "held_export", "held_write", "failing_store"]),
        release=st.booleans(),
    )
    def commit(self, data: Any, mode: str, release: bool) -> None:
        self.step()
        self._commit(data, self.choose_id(data, allow_new=False), mode, release)

    def _commit(self, data: Any, checkpoint_id: str, mode: str, release: bool) -> None:
        commit = self.m_commit if self.m_open == checkpoint_id else None
        if commit is not None and commit["args"] is not None and data.draw(st.integers(0, 3), label="retry") > 0:
            directory, scope_tuple = commit["args"]
            scope = list(scope_tuple)
            if data.draw(st.booleans(), label="reorder"):
                scope = [*reversed(scope), *scope[:1]]  # same scope, another order, a duplicate
        else:
            held = sorted(self.m_state)
            if held and data.draw(st.integers(0, 3), label="continued") > 0:
                scope = [key for key in held if key not in self.m_restarts]  # PrepareResult.continued
            else:
                scope = data.draw(st.lists(st.sampled_from(held), unique=True), label="held") if held else []
            scope += data.draw(st.lists(KEYS, max_size=2), label="extra")
            if self.m_restarts and data.draw(st.integers(0, 3), label="name a restart") == 0:
                scope.append(min(self.m_restarts))
            others = sorted(d for d in self.committed if d != self.dir_for(checkpoint_id))
            if others and data.draw(st.integers(0, 9), label="foreign dir") == 0:
                directory = data.draw(st.sampled_from(others), label="dir")
            else:
                directory = self.dir_for(checkpoint_id)
        args = (directory, tuple(sorted(set(scope))))
        request = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=self.deadline(),
            checkpoint_dir=directory,
            episode_ids=scope,
        )
        error: type[BaseException] | None = None
        starts = False
        extends = False  # a commit that passes the id and argument checks extends the lease
        if checkpoint_id in self.m_resumed:
            error = errors.StaleCheckpoint
        elif checkpoint_id in self.m_export_failed:
            error = errors.ExportFailed
        elif self.m_open is None:
            error = errors.InvalidPhase
        elif self.m_open != checkpoint_id:
            error = errors.CheckpointConflict
        else:
            assert commit is not None
            extends = commit["args"] is None or commit["args"] == args
            if not extends:
                error = errors.CheckpointConflict
            elif commit["status"] == "done":
                reply = self._commit_call(request, None)
                assert reply == commit["reply"]
                self.seen("commit retried")
                return
            elif commit["status"] is None:
                if set(scope) & self.m_restarts:
                    error = errors.RestartInScope
                    self.seen("commit refused: restart in scope")
                elif self.m_phase is Phase.PREPARING and not self.ready:
                    error = errors.InvalidPhase
                elif not self.ready:
                    error = errors.ExportFailed
                    self.m_export_failed.add(checkpoint_id)
                    self.seen("commit refused: readiness regressed")
                else:
                    starts = True
        if error is not None:
            if extends:
                self._commit_call(request, error)
            else:
                self.expect(self.attempt(self.plane.commit(request)), error)
            return
        assert commit is not None
        if starts:
            self.m_phase = Phase.PREPARED
            commit["args"] = args
            self._start_commit(checkpoint_id, directory, scope, request, commit, mode)
        elif commit["status"] == "export_pending":
            self._retry_held_export(checkpoint_id, directory, scope, request, commit, release)
        elif commit["status"] == "write_pending":
            self._retry_held_write(checkpoint_id, directory, scope, request, commit, release)
        else:
            assert commit["status"] == "failed"
            self.seen("store retried after a failure")
            self._store(checkpoint_id, directory, scope, request, commit)

    def _commit_call(self, request: CommitRequest, error: Any) -> Any:
        """A commit that got past the id and argument checks: it extends the lease (never shortens it)."""
        assert self.m_lease is not None
        self.m_lease = max(self.m_lease, request.deadline_ts + GRACE)
        return self.expect(self.attempt(self.plane.commit(request)), error)

    def _take_cut(self, commit: dict[str, Any], scope: list[str]) -> None:
        commit["cut"] = self._cut(sorted(set(scope)))
        commit["held_at_cut"] = set(self.m_state)

    def _store(
        self, checkpoint_id: str, directory: str, scope: list[str], request: CommitRequest, commit: dict[str, Any]
    ) -> None:
        """The commit runs to its end: it stores the cut (or meets a conflicting manifest)."""
        error = self._write_outcome(checkpoint_id, directory, commit)
        reply = self._commit_call(request, error)
        if error is None:
            self._committed(checkpoint_id, directory, scope, reply)
        else:
            commit["status"] = "failed"
            # the losing write left nothing behind in the winner's directory
            report = verify(directory)
            unpublished = directory not in self.m_indexes
            assert report.ok, report.findings
            assert all(unpublished and f.code == "checkpoint_unpublished" for f in report.warnings), report.findings

    def _start_commit(
        self,
        checkpoint_id: str,
        directory: str,
        scope: list[str],
        request: CommitRequest,
        commit: dict[str, Any],
        mode: str,
    ) -> None:
        if mode == "held_export":
            gate = asyncio.Event()
            self.participant.export_gate = gate
            self.participant.started["export"] = asyncio.Event()
            request = request.model_copy(update={"deadline_ts": self.clock()})
            self._commit_call(request, errors.DeadlineExceeded)
            self.run(asyncio.wait_for(self.participant.started["export"].wait(), LONG))
            commit["status"] = "export_pending"
            return
        self._take_cut(commit, scope)
        if mode == "held_write":
            self.write_gate = self.plane.write_gate = WriteGate(fail=False)
            request = request.model_copy(update={"deadline_ts": self.clock()})
            self._commit_call(request, errors.DeadlineExceeded)
            assert self.run(asyncio.to_thread(self.write_gate.entered.wait, LONG)), "the write never reached the gate"
            commit["status"] = "write_pending"
            return
        if mode == "failing_store":
            self.plane.write_gate = WriteGate(fail=True)
            self._commit_call(request, errors.StorageError)
            commit["status"] = "failed"
            return
        self._store(checkpoint_id, directory, scope, request, commit)

    def _retry_held_export(
        self,
        checkpoint_id: str,
        directory: str,
        scope: list[str],
        request: CommitRequest,
        commit: dict[str, Any],
        release: bool,
    ) -> None:
        if not release:
            request = request.model_copy(update={"deadline_ts": self.clock()})
            self._commit_call(request, errors.DeadlineExceeded)
            return
        gate = self.participant.export_gate
        assert gate is not None
        gate.set()
        self.participant.export_gate = None
        self._take_cut(commit, scope)  # the export reads the state when it runs
        self._store(checkpoint_id, directory, scope, request, commit)

    def _retry_held_write(
        self,
        checkpoint_id: str,
        directory: str,
        scope: list[str],
        request: CommitRequest,
        commit: dict[str, Any],
        release: bool,
    ) -> None:
        gate = self.write_gate
        assert gate is not None
        if not release:
            request = request.model_copy(update={"deadline_ts": self.clock()})
            self._commit_call(request, errors.DeadlineExceeded)
            return
        gate.release()
        self.write_gate = None
        self.seen("held write released by a retry")
        self._store(checkpoint_id, directory, scope, request, commit)

    # --- publish

    @precondition(lambda self: any(not info["published"] for info in self.committed.values()))
    @rule(data=st.data())
    def publish(self, data: Any) -> None:
        """Publish a committed checkpoint through the store (``checkpoint.json``, create-only)."""
        self.step()
        self._publish(data.draw(st.sampled_from(sorted(d for d, i in self.committed.items() if not i["published"]))))

    def _publish(self, directory: str) -> None:
        info = self.committed[directory]
        with open_store(directory) as store:
            manifest = store.read_manifest("", kind=KIND, instance=INSTANCE)
            document = store.publish("", [manifest])
            again = store.publish("", [manifest])  # a retry finds the identical index
            assert again == document
            assert store.read_index("").checkpoint_id == info["id"]
        report = verify(directory)
        assert report.ok, report.findings
        held = self.m_commit is not None and self.m_commit["status"] == "write_pending"
        writing = held and self.m_commit is not None and self.m_commit["args"][0] == directory
        # a write held in this directory has its temporary file there, as any write in progress
        assert all(writing and f.code == "leftover_temporary_file" for f in report.warnings), report.findings
        info["published"] = True
        self.seen("published")
        self.m_indexes.add(directory)
        self.published = {"dir": directory, **info}

    # --- resume, renew, lease

    def _closed_checkpoint(self, checkpoint_id: str) -> None:
        if checkpoint_id not in self.m_resumed:
            self.m_resumed.append(checkpoint_id)
        self.m_export_failed.discard(checkpoint_id)
        self.m_open = None
        self.m_commit = None
        self.m_phase = Phase.IDLE
        self.m_admission = True
        self.m_lease = None

    def _end_held_commit(self, resume: Any) -> None:
        """Resume (or lease expiry) with a held export or write: the write is stopped, nothing publishes."""
        commit = self.m_commit
        assert commit is not None
        before = self.store_files()
        if commit["status"] == "write_pending":
            gate = self.write_gate
            assert gate is not None
            # out of time while the write is held: deadline_exceeded, the phase is kept
            _, raised = self.attempt(resume(0.1))
            assert isinstance(raised, errors.DeadlineExceeded), raised
            assert self.plane.phase is self.m_phase
            # stop() returned (it runs first, in well under 100 ms), then the wait for the write ran out
            stopped = "stopping the write" not in str(raised)
            gate.release()
            self.write_gate = None
            self.expect(self.attempt(resume(LONG)), None)
            if stopped:
                assert self.store_files() == before, "a manifest appeared after resume stopped the write"
                self.seen("held write stopped by resume")
        else:
            self.expect(self.attempt(resume(LONG)), None)
            self.seen("held export cancelled by resume")
        if self.participant.export_gate is not None:
            self.participant.export_gate.set()  # the cancelled export is gone; nothing waits on it
            self.participant.export_gate = None
        after = self.store_files()
        if after != before:
            # possible only if stop() had not run yet when the write was released: the
            # write published before resume returned, and it is the cut, exactly
            assert commit["status"] == "write_pending" and not stopped
            assert self.m_open is not None
            directory = commit["args"][0]
            manifest, _ = self._expected_manifest(self.m_open, commit["cut"])
            path = str(Path(directory) / PARTICIPANT_DIR / "manifest.json")
            assert after[0] == {**before[0], path: manifest.sha256}
            self.m_manifests[path] = manifest.sha256
            self.committed.setdefault(
                directory,
                {"id": self.m_open, "lines": {k: line(k, v) for k, v in commit["cut"]}, "published": False},
            )

    @rule(data=st.data())
    def resume(self, data: Any) -> None:
        self.step()
        self._resume(self.choose_id(data, allow_new=True))

    def _resume(self, checkpoint_id: str) -> None:
        def resume(seconds: float) -> Any:
            return self.plane.resume(ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=self.deadline(seconds)))

        if self.m_phase is Phase.RESTORED:
            assert self.m_restore is not None
            if self.m_restore["id"] != checkpoint_id:
                if checkpoint_id in self.m_resumed:
                    reply = self.expect(self.attempt(resume(LONG)), None)
                    assert reply.idempotent
                    return
                self.expect(self.attempt(resume(LONG)), errors.CheckpointConflict)
                return
            reply = self.expect(self.attempt(resume(LONG)), None)
            self._closed_checkpoint(checkpoint_id)
            assert reply.phase == Phase.IDLE
            assert not reply.idempotent
            return
        if self.m_open is not None:
            if self.m_open != checkpoint_id:
                if checkpoint_id in self.m_resumed:
                    reply = self.expect(self.attempt(resume(LONG)), None)
                    assert reply.phase == self.m_phase
                    assert reply.idempotent
                    return
                self.expect(self.attempt(resume(LONG)), errors.CheckpointConflict)
                return
            assert self.m_commit is not None
            if self.m_commit["status"] in ("export_pending", "write_pending"):
                self._end_held_commit(resume)
            else:
                self.expect(self.attempt(resume(LONG)), None)
            self._closed_checkpoint(checkpoint_id)
            return
        # nothing open: a repeat or an id never seen, a no-op reply; the id is remembered (C7)
        reply = self.expect(self.attempt(resume(LONG)), None)
        assert reply.phase == self.m_phase
        assert reply.idempotent
        if checkpoint_id not in self.m_resumed:
            self.m_resumed.append(checkpoint_id)
            self.seen("resume of an unseen id remembered")

    @rule(data=st.data(), action=st.sampled_from(["renew", "advance", "expire"]), seconds=st.floats(1.0, 400.0))
    def time_passes(self, data: Any, action: str, seconds: float) -> None:
        """Renew the lease, or let time pass (the lease may run out: the participant resumes itself)."""
        self.step()
        held_write = self.m_commit is not None and self.m_commit["status"] == "write_pending"
        if action == "renew" or held_write:
            self.renew(data)
        else:
            self.lease(action == "expire", seconds)

    def renew(self, data: Any) -> None:
        checkpoint_id = self.choose_id(data, allow_new=False)
        deadline = self.deadline(data.draw(st.sampled_from([0.0, 10.0, 1000.0]), label="deadline"))
        request = ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline)
        error: type[BaseException] | None = None
        if self.m_phase is Phase.RESTORED:
            assert self.m_restore is not None
            if self.m_restore["id"] != checkpoint_id:
                error = errors.CheckpointConflict
        elif checkpoint_id in self.m_resumed:
            error = errors.StaleCheckpoint
        elif self.m_open is None:
            error = errors.InvalidPhase
        elif self.m_open != checkpoint_id:
            error = errors.CheckpointConflict
        reply = self.expect(self.attempt(self.plane.renew(request)), error)
        if error is None:
            assert self.m_lease is not None
            self.m_lease = max(self.m_lease, deadline + GRACE)  # the lease never shrinks
            assert reply.lease_expires_at == self.m_lease

    def lease(self, expire: bool, seconds: float) -> None:
        """Time passes; if the lease ran out, the participant resumes by itself."""
        if expire and self.m_lease is not None:
            self.clock.advance(max(self.m_lease - self.clock(), 0.0) + 1.0)
        else:
            self.clock.advance(seconds)
        expired = self.m_lease is not None and self.m_lease <= self.clock()
        result = self.expect(self.attempt(self.plane.expire_lease()), None)
        assert result is expired
        if not expired:
            return
        if self.m_open is not None:
            self.seen("lease expired: checkpoint")
            self._closed_checkpoint(self.m_open)
            if self.participant.export_gate is not None:
                self.participant.export_gate.set()
                self.participant.export_gate = None
        elif self.m_phase is Phase.RESTORED:
            assert self.m_restore is not None
            self.seen("lease expired: restore")
            self._closed_checkpoint(self.m_restore["id"])
        else:
            self.m_lease = None

    # --- retire and forget

    @rule(data=st.data(), forget=st.booleans(), rollouts=st.lists(st.sampled_from(ROLLOUTS), min_size=1, max_size=3))
    def retire_or_forget(self, data: Any, forget: bool, rollouts: list[str]) -> None:
        self.step()
        if forget:
            self.forget(data, rollouts)
        else:
            self.retire(data)

    def _retire_id(self, data: Any) -> str:
        """The id of a retire or forget: mostly the open restore's, if there is one (collection uses a fixed one)."""
        restored = self.m_phase is Phase.RESTORED and self.m_restore is not None
        if restored and data.draw(st.integers(0, 4), label="foreign retire id") > 0:
            assert self.m_restore is not None
            return str(self.m_restore["id"])
        return "retire"

    def _foreign_to_the_restore(self, checkpoint_id: str) -> bool:
        return self.m_phase is Phase.RESTORED and self.m_restore is not None and self.m_restore["id"] != checkpoint_id

    def _renews_restore(self, deadline_ts: float) -> None:
        """A retire or forget in the restored phase extends the restore's lease (never shortens it)."""
        if self.m_phase is Phase.RESTORED:
            assert self.m_lease is not None
            self.m_lease = max(self.m_lease, deadline_ts + GRACE)

    def retire(self, data: Any) -> None:
        held = sorted(self.m_state)
        keys = data.draw(st.lists(st.sampled_from(held), max_size=2), label="held") if held else []
        keys += data.draw(st.lists(KEYS, min_size=0 if keys else 1, max_size=2), label="other")
        request = RetireRequest(checkpoint_id=self._retire_id(data), deadline_ts=self.deadline(), episode_ids=keys)
        if self.m_phase not in (Phase.IDLE, Phase.RESTORED):
            self.expect(self.attempt(self.plane.retire(request)), errors.InvalidPhase)
            return
        if self._foreign_to_the_restore(request.checkpoint_id):
            self.expect(self.attempt(self.plane.retire(request)), errors.CheckpointConflict)
            self.seen("retire during a restore with another id")
            return
        self._renews_restore(request.deadline_ts)
        if data.draw(st.integers(0, 3), label="held retire") == 0:
            # the participant's stop outlives the retire's deadline: the marks are there already
            # (C9: marked before any deadline-limited work, and kept by a failed retire)
            self.participant.retire_gate = gate = asyncio.Event()
            self.participant.started["retire"] = asyncio.Event()
            before = dict(self.participant.state)
            late = request.model_copy(update={"deadline_ts": self.clock()})
            self._renews_restore(late.deadline_ts)
            self.expect(self.attempt(self.plane.retire(late)), errors.DeadlineExceeded)
            self.run(asyncio.wait_for(self.participant.started["retire"].wait(), LONG))
            for key in keys:
                assert self.plane.marks.is_refused(key), key
            assert self.participant.state == before  # not stopped and freed yet
            gate.set()
            self.participant.retire_gate = None
            self.seen("retire outlived its deadline")
        reply = self.expect(self.attempt(self.plane.retire(request)), None)
        assert reply.retired_count == len(set(keys))
        for key in keys:
            rollout, attempt = split_capture_key(key)
            self.m_marks[rollout] = max(attempt, self.m_marks.get(rollout, -1))
        drop_up_to(self.m_state, keys)
        self._forget_dropped()
        self.m_restored_keys.difference_update(keys)

    def forget(self, data: Any, rollouts: list[str]) -> None:
        request = ForgetRequest(checkpoint_id=self._retire_id(data), deadline_ts=self.deadline(), rollout_ids=rollouts)
        if self.m_phase not in (Phase.IDLE, Phase.RESTORED):
            self.expect(self.attempt(self.plane.forget(request)), errors.InvalidPhase)
            return
        if self._foreign_to_the_restore(request.checkpoint_id):
            self.expect(self.attempt(self.plane.forget(request)), errors.CheckpointConflict)
            return
        self._renews_restore(request.deadline_ts)
        reply = self.expect(self.attempt(self.plane.forget(request)), None)
        assert reply.forgotten_count == sum(rollout in self.m_marks for rollout in set(rollouts))
        for rollout in rollouts:
            self.m_marks.pop(rollout, None)

    # --- crash and restore

    @rule(data=st.data(), restore_now=st.sampled_from([True, True, True, False]))
    def crash(self, data: Any, restore_now: bool) -> None:
        """Every process dies; a fresh plane and participant restore the last published checkpoint."""
        self.step()
        self._end_process()
        self._new_process()
        if restore_now and self.published is not None:
            self._restore(data, self.published["id"], self.published["dir"])

    @precondition(lambda self: self.published is not None)
    @rule(data=st.data())
    def restore(self, data: Any) -> None:
        self.step()
        if self.published is None or data.draw(st.integers(0, 3), label="missing dir") == 0:
            checkpoint_id = self.choose_id(data, allow_new=True)
            self._restore(data, checkpoint_id, str(self.root / "missing"))
            return
        checkpoint_id = self.published["id"] if data.draw(st.integers(0, 4)) else self.choose_id(data, allow_new=True)
        self._restore(data, checkpoint_id, self.published["dir"])

    def _restore(self, data: Any, checkpoint_id: str, directory: str) -> None:
        lines: dict[str, bytes] = self.committed.get(directory, {}).get("lines", {})
        previous = self.m_restore
        if previous is not None and previous["ok"] and data.draw(st.integers(0, 2), label="same args") > 0:
            directory, scope_tuple = previous["args"]
            scope = list(scope_tuple)
            lines = self.committed.get(directory, {}).get("lines", {})
        elif lines and data.draw(st.integers(0, 2), label="whole checkpoint") > 0:
            scope = sorted(lines)
        else:
            pool = sorted(lines)
            scope = data.draw(st.lists(st.sampled_from(pool), unique=True), label="scope") if pool else []
            # a controller continues one attempt per rollout (two attempts of one rollout in a
            # scope would install a replacement that the restore's own marks refuse)
            rollouts = {split_capture_key(key)[0] for key in scope}
            for key in data.draw(st.lists(KEYS, max_size=2), label="extra"):
                if split_capture_key(key)[0] not in rollouts:
                    rollouts.add(split_capture_key(key)[0])
                    scope.append(key)
        args = (directory, tuple(sorted(set(scope))))
        deadline = self.deadline()
        request = RestoreRequest(
            checkpoint_id=checkpoint_id, deadline_ts=deadline, checkpoint_dir=directory, episode_ids=scope
        )
        error: Any = None
        cached = False
        if previous is not None and previous["ok"]:
            if previous["id"] == checkpoint_id and previous["args"] == args:
                cached = True  # a retry of the completed restore returns its result
            else:
                error = errors.CheckpointConflict
        elif not self.m_fresh or self.m_open is not None or self.m_phase is not Phase.IDLE:
            error = errors.InvalidPhase
        elif self.m_state:
            error = errors.ControlError  # checkpoint_error: the process already serves episodes
            self.seen("restore refused over live work")
        elif any(refused_by(self.m_marks, next_key(key)) for key in args[1]):
            error = errors.StaleAttempt  # a replacement that was retired itself cannot be restored into
        if checkpoint_id in self.m_resumed:
            # C4: a late call naming a resumed checkpoint is stale_checkpoint; where another
            # refusal also applies, either will do, but never a reply
            error = errors.StaleCheckpoint if error is None else (errors.StaleCheckpoint, error)
        if cached and error is None:
            assert previous is not None
            reply = self.expect(self.attempt(self.plane.restore(request)), None)
            assert reply == previous["reply"]
            return
        if error is not None:
            self.expect(self.attempt(self.plane.restore(request)), error)
            return
        for key in args[1]:
            rollout, attempt = split_capture_key(key)
            self.m_marks[rollout] = max(attempt, self.m_marks.get(rollout, -1))
        self.m_stale_held.update(key for key in self.m_state if refused_by(self.m_marks, key))
        readable = (Path(directory) / PARTICIPANT_DIR / "manifest.json").exists()
        if not readable:
            self.expect(self.attempt(self.plane.restore(request)), errors.InvalidCheckpointState)
            self.seen("restore failed")
            self.m_restore = {"id": checkpoint_id, "args": args, "ok": False, "reply": None}
            self.m_admission = True
            self.m_lease = None
            return
        self.participant.installed = None
        lease_from = deadline
        if data.draw(st.integers(0, 3), label="held install") == 0:
            # the install outlives the restore's deadline: it is kept, and admission reopens
            # only once it finished (C10)
            self.participant.install_gate = gate = asyncio.Event()
            self.participant.started["install"] = asyncio.Event()
            late = request.model_copy(update={"deadline_ts": self.clock()})
            lease_from = late.deadline_ts  # the retry below finds the running restore: no new lease
            self.expect(self.attempt(self.plane.restore(late)), errors.DeadlineExceeded)
            self.run(asyncio.wait_for(self.participant.started["install"].wait(), LONG))
            assert self.plane.phase is Phase.RESTORED
            assert not self.participant.admission_open
            resume = ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=self.deadline(0.05))
            self.expect(self.attempt(self.plane.resume(resume)), errors.DeadlineExceeded)
            assert self.plane.phase is Phase.RESTORED
            assert not self.participant.admission_open
            assert self.participant.installed is None
            if early_retire := data.draw(st.booleans(), label="retire during the install"):
                # a retire waits for the install (C10): out of time, it has marked but not stopped
                keys = sorted(next_key(key) for key in args[1]) or ["r0"]
                calls = len(self.participant.arguments("retire"))
                retire = RetireRequest(checkpoint_id=checkpoint_id, deadline_ts=self.deadline(0.05), episode_ids=keys)
                self.expect(self.attempt(self.plane.retire(retire)), errors.DeadlineExceeded)
                lease_from = max(lease_from, retire.deadline_ts)
                assert len(self.participant.arguments("retire")) == calls, "the retire ran before the install finished"
                for key in keys:
                    assert self.plane.marks.is_refused(key)
                    rollout, attempt = split_capture_key(key)
                    self.m_marks[rollout] = max(attempt, self.m_marks.get(rollout, -1))
            gate.set()
            self.participant.install_gate = None
            self.seen("install outlived its restore")
        else:
            early_retire = False
        reply = self.expect(self.attempt(self.plane.restore(request)), None)
        replacements = sorted(next_key(key) for key in args[1])
        assert reply.phase == Phase.RESTORED
        # the id of the checkpoint that was read (its manifest's), whatever id the restore runs under
        stored = json.loads((Path(directory) / PARTICIPANT_DIR / "manifest.json").read_bytes())
        assert reply.source_checkpoint_id == stored["checkpoint_id"]
        with_records = sorted(next_key(key) for key in args[1] if key in lines)
        assert reply.restored == with_records  # the attempts whose records were installed
        assert self.participant.installed_scope == replacements
        # the restored records are the published ones, byte for byte, under the next attempt
        installed = self.participant.installed
        assert installed is not None
        originals = {key: next_key(key) for key in args[1]}
        expected = {originals[key]: raw for key, raw in lines.items() if key in originals}
        assert sorted(record["episode_id"] for record in installed) == sorted(expected)
        by_next = {value: key for key, value in originals.items()}
        stored_lines = self._records_lines(directory)
        for record in installed:
            original = by_next[record["episode_id"]]
            again = encode_record({**record, "episode_id": original})[1]
            assert again == expected[record["episode_id"]] == stored_lines[original]
            self.m_state[record["episode_id"]] = record["state"]
            if refused_by(self.m_marks, record["episode_id"]):
                # an earlier retire in this process already refuses this replacement: the plane
                # installs it anyway (see the report); it is held but can never run
                self.m_stale_held.add(record["episode_id"])
            self.seen("restore compared byte for byte")
        self.m_restore = {"id": checkpoint_id, "args": args, "ok": True, "reply": reply}
        self.m_phase = Phase.RESTORED
        self.m_admission = False
        self.m_lease = lease_from + GRACE
        self.m_restored_keys = set(replacements)
        if early_retire:
            # the retire that ran out of time is retried once the install finished: it stops and frees
            keys = replacements or ["r0"]
            retire = RetireRequest(checkpoint_id=checkpoint_id, deadline_ts=self.deadline(), episode_ids=keys)
            self._renews_restore(retire.deadline_ts)
            self.expect(self.attempt(self.plane.retire(retire)), None)
            drop_up_to(self.m_state, keys)
            self._forget_dropped()
            self.m_restored_keys.difference_update(keys)
            self.seen("retire waited for an install")

    def _records_lines(self, directory: str) -> dict[str, bytes]:
        with open_store(directory) as store:
            manifest = store.read_manifest("", kind=KIND, instance=INSTANCE)
        raw = (Path(directory) / manifest.records_path).read_bytes()
        lines = raw.splitlines(keepends=True)
        return {episode_id_of_line(item): item for item in lines}

    # --- invariants

    @invariant()
    def phases_are_legal(self) -> None:
        for change in self.plane.transitions:
            assert change in LEGAL, f"illegal phase change {change[0]} → {change[1]}"
        self.plane.transitions.clear()
        assert self.plane.phase is self.m_phase, (self.plane.phase, self.m_phase)

    @invariant()
    def participant_matches_the_model(self) -> None:
        participant = self.participant
        assert participant.admission_open is self.m_admission
        assert set(participant.state) == set(self.m_state)
        for key, state in self.m_state.items():
            assert line(key, participant.state[key]) == line(key, state)
        assert participant.busy == self.m_busy
        assert participant.restart_keys == self.m_restarts

    @invariant()
    def marks_match_and_no_retired_attempt_is_held(self) -> None:
        marks = self.plane.marks
        assert len(marks) == len(self.m_marks)
        for rollout in ROLLOUTS:
            for attempt in range(4):
                key = capture_key(rollout, attempt)
                assert marks.is_refused(key) is refused_by(self.m_marks, key), key
        self.m_stale_held.intersection_update(self.m_state)
        for key in self.participant.state:
            # retire frees what it marks; only a restore can leave a refused attempt held
            assert not marks.is_refused(key) or key in self.m_stale_held, f"{key} is held although retired"

    @invariant()
    def lease_and_status_match(self) -> None:
        assert self.plane.lease_expires_at == self.m_lease
        status = self.plane.status()
        assert status.phase is self.m_phase
        current = self.m_open
        if current is None and self.m_phase is Phase.RESTORED:
            assert self.m_restore is not None
            current = self.m_restore["id"]
        assert status.checkpoint_id == current
        assert status.retired_rollouts == len(self.m_marks)
        assert status.kind == KIND and status.instance == INSTANCE

    @invariant()
    def the_store_holds_exactly_what_was_committed_and_published(self) -> None:
        manifests, indexes = self.store_files()
        assert manifests == self.m_manifests
        assert indexes == self.m_indexes


def test_checkpoint_state_machine() -> None:
    run_state_machine_as_test(
        CheckpointMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=75,
            deadline=None,
            # the same examples every run: the coverage asserted below must not depend on the seed
            derandomize=True,
            report_multiple_bugs=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert STEPS >= MIN_STEPS, f"only {STEPS} steps ran; the run must make at least {MIN_STEPS}"
    missed = [scenario for scenario in MUST_SEE if not SEEN[scenario]]
    assert not missed, f"the run never reached {missed}; seen: {dict(SEEN)}"


# --- the machine's findings, as deterministic regressions


def _checkpoint(loop: asyncio.AbstractEventLoop, directory: str) -> None:
    """Commit checkpoint ``c1`` of two episodes (r0, r1) into ``directory`` and resume."""
    writer = MachineParticipant()
    writer.state = {"r0": payload("r0", 1, 3), "r1": payload("r1", 2, 4)}
    plane = ControlPlane(writer)
    far = time.time() + 60
    loop.run_until_complete(plane.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=far)))
    commit = CommitRequest(checkpoint_id="c1", deadline_ts=far, checkpoint_dir=directory, episode_ids=["r0", "r1"])
    loop.run_until_complete(plane.commit(commit))
    loop.run_until_complete(plane.resume(ControlRequest(checkpoint_id="c1", deadline_ts=far)))
    loop.run_until_complete(plane.close())


def _bounded(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coro, RULE_BOUND))


def test_restore_retried_after_its_resume_is_stale() -> None:
    """C4: a restore naming a checkpoint this process already resumed is stale_checkpoint, not a reply."""
    loop = asyncio.new_event_loop()
    root = Path(_tmp_root())
    try:
        directory = str(root / "c1")
        _checkpoint(loop, directory)
        fresh = ControlPlane(MachineParticipant())
        far = time.time() + 60
        restore = RestoreRequest(
            checkpoint_id="c1", deadline_ts=far, checkpoint_dir=directory, episode_ids=["r0", "r1"]
        )
        _bounded(loop, fresh.restore(restore))
        _bounded(loop, fresh.resume(ControlRequest(checkpoint_id="c1", deadline_ts=far)))
        assert fresh.phase is Phase.IDLE
        try:
            reply = _bounded(loop, fresh.restore(restore))
        except errors.StaleCheckpoint:
            pass
        else:
            raise AssertionError(f"a restore of resumed checkpoint c1 replied {reply!r} in phase {fresh.phase}")
        _bounded(loop, fresh.close())
    finally:
        loop.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_retire_waits_for_an_install_that_outlived_its_restore() -> None:
    """C10: a retire waits for the install; out of time it has marked the attempts but not run.

    Otherwise the retire frees state that the still-running install then puts back.
    """
    loop = asyncio.new_event_loop()
    root = Path(_tmp_root())
    try:
        directory = str(root / "c1")
        _checkpoint(loop, directory)
        participant = MachineParticipant()
        participant.install_gate = gate = asyncio.Event()
        plane = ControlPlane(participant)
        restore = RestoreRequest(
            checkpoint_id="c1", deadline_ts=time.time() + 0.05, checkpoint_dir=directory, episode_ids=["r0", "r1"]
        )
        with contextlib.suppress(errors.DeadlineExceeded):
            _bounded(loop, plane.restore(restore))
            raise AssertionError("the restore should have outlived its deadline")
        _bounded(loop, participant.started["install"].wait())
        retire = RetireRequest(checkpoint_id="c1", deadline_ts=time.time() + 0.05, episode_ids=["r0-a1"])
        with contextlib.suppress(errors.DeadlineExceeded):
            _bounded(loop, plane.retire(retire))
            raise AssertionError("the retire should have waited for the install past its deadline")
        assert plane.marks.is_refused("r0-a1")  # marked before any deadline-limited work (C9)
        assert participant.arguments("retire") == [], "the retire stopped and freed before the install finished"
        gate.set()
        _bounded(loop, plane.restore(restore.model_copy(update={"deadline_ts": time.time() + 60})))
        assert "r0-a1" in participant.state
        _bounded(loop, plane.retire(retire.model_copy(update={"deadline_ts": time.time() + 60})))
        assert "r0-a1" not in participant.state
        _bounded(loop, plane.close())
    finally:
        loop.close()
        shutil.rmtree(root, ignore_errors=True)
