"""Run a command whose whole process group dies with the process holding this one's lifeline.

``python -m gymckpt.stack.lifeline -- COMMAND...`` is started by a Ray host actor as the
leader of a new process group, with its stdin the read end of a pipe only the actor holds
the write end of. It starts COMMAND (a ``gymckpt serve`` and, through uvicorn, its workers)
in the same group and waits. When the actor goes (it exits, is killed, its node's raylet
dies: the kernel closes its end of the pipe), stdin reaches EOF and this SIGKILLs every
other process of the group, then exits. When COMMAND exits first, the rest of the group is
killed too and this exits with COMMAND's status. Either way no server process outlives its
host actor, whatever signal ended the actor. File descriptors given in ``--keep-fd`` (the
listening socket) are passed on to COMMAND.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["group_members", "kill_group", "main"]


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` (from ``/proc``), this process left out."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` but this one (SIGSTOP first: none forks meanwhile)."""
    members = group_members(pgid)
    for number in (signal.SIGSTOP, signal.SIGKILL):
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)


def main(argv: list[str]) -> int:
    keep: list[int] = []
    while argv and argv[0] == "--keep-fd":
        keep.append(int(argv[1]))
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m gymckpt.stack.lifeline [--keep-fd N]... -- COMMAND...", file=sys.stderr)
        return 2
    pgid = os.getpgid(0)
    child = subprocess.Popen(argv, pass_fds=tuple(keep), stdin=subprocess.DEVNULL)
    for fd in keep:
        os.close(fd)
    lifeline_gone = threading.Event()

    def watch_lifeline() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        lifeline_gone.set()
        kill_group(pgid)

    threading.Thread(target=watch_lifeline, name="lifeline", daemon=True).start()
    status = child.wait()
    kill_group(pgid)  # the server's workers, whatever is left of the group
    return 137 if lifeline_gone.is_set() else (status if status >= 0 else 128 - status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
