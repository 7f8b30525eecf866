"""What ``gymckpt demo`` found, and how it is printed: the outcome, the comparison, the table."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from gymckpt.errors import CheckpointParked

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from rich.console import Console

    from gymckpt.store.verify import VerifyReport

__all__ = [
    "EXIT_DIFFERS",
    "EXIT_OK",
    "EXIT_SETUP",
    "EXIT_TERMINATED",
    "DemoOutcome",
    "Progress",
    "compare_results",
    "error_code",
    "failure_summary",
    "refused_at_checkpoint",
    "render",
    "render_kept",
]

#: exit codes of the demo: success, a rollout lost or a result different, a setup failure
EXIT_OK, EXIT_DIFFERS, EXIT_SETUP = 0, 1, 2
#: stopped by SIGTERM (128 + 15, as a shell reports it), after every server it started was stopped
EXIT_TERMINATED = 143


class Progress:
    """Progress lines as phases happen, each with the seconds since the demo began."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.began = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.began
        self.console.print(f"[dim]{elapsed:6.1f}s[/] {message}", highlight=False)


@dataclass
class DemoOutcome:
    """Everything one demo run did and measured (numbers stay 0 or None for phases not reached)."""

    rollouts: int
    store_url: str
    checkpoint_id: str = ""
    checkpoint_dir: str = ""
    #: rollout ids by what happened to them
    finished_before: list[str] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)
    continued: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    #: rollouts not started before the checkpoint (a turn trigger reached during the launch): run after the restore
    started_after_restore: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    #: why the lost rollouts have no result: the commonest failure reasons with counts, before the
    #: crash (a ``/run`` that failed) and after it (a continuation or restart that failed)
    lost_reasons: str = ""
    differing: list[str] = field(default_factory=list)
    #: rollouts whose ``/run`` the open checkpoint refused (``checkpoint_parked``): started over after the restore
    refused_at_checkpoint: list[str] = field(default_factory=list)
    #: rollouts in the commit scope that were never exported and started over (late to the checkpoint)
    uncaptured: list[str] = field(default_factory=list)
    #: the prepare report's restarts: rollouts some server cannot capture
    restarts_reported: list[str] = field(default_factory=list)
    mean_reward: float | None = None
    reference_mean_reward: float | None = None
    uninterrupted_seconds: float = 0.0
    launch_seconds: float = 0.0
    peak_in_flight: int = 0
    prepare_seconds: float = 0.0
    commit_seconds: float = 0.0
    restart_seconds: float = 0.0
    restore_seconds: float = 0.0
    continue_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    #: records bytes per participant (``kind/instance``), and their records
    bytes_by_participant: dict[str, int] = field(default_factory=dict)
    records_by_participant: dict[str, int] = field(default_factory=dict)
    #: where the exported rollouts stood at the checkpoint (label → count)
    stages: dict[str, int] = field(default_factory=dict)
    #: exported rollouts past their first turn (at turn 2 or later, or verifying), from ``stages``
    exported_past_first_turn: int = 0
    model_calls_before_crash: int = 0
    model_calls_redone: int = 0
    #: tokens of the generations in flight at the checkpoint, kept by cuts, generated again
    tokens_in_flight: int = 0
    tokens_kept_by_cuts: int = 0
    tokens_generated_again: int = 0
    #: held generations started again from their first token after the restore
    held_from_first_token: int = 0
    #: uvicorn workers of each Gym server (name → count) before the crash and after the restore
    workers_before: dict[str, int] = field(default_factory=dict)
    workers_after: dict[str, int] = field(default_factory=dict)
    verify_report: VerifyReport | None = None
    #: every server process the demo started (both stacks, restarts included)
    server_pids: list[int] = field(default_factory=list)
    kept_urls: dict[str, str] = field(default_factory=dict)
    embedded_endpoint: str = ""
    logs_dir: str = ""
    error: str = ""
    exit_code: int = EXIT_OK
    #: the results were compared with the uninterrupted run's: the table's figures are real
    compared: bool = False

    @property
    def bytes_written(self) -> int:
        return sum(self.bytes_by_participant.values())

    @property
    def records_written(self) -> int:
        return sum(self.records_by_participant.values())

    @property
    def verified(self) -> bool:
        return self.verify_report is not None and self.verify_report.ok


def result_of(reply: Any) -> dict[str, Any] | None:
    """The ``result`` of a ``/run`` reply, None for a failure, an error or no reply."""
    if isinstance(reply, dict) and isinstance(reply.get("result"), dict) and reply.get("status", 200) == 200:
        return reply["result"]  # type: ignore[no-any-return]
    return None


def failure_of(reply: Any) -> str:
    """Why a ``/run`` reply (or the exception a call raised) holds no result, in a few words."""
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}" if str(reply) else type(reply).__name__
    if isinstance(reply, dict):
        failure = reply.get("failure")
        if isinstance(failure, dict) and failure.get("failure_reason"):
            return str(failure["failure_reason"])
        for field_name in ("message", "detail", "error", "code", "body"):
            if reply.get(field_name):
                return f"HTTP {reply.get('status', '?')}: {reply[field_name]}"
        return f"HTTP {reply.get('status', '?')} without a result"
    return str(reply)


