"""Run the README's and docs' code as a reader would: its code blocks, its shell lines, its servers.

- :func:`code_blocks` reads the fenced blocks of a Markdown file, each with its language, the
  section it is in and an explicit ``<!-- not run: reason -->`` mark on the line before it.
- :class:`Workspace` is a temporary working directory holding a copy of ``examples/``, where
  the documented ports (8001, 8002, 8100–8105 and the S3 example's 9000) are replaced by free
  ones in the copies and in every line run. :meth:`Workspace.run_line` runs one shell line
  of a block as a reader would, in ``bash`` with the venv's ``bin`` first on ``PATH``:

  - ``NAME=value`` lines are kept and run before every later command (a reader's shell
    keeps them too);
  - a server (``uvicorn ...``, ``gymckpt stack up ...``, ``gymckpt serve ...``) is started in a process group of
    its own and waited for, polling ``GET /health`` of every port it serves, with a
    deadline; a server command already running is first stopped as Ctrl-C stops it
    (SIGINT, bounded wait), then started again: the README's "stop it and start it again";
  - ``curl`` lines run with ``-w`` added to read the HTTP status; the reply is decoded;
  - ``gymckpt verify``/``inspect``/``collect`` and ``python FILE`` lines must exit 0;
  - any other command is refused: a block that cannot run must be marked ``not run``.

:meth:`Workspace.close` stops every server (SIGINT, then SIGKILL of its process group) and
any server process a stopped ``gymckpt stack up`` left behind (found by the stack's own
temporary directory, killed by pid).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gymckpt.testing.net import free_ports

from .support import REPO, signal_group

README = REPO / "README.md"
EXAMPLES = REPO / "examples"
#: the section of the README whose shell blocks tests/test_examples.py runs (and asserts)
EMBEDDING_SECTION = "Add checkpointing to your own FastAPI server"
#: the section of the README whose blocks tests/integrations/test_nemo_doc.py runs, with NeMo Gym (Python 3.12)
NEMO_GYM_SECTION = "Checkpointing a NeMo Gym stack"
#: ports the documentation names; each workspace replaces them by free ones
DOC_PORTS = ("8001", "8002", "8100", "8101", "8102", "8103", "8104", "8105", "9000")
SERVER_START_SECONDS = 90.0
STOP_SECONDS = 20.0
COMMAND_SECONDS = 180.0

_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->$")
_PROXY_VARIABLES = frozenset({"http_proxy", "https_proxy", "all_proxy", "no_proxy"})
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    section: str  # the "## " heading it is under
    not_run: str | None  # the reason of a "<!-- not run: reason -->" mark right before it

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    def lines(self) -> list[str]:
        return self.text.splitlines()


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    blocks: list[Block] = []
    section = ""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            lang = line[3:].strip()
            start = index
            body: list[str] = []
            index += 1
            while index < len(lines) and not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            previous = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            mark = _NOT_RUN.match(previous)
            blocks.append(
                Block(path, start + 1, lang, "\n".join(body) + "\n", section, mark["reason"] if mark else None)
            )
        index += 1
    return blocks


@dataclass
class Result:
    """What one documented command did."""

    kind: str  # "server", "curl", "gymckpt", "python"
    line: str  # as documented
    status: int | None = None  # curl: the HTTP status
    body: Any = None  # curl: the decoded reply
    output: str = ""  # stdout


@dataclass
class _Server:
    process: subprocess.Popen[bytes]
    log: Path
    ports: list[int]


@dataclass
class Workspace:
    root: Path
    ports: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    variables: list[str] = field(default_factory=list)
    servers: dict[str, _Server] = field(default_factory=dict)
    #: temporary directories of every ``gymckpt stack up`` started (their servers' configs and logs)
    stack_dirs: set[str] = field(default_factory=set)
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ports = dict(zip(DOC_PORTS, map(str, free_ports(len(DOC_PORTS))), strict=True))
        # no GYMCKPT_ overrides of the documented settings, no proxy between curl and loopback
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("GYMCKPT_") and key.lower() not in _PROXY_VARIABLES
        }
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("PYTHONPATH", None)
        self.env = env
        copy = self.root / "examples"
        copy.mkdir(parents=True)
        for source in sorted(EXAMPLES.iterdir()):
            if source.is_file() and source.suffix in (".py", ".yaml", ".jsonl"):
                (copy / source.name).write_text(self.sub(source.read_text()))

    # --- text

    def sub(self, text: str) -> str:
        """``text`` with every documented port replaced by this workspace's."""
        return re.sub(r"\b(" + "|".join(DOC_PORTS) + r")\b", lambda match: self.ports[match[1]], text)

    def port(self, documented: str) -> int:
        return int(self.ports[documented])

    # --- running lines

    def run_block(self, block: Block) -> list[Result]:
        """Every line of a shell block, in order."""
        results = []
        for line in block.lines():
            result = self.run_line(line, where=block.where)
            if result is not None:
                results.append(result)
        return results

    def run_line(self, line: str, *, where: str = "") -> Result | None:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            return None
        if _ASSIGNMENT.match(stripped):
            self.variables.append(self.sub(stripped))
            return None
        words = stripped.split()
        if words[0] == "uvicorn" or words[:3] == ["gymckpt", "stack", "up"] or words[:2] == ["gymckpt", "serve"]:
            result = Result("server", line)
            self.start_server(stripped)
        elif words[0] == "curl":
            result = self._curl(stripped, where)
        elif words[0] == "gymckpt" and words[1] in ("verify", "inspect", "collect"):
            result = Result("gymckpt", line, output=self._shell(stripped, where))
        elif words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
            result = Result("python", line, output=self._shell(stripped, where))
        else:
            raise AssertionError(f"{where}: {line!r} is no command these tests run; mark its block <!-- not run: … -->")
        self.results.append(result)
        return result

    def _run(self, command: str, timeout: float = COMMAND_SECONDS) -> subprocess.CompletedProcess[str]:
        script = "\n".join([*self.variables, self.sub(command)])
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _shell(self, command: str, where: str) -> str:
        done = self._run(command)
        assert done.returncode == 0, (
            f"{where}: {command!r} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            f"{self.server_logs()}"
        )
        return done.stdout

    def _curl(self, command: str, where: str) -> Result:
        done = self._run("curl -w '\\n%{http_code}' " + command.removeprefix("curl "), timeout=60)
        assert done.returncode == 0, f"{where}: {command!r}: curl exited {done.returncode}: {done.stderr}"
        body, _, status = done.stdout.rpartition("\n")
        try:
            decoded = json.loads(body) if body else None
        except ValueError:
            decoded = body
        return Result("curl", command, status=int(status), body=decoded, output=body)

    # --- servers

    def _server_ports(self, command: str) -> list[int]:
        words = self.sub(command).split()
        if words[0] == "uvicorn" or words[:2] == ["gymckpt", "serve"]:
            return [int(words[words.index("--port") + 1])] if "--port" in words else [8000]
        spec = yaml.safe_load((self.root / words[3]).read_text())
        return [int(entry["port"]) for entry in spec["servers"]]

    def start_server(self, command: str) -> None:
        """Start ``command`` (stopping it first, as Ctrl-C would, if it runs) and wait until it answers."""
        if command in self.servers:
            self.stop_server(command)
        log = self.root / f"server-{len(self.results)}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", "exec " + self.sub(command)],
                cwd=self.root,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = self.servers[command] = _Server(process, log, self._server_ports(command))
        deadline = time.monotonic() + SERVER_START_SECONDS
        waiting = list(server.ports)
        while waiting:
            if process.poll() is not None:
                raise AssertionError(f"{command!r} exited {process.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{command!r}: ports {waiting} not healthy in {SERVER_START_SECONDS} s")
            if _healthy(waiting[0]):
                waiting.pop(0)
            else:
                time.sleep(0.1)  # the next poll of this deadline-bounded wait
        self.stack_dirs.update(re.findall(r"\blog (/\S+)/[^/\s]+\.log\b", log.read_text()))

    def stop_server(self, command: str) -> None:
        """Ctrl-C: SIGINT to the server's process group; SIGKILL if it has not exited in time."""
        server = self.servers.pop(command)
        process = server.process
        if process.poll() is None:
            signal_group(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                signal_group(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_SECONDS)
        deadline = time.monotonic() + STOP_SECONDS
        while any(_healthy(port) for port in server.ports) and time.monotonic() < deadline:
            time.sleep(0.1)  # a stack's servers go with it; poll until their ports are quiet

    def server_logs(self) -> str:
        parts = []
        for command, server in self.servers.items():
            parts.append(f"\n--- {command}\n{server.log.read_text()[-2000:]}")
        return "".join(parts)

    def close(self) -> None:
        """Stop every server, then kill (by pid) any process a stopped stack left behind."""
        for command in list(self.servers):
            self.stop_server(command)
        for pid in _processes_mentioning(self.stack_dirs):
            signal_group(pid, signal.SIGKILL)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(port: int) -> bool:
    try:
        with _DIRECT.open(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _processes_mentioning(paths: set[str]) -> list[int]:
    """Pids of processes whose command line names one of ``paths`` (a stack's own temporary directory)."""
    if not paths:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(path in cmdline for path in paths):
            found.append(int(entry.name))
    return found