def error_code(reply: Any) -> str | None:
    """The wire code of a ``/run`` reply that is an error body (``{"error": {"code", …}}``), else None."""
    error = reply.get("error") if isinstance(reply, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else None


def refused_at_checkpoint(reply: Any) -> bool:
    """A ``/run`` the open checkpoint refused (409 ``checkpoint_parked``): the rollout never started."""
    return isinstance(reply, dict) and reply.get("status") == 409 and error_code(reply) == CheckpointParked.code


def failure_summary(replies: Iterable[Any], *, width: int = 160) -> str:
    """The failures among ``replies`` on one line: how many, and the commonest reasons with their counts.

    Error bodies count by status and wire code (their details name each rollout), with one
    detail as the example.
    """
    reasons: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for reply in replies:
        if result_of(reply) is not None:
            continue
        text = " ".join(failure_of(reply).split())[:width]
        code = error_code(reply)
        reason = f"HTTP {reply.get('status', '?')} {code}" if code else text
        reasons[reason] += 1
        examples.setdefault(reason, text)
    return "; ".join(
        f"{count} × {reason}" + (f" (e.g. {examples[reason]})" if examples[reason] != reason else "")
        for reason, count in reasons.most_common(3)
    ) + (f"; {len(reasons) - 3} other reasons" if len(reasons) > 3 else "")


def compare_results(
    reference: Mapping[str, dict[str, Any] | None], final: Mapping[str, dict[str, Any] | None]
) -> tuple[list[str], list[str]]:
    """``(lost, differing)``: rollouts without a result, and those whose result (reward and
    response) is not the uninterrupted run's."""
    lost = sorted(rollout for rollout in reference if final.get(rollout) is None)
    differing = sorted(
        rollout
        for rollout, expected in reference.items()
        if final.get(rollout) is not None and (expected is None or _key_fields(final[rollout]) != _key_fields(expected))  # type: ignore[arg-type]
    )
    return lost, differing


def _key_fields(result: dict[str, Any]) -> tuple[Any, Any]:
    return result.get("reward"), result.get("response")


def mean_reward(results: Iterable[dict[str, Any] | None]) -> float | None:
    rewards = [float(result["reward"]) for result in results if result is not None and result.get("reward") is not None]
    return sum(rewards) / len(rewards) if rewards else None


def stage_label(environment_record: Mapping[str, Any] | None, agent_record: Mapping[str, Any] | None) -> str:
    """Where an exported rollout stood, from its environment boundary and its agent session."""
    boundary = (environment_record or {}).get("boundary")
    if not isinstance(boundary, dict):
        return "not started"
    stage = boundary.get("stage")
    if stage == "invoke_agent":
        messages = ((agent_record or {}).get("boundary") or {}).get("messages")
        if isinstance(messages, list):
            tools = sum(1 for message in messages if isinstance(message, dict) and message.get("role") == "tool")
            return f"agent turn {tools + 1}"
        return "agent"
    if stage in ("close_agent", "verify"):
        return "verifying"
    if stage == "done":
        return "verified"
    return str(stage)


def stage_summary(stages: Mapping[str, int]) -> str:
    order = ["not started", *(f"agent turn {n}" for n in range(1, 100)), "agent", "verifying", "verified"]
    ranked = sorted(stages.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
    return ", ".join(f"{label}: {count}" for label, count in ranked)


def count_stages(labels: Iterable[str]) -> dict[str, int]:
    return dict(Counter(labels))


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def _reward(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _share(part: int, whole: int) -> str:
    """``part`` as a share of ``whole`` (the tokens in flight at the checkpoint)."""
    return f"{100 * part / whole:.1f}% of the tokens in flight" if whole else "nothing was in flight"


def _counts(workers: dict[str, int]) -> str:
    """One number when every server has it, else ``name n`` pairs (``–`` when not reached)."""
    values = set(workers.values())
    if not values:
        return "–"
    if len(values) == 1:
        return str(values.pop())
    return ", ".join(f"{name} {count}" for name, count in sorted(workers.items()))


def render(outcome: DemoOutcome, console: Console) -> None:
    """The table, then where the checkpoint lies and how to check it.

    A demo that failed before its results were compared prints no table (its figures would
    be zeros), only the line naming what failed and where the servers' logs are.
    """
    if outcome.error and not outcome.compared:
        _render_failure(outcome, console)
        return
    table = Table(
        title=f"gymckpt demo: {outcome.rollouts} rollout{'' if outcome.rollouts == 1 else 's'}, checkpoint {escape(outcome.checkpoint_id or '–')}"
    )
    table.show_header = False
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note", style="dim")
    table.add_row("finished before the checkpoint", str(len(outcome.finished_before)), "")
    table.add_row("exported", str(len(outcome.exported)), "in flight at the checkpoint")
    table.add_row("continued", str(len(outcome.continued)), "from their last boundary")
    restarted_note = "started over from their input"
    if outcome.uncaptured:
        restarted_note += f"; {len(outcome.uncaptured)} came after the export"
    if outcome.refused_at_checkpoint:
        restarted_note += f"; {len(outcome.refused_at_checkpoint)} refused while the checkpoint was open"
    table.add_row("restarted", str(len(outcome.restarted)), restarted_note)
    if outcome.started_after_restore:
        table.add_row(
            "started after the restore", str(len(outcome.started_after_restore)), "not started before the checkpoint"
        )
    table.add_row("lost", _bad(len(outcome.lost)), _some(outcome.lost))
    table.add_row(
        "results differing", _bad(len(outcome.differing)), _some(outcome.differing) or "from the uninterrupted run"
    )
    table.add_row(
        "mean reward", _reward(outcome.mean_reward), f"uninterrupted run: {_reward(outcome.reference_mean_reward)}"
    )
    if outcome.workers_before or outcome.workers_after:
        table.add_row(
            "workers per Gym server",
            f"{_counts(outcome.workers_before)} → {_counts(outcome.workers_after)}",
            "before the crash → after the restore",
        )
    table.add_row("prepare seconds", _seconds(outcome.prepare_seconds), "")
    table.add_row("commit seconds", _seconds(outcome.commit_seconds), "every participant at once")
    table.add_row("restore seconds", _seconds(outcome.restore_seconds), "")
    table.add_row("restart seconds", _seconds(outcome.restart_seconds), "SIGKILL until all answer")
    table.add_row(
        "bytes written",
        f"{outcome.bytes_written:,}",
        f"{outcome.records_written} records, {len(outcome.bytes_by_participant)} participants",
    )
    table.add_row(
        "model calls redone",
        str(outcome.model_calls_redone),
        f"of {outcome.model_calls_before_crash}: held, undelivered, each continued from its cut",
    )
    table.add_row(
        "held calls from token 0",
        _bad(outcome.held_from_first_token),
        "held generations started over after the restore",
    )
    table.add_row(
        "tokens kept by cuts",
        f"{outcome.tokens_kept_by_cuts:,}",
        f"of {outcome.tokens_in_flight:,} in flight at the checkpoint (cut prefixes, replayed responses)",
    )
    table.add_row(
        "tokens generated again",
        f"{outcome.tokens_generated_again:,}",
        _share(outcome.tokens_generated_again, outcome.tokens_in_flight),
    )
    report = outcome.verify_report
    if report is None:
        table.add_row("verify", "–", "not reached")
    else:
        table.add_row(
            "verify",
            "OK" if report.ok else "[red]DAMAGED[/]",
            f"{report.records_checked} records re-hashed"
            + (f", {len(report.warnings)} warnings" if report.warnings else "")
            if report.ok
            else f"{len(report.errors)} errors, {len(report.warnings)} warnings",
        )
    table.add_row("total seconds", f"{outcome.total_seconds:.1f}", "")
    console.print(table)

    if outcome.checkpoint_dir:
        console.print(f"checkpoint: {outcome.checkpoint_dir}", highlight=False, markup=False)
        if outcome.embedded_endpoint:
            console.print(
                f"it lived on the embedded S3 endpoint {outcome.embedded_endpoint}, which stops with the demo; "
                "against your own bucket: gymckpt verify s3://BUCKET/PREFIX/CHECKPOINT --endpoint-url URL",
                highlight=False,
                markup=False,
            )
        else:
            console.print(f"check it yourself: gymckpt verify {outcome.checkpoint_dir}", highlight=False, markup=False)
    _render_failure(outcome, console)


def _render_failure(outcome: DemoOutcome, console: Console) -> None:
    if outcome.error:
        console.print(f"[bold red]demo failed:[/] {escape(outcome.error)}", highlight=False, soft_wrap=True)
    if outcome.logs_dir and (outcome.exit_code != EXIT_OK or outcome.kept_urls):
        console.print(f"server logs: {outcome.logs_dir}", highlight=False, markup=False, soft_wrap=True)


def render_kept(outcome: DemoOutcome, pids: Mapping[str, int], token: str, console: Console) -> None:
    """``--keep``: the stack left running, its control token, and how to stop it."""
    console.print(f"the demo stack keeps running (--keep); control token {token}:", highlight=False, markup=False)
    for name, url in outcome.kept_urls.items():
        console.print(f"  {name:<12} {url}  (process group {pids.get(name, '?')})", highlight=False, markup=False)
    if outcome.embedded_endpoint:
        console.print(
            "  note: the embedded S3 endpoint stopped with the demo; checkpoints of this stack into it will fail",
            highlight=False,
        )
    groups = " ".join(f"-{pid}" for pid in pids.values())
    console.print(f"stop it: kill -TERM -- {groups}", highlight=False, markup=False)


def _bad(count: int) -> str:
    return f"[red]{count}[/]" if count else "0"


def _some(keys: list[str], limit: int = 4) -> str:
    return escape(", ".join(keys[:limit]) + (" …" if len(keys) > limit else ""))
