"""The stack on a Ray cluster: one host actor per server, placed through a placement group.

The one module of gymckpt that imports Ray (``pip install -e '.[ray]'``). The stack file is
the one :func:`~gymckpt.stack.supervisor.load_stack` reads, plus a ``ray:`` block
(:class:`~gymckpt.stack.ray_plan.RayOptions`). :meth:`RayStack.place`:

1. makes one placement group of one bundle per server (``cpus_per_server`` CPUs and the
   server's ``ray.resources``; strategy ``spread`` or ``pack``) and waits until it fits;
2. starts one :class:`~gymckpt.stack.ray_host.HostActor` in each bundle: on its node it binds a free port on the
   node's address and reports ``http://<node address>:<port>``;
3. resolves every ``"{name}"`` of the servers' configs to those URLs;
4. with servers on more than one node, refuses checkpoint locations not every node sees
   (:class:`~gymckpt.errors.SharedStorageRequired`: S3 passes, a path only once a probe
   written from one node reads back on every other, one Ray task per node);
5. has each actor start its server's whole process group (``gymckpt serve … --fd N
   --workers W``) on the socket it bound.

Ray places and supervises only: no rollout state goes through Ray's object store, the
servers' checkpoints go to the storage the stack names. A server never outlives its host
actor: its process group is led by :mod:`gymckpt.stack.lifeline`, whose stdin is a pipe only
the actor holds the write end of; when that end closes (the actor exited, was SIGKILLed, or
its node died) the lifeline SIGKILLs the whole group. :meth:`RayStack.stop` also SIGKILLs
each group itself. An entry's ``port:`` and the file's ``host:`` are not used on Ray: each
server listens on a free port of its node's address.

Losing a node (:class:`~gymckpt.errors.NodeLost`): each actor answers a ``wait_exit`` call
only when its server exits; Ray fails that call within about a second when the actor's node
dies, and :meth:`RayStack.wait_lost` returns. :meth:`RayStack.replace` stops every surviving
server (a restore needs fresh processes everywhere), removes the placement group and places
every server again on the nodes alive; ``recover`` does that and the controller's
restore of the last published checkpoint, again if a node dies meanwhile
(:func:`gymckpt.stack.ray_recovery.recover`). A node known lost (one of its host actors died)
goes into :attr:`RayStack.lost_nodes` at once, and every later placement group excludes it
(each bundle's label selector ``ray.io/node-id: !in(...)``): Ray itself declares a node dead
only after its health checks miss a raylet for a while (about 15-30 s with its defaults), and
until then its scheduler still counts the node's resources, so a placement could wait for that
or try the dead node first. Ray never gives a node id to another raylet, so the set only grows.
The loss of Ray's head (its GCS) is :class:`~gymckpt.errors.RayHeadLost`: without Ray's external GCS store the
cluster itself cannot recover. A node Ray drains (``ray drain-node``, an autoscaler, a raylet's
own SIGTERM) shows in :meth:`RayStack.draining_nodes` with its deadline before it goes;
:meth:`RayStack.watch_drains` turns each drain into a preemption notice.

:class:`RayStack` answers what :class:`~gymckpt.stack.harness.RolloutHarness` asks of a
stack (``servers``, ``urls``, ``kill``, ``start``, ``close``): URLs change with each
placement, and the harness reads them afresh for each request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from gymckpt.errors import NodeLost, RayHeadLost, RayStackError, SharedStorageRequired
from gymckpt.stack.drain_watch import DrainWatcher
from gymckpt.stack.ray_host import STOP_TIMEOUT, HostActor
from gymckpt.stack.ray_plan import RayOptions, checkpoint_locations, local_path, read_probe, remove_probe, write_probe
from gymckpt.stack.supervisor import checked_stack, server_configs

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

__all__ = ["HostActor", "RayServer", "RayStack"]

logger = logging.getLogger(__name__)

#: seconds a placement (the group fitting, the actors answering) may take
PLACE_TIMEOUT = 60.0
#: seconds the GCS has to accept a TCP connection before the head counts as gone
HEAD_PROBE_SECONDS = 2.0
#: seconds the other host actors of a lost one's node have to be reported dead too
NODE_MATES_SECONDS = 10.0
#: the label Ray gives every node: its node id (a placement's label selectors exclude lost nodes by it)
NODE_ID_LABEL = "ray.io/node-id"


def raylet_gone(node: dict[str, Any]) -> bool:
    """Whether a node's raylet (an entry of ``ray.nodes()``) refuses a TCP connection, or does not take one in time.

    A host actor that died on a node whose raylet still answers lost its process, not its node.
    """
    try:
        address = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
    except (KeyError, TypeError, ValueError):
        return False  # Ray did not say where its raylet listens: only Ray's own node state tells
    try:
        with socket.create_connection(address, timeout=HEAD_PROBE_SECONDS):
            return False
    except OSError:
        return True


@dataclass
class RayServer:
    """One server of a :class:`RayStack`, as the controller sees it (what a harness asks of a server)."""

    name: str
    kind: str
    app: str | None
    workers: int
    config: dict[str, Any] = field(default_factory=dict)
    url: str = ""
    node_id: str = ""
    ip: str = ""
    log_path: Path = field(default_factory=lambda: Path(os.devnull))
    actor: Any = None
    exit_ref: Any = None
    #: set once the host actor is known dead (its node, or its process, lost): nothing more is asked of it
    dead: bool = False
    #: a harness lists pids of local processes: a server on a Ray node has none here
    process: None = None
    #: the pid of the server's process group leader (its lifeline) on its node; 0 before a start. Only
    #: meaningful where that node runs on this machine (a test's or a benchmark's cluster)
    leader_pid: int = 0

    @property
    def label(self) -> str:
        return self.app or self.kind

    @property
    def alive(self) -> bool:
        """Placed, and its process group leader still running (as far as Ray knows)."""
        if self.exit_ref is None:
            return False
        ready, _ = ray.wait([self.exit_ref], timeout=0)
        return not ready

    def what(self) -> list[str]:
        return ["--app", self.app] if self.app is not None else [self.kind]


class RayStack:
    """A stack placed on a Ray cluster; see the module. Use as a context manager, or :meth:`close` it."""

    def __init__(self, spec: str | Path | dict[str, Any], *, address: str | None = None) -> None:
        self.path, data, self.entries, self.checkpoint = checked_stack(spec)
        names = [entry[0] for entry in self.entries]
        self.options = RayOptions.from_block(data.get("ray"), names, self.path)
        # every config checked with stand-in URLs: a mistake is refused before anything is placed
        server_configs(
            self.entries,
            self.checkpoint,
            {name: f"http://127.0.0.1:{n + 1}" for n, name in enumerate(names)},
            self.path,
        )
        self.address = address or self.options.address
        self.servers: dict[str, RayServer] = {
            name: RayServer(name, kind, app, workers) for name, kind, app, _, workers, _ in self.entries
        }
        #: server → node id, one mapping per placement made (the first is the first placement)
        self.placements: list[dict[str, str]] = []
        #: node ids known lost (a host actor of theirs died): no later placement puts a server there
        self.lost_nodes: set[str] = set()
        self._group: PlacementGroup | None = None
        self._connected_here = False
        self._gcs_address: str | None = None
        #: set once :class:`RayHeadLost` was raised: nothing more is asked of the cluster
        self.head_lost = False

    # --- the cluster

    def connect(self) -> None:
        """Join the cluster as a driver (unless this process already is one)."""
        if not ray.is_initialized():
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
            self._connected_here = True
        self._gcs_address = ray.get_runtime_context().gcs_address

    def alive_nodes(self) -> dict[str, dict[str, Any]]:
        """Ray's alive nodes by id (raises :class:`RayHeadLost` when the head does not answer)."""
        self.check_head()
        return {node["NodeID"]: node for node in ray.nodes() if node.get("Alive")}

    def check_head(self) -> None:
        """Raise :class:`RayHeadLost` unless the head's GCS accepts a connection."""
        if self._gcs_address is None:
            return
        host, _, port = self._gcs_address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=HEAD_PROBE_SECONDS):
                return
        except OSError as exc:
            self.head_lost = True
            raise RayHeadLost(
                f"Ray's head node is gone (its GCS at {self._gcs_address} does not answer: {exc.strerror or exc}): "
                "without an external GCS store (Ray's GCS fault tolerance, RAY_REDIS_ADDRESS on the head) the "
                "cluster cannot recover; start a new one and restore the last published checkpoint"
            ) from None

    def draining_nodes(self) -> dict[str, int]:
        """Nodes of this stack Ray is draining (``ray drain-node``, an autoscaler), with their deadlines (ms, 0: none)."""
        from ray._private.state import state  # Ray's own accessor; no public API lists drains yet

        draining = state.get_draining_nodes()
        used = {server.node_id for server in self.servers.values()}
        return {node: deadline for node, deadline in draining.items() if node in used}

    def watch_drains(self, notice: Callable[..., None], *, poll_seconds: float = 1.0) -> DrainWatcher:
        """A started :class:`~gymckpt.stack.drain_watch.DrainWatcher` of this stack's nodes: ``notice`` (a
        :class:`~gymckpt.control.preemption.PreemptionGuard`'s) is called once per drain, with its deadline."""
        return DrainWatcher(self.draining_nodes, notice, poll_seconds=poll_seconds).start()

    # --- placing

    @property
    def urls(self) -> dict[str, str]:
        return {name: server.url for name, server in self.servers.items()}

    def nodes(self) -> dict[str, str]:
        """The node id each server runs on (this placement)."""
        return {name: server.node_id for name, server in self.servers.items()}

    def place(
        self,
        *,
        workers: dict[str, int] | int | None = None,
        timeout: float = PLACE_TIMEOUT,
        keep_resources: bool = True,
    ) -> dict[str, str]:
        """Place every server, check the storage, start them; the node id of each. Nothing stays placed if this raises.

        ``workers`` changes worker counts first; ``keep_resources=False`` places the servers
        without their ``ray.resources`` (where the nodes that had them are gone).
        """
        self.connect()
        for server in self.servers.values():
            if workers is not None:
                server.workers = workers if isinstance(workers, int) else workers.get(server.name, server.workers)
        try:
            self._place(timeout, self.options.resources if keep_resources else {})
        except BaseException:
            self.stop()
            raise
        placed = self.nodes()
        self.placements.append(placed)
        return placed

    def _place(self, timeout: float, resources: dict[str, dict[str, float]]) -> None:
        names = list(self.servers)
        bundles = [{"CPU": self.options.cpus_per_server, **resources.get(name, {})} for name in names]
        began = time.monotonic()
        self._group = placement_group(
            bundles,
            strategy=self.options.strategy,
            name=f"gymckpt-{os.getpid()}",
            bundle_label_selector=self._selectors(len(bundles)),
        )
        try:
            ray.get(self._group.ready(), timeout=timeout)
        except GetTimeoutError:
            alive = len(self.alive_nodes())
            raise RayStackError(
                f"{len(names)} servers ({self.options.cpus_per_server:g} CPUs each, ray.placement "
                f"{self.options.placement}) did not fit on the {alive} nodes alive within {timeout:.0f} s: "
                "lower ray.cpus_per_server, add nodes, or drop a ray.resources no node alive has"
            ) from None
        logger.info(
            "placement group of %d bundles ready in %.2f s (%d nodes excluded as lost)",
            len(bundles),
            time.monotonic() - began,
            len(self.lost_nodes),
        )
        cwd = os.getcwd()
        environment = {key: value for key, value in os.environ.items() if key.startswith(("GYMCKPT_", "OTEL_"))}
        remote = ray.remote(HostActor)
        for index, name in enumerate(names):
            strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)
            self.servers[name].actor = remote.options(
                num_cpus=self.options.cpus_per_server,
                resources=resources.get(name) or None,
                scheduling_strategy=strategy,
                max_concurrency=4,  # wait_exit blocks one thread; stop and log_tail need others
                max_restarts=0,
            ).remote(name, cwd, environment, self.options.log_dir)
            self.servers[name].dead = False
        wheres = self._get([server.actor.where.remote() for server in self.servers.values()], timeout, "answering")
        for server, where in zip(self.servers.values(), wheres, strict=True):
            server.url, server.node_id, server.ip = where["url"], where["node_id"], where["ip"]
            server.log_path = Path(where["log"])
        logger.info("host actors answering %.2f s after the placement began", time.monotonic() - began)
        if placed_lost := sorted({server.node_id for server in self.servers.values()} & self.lost_nodes):
            raise NodeLost(
                f"Ray placed servers on node {', '.join(n[:8] for n in placed_lost)}, known lost: place the stack again",
                placed_lost,
            )
        configs = server_configs(self.entries, self.checkpoint, self.urls, self.path)
        self.check_storage()
        started = []
        for name, server in self.servers.items():
            server.config = configs[name]
            started.append(server.actor.start.remote(server.what(), server.config, server.workers))
        leaders = self._get(started, timeout, "starting its server")
        for server, pid in zip(self.servers.values(), leaders, strict=True):
            server.leader_pid = int(pid)
            server.exit_ref = server.actor.wait_exit.remote()
        logger.info("servers started %.2f s after the placement began", time.monotonic() - began)

    def _selectors(self, count: int) -> list[dict[str, str]] | None:
        """Each bundle's label selector: not on a node known lost (None: no node lost)."""
        if not self.lost_nodes:
            return None
        return [{NODE_ID_LABEL: f"!in({','.join(sorted(self.lost_nodes))})"}] * count

    def _get(self, refs: list[Any], timeout: float, doing: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout)
        except RayActorError as exc:
            self.check_head()
            raise NodeLost(f"a host actor died while {doing}: {exc}; place the stack again") from None
        except GetTimeoutError:
            raise RayStackError(f"the host actors were not done {doing} within {timeout:.0f} s") from None

    # --- shared storage

    def check_storage(self) -> None:
        """With servers (and this driver) on more than one node: every checkpoint location is seen by every node.

        Raises :class:`SharedStorageRequired` naming the setting; S3 (object store) URLs pass.
        """
        driver = ray.get_runtime_context().get_node_id()
        nodes = sorted({server.node_id for server in self.servers.values()} | {driver}, key=lambda n: n != driver)
        enabled = isinstance(self.checkpoint, dict) and bool(self.checkpoint.get("enabled"))
        if len(nodes) < 2 or not enabled:
            return
        locations = checkpoint_locations(self.options, self.checkpoint)
        if not locations:
            raise SharedStorageRequired(
                f"ray.checkpoint_dir: servers on {len(nodes)} nodes need a checkpoint location every node sees: "
                "give an s3:// URL or a shared filesystem's path (or checkpoint.allowed_roots)"
            )
        for setting, location in locations:
            path = local_path(location)
            if path is not None:
                self._probe(setting, location, path, nodes)

    def _probe(self, setting: str, location: str, path: str, nodes: list[str]) -> None:
        def on(node: str, function: Callable[..., Any]) -> Any:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            return ray.remote(function).options(num_cpus=0, scheduling_strategy=strategy, max_retries=0)

        refuse = (
            f"{setting} {location}: the servers and this controller run on {len(nodes)} nodes, and checkpoints "
            "must go where every node sees them"
        )
        try:
            name, content = ray.get(on(nodes[0], write_probe).remote(path), timeout=PLACE_TIMEOUT)
        except RayTaskError as exc:
            raise SharedStorageRequired(f"{refuse}; a probe could not be written there ({exc.cause})") from None
        try:
            seen = ray.get([on(node, read_probe).remote(path, name) for node in nodes[1:]], timeout=PLACE_TIMEOUT)
        finally:
            with contextlib.suppress(Exception):
                ray.get(on(nodes[0], remove_probe).remote(path, name), timeout=PLACE_TIMEOUT)
        blind = [node[:8] for node, read in zip(nodes[1:], seen, strict=True) if read != content]
        if blind:
            raise SharedStorageRequired(
                f"{refuse}; a probe written from node {nodes[0][:8]} is not seen from node {', '.join(blind)}: "
                "give an s3:// URL or a shared filesystem's path"
            )

    # --- losing nodes

    def lost(self) -> list[str]:
        """The servers whose host actor died (its node lost); :class:`RayHeadLost` if the head is gone."""
        refs = {server.exit_ref: name for name, server in self.servers.items() if server.exit_ref is not None}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        dead = []
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                dead.append(refs[ref])
        if dead:
            self.check_head()
        alive = self.alive_nodes()
        dead.extend(name for name, server in self.servers.items() if server.node_id and server.node_id not in alive)
        dead = sorted(set(dead))
        for name in dead:
            self.servers[name].dead = True
        for node in {self.servers[name].node_id for name in dead} - self.lost_nodes - {""}:
            if node not in alive or raylet_gone(alive[node]):
                logger.info("node %s lost (its host actors died, its raylet does not answer): placed on no more", node)
                self.lost_nodes.add(node)
        return dead

    def wait_lost(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for a host actor's death (or a server's exit); the servers lost (see :meth:`lost`)."""
        refs = [server.exit_ref for server in self.servers.values() if server.exit_ref is not None]
        if refs:
            ray.wait(refs, num_returns=1, timeout=timeout)
        dead = self.lost()
        # the other actors of a dead one's node are reported one by one: give them a moment to be
        mates = [
            server.exit_ref
            for server in self.servers.values()
            if server.name not in dead
            and server.exit_ref is not None
            and server.node_id in {self.servers[name].node_id for name in dead}
        ]
        if mates:
            ray.wait(mates, num_returns=len(mates), timeout=NODE_MATES_SECONDS)
            dead = self.lost()
        return dead

    def check(self) -> None:
        """Raise :class:`NodeLost` naming the servers and nodes lost, if any (:class:`RayHeadLost`: the head)."""
        dead = self.lost()
        if dead:
            nodes = sorted({self.servers[name].node_id for name in dead})
            raise NodeLost(
                f"node {', '.join(node[:8] for node in nodes)} is gone with {', '.join(dead)}: "
                "place the stack again (RayStack.replace) and restore the last published checkpoint",
                nodes,
            )

    # --- stopping

    def stop(self) -> None:
        """Stop every server (SIGKILL of each process group), end every host actor, remove the placement group.

        With the head gone nothing can be asked of the cluster: the actors are forgotten, and their
        servers end with them (the raylets exit once the GCS stays away; each lifeline then closes).
        """
        if self.head_lost:
            for server in self.servers.values():
                server.actor = server.exit_ref = None
            self._group = None
            return
        began = time.monotonic()
        servers = [server for server in self.servers.values() if server.actor is not None]
        # an actor known dead is asked nothing (each call would wait for Ray to fail it); its lifeline
        # took its servers with it. The others stop at once, all together, then remove their files.
        living = [server for server in servers if not server.dead]
        self._ask_all(living, "stop")
        self._ask_all(living, "remove_files")
        for server in servers:
            with contextlib.suppress(Exception):
                ray.kill(server.actor, no_restart=True)
            server.actor = server.exit_ref = None
            server.url = server.node_id = server.ip = ""
            server.dead = False
        if self._group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None
        if servers:
            logger.info("%d servers stopped in %.2f s", len(servers), time.monotonic() - began)

    def _ask_all(self, servers: list[RayServer], method: str) -> None:
        """Call ``method`` of each server's actor, all at once; wait (bounded) for every reply, logging failures."""
        refs = {}
        for server in servers:
            with contextlib.suppress(Exception):
                refs[server.name] = getattr(server.actor, method).remote()
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=STOP_TIMEOUT)
        for name, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                pass  # its node is gone, and the lifeline took its servers with it
            except Exception as exc:  # the actor is killed after: its lifeline ends the group
                logger.warning("%s of %s: %s", method, name, " ".join(str(exc).split()))

    def replace(
        self,
        *,
        workers: dict[str, int] | int | None = None,
        timeout: float = PLACE_TIMEOUT,
        keep_resources: bool = True,
    ) -> dict[str, str]:
        """Stop every server and place them all again on the nodes alive (see :meth:`place`); the node id of each."""
        self.stop()
        return self.place(workers=workers, timeout=timeout, keep_resources=keep_resources)

    def close(self) -> None:
        """Stop everything; leave the cluster as it was found (and disconnect, if connected here)."""
        try:
            if ray.is_initialized():
                self.stop()
        finally:
            if self._connected_here and ray.is_initialized() and not self.head_lost:
                ray.shutdown()
                self._connected_here = False

    def __enter__(self) -> RayStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- gymckpt stack up --ray

    def serve(self, stopping: threading.Event, say: Callable[..., None], *, poll_seconds: float = 1.0) -> None:
        """Place the stack and keep it placed until ``stopping`` is set; ``say`` prints a line's fields.

        A node lost is reported and every server placed again on the nodes alive (the
        controller restores the last checkpoint); the head's loss raises :class:`RayHeadLost`.
        """
        if stopping.is_set():
            return
        self.place()
        self._report(say)
        say("press Ctrl-C to stop the stack")
        while not stopping.is_set():
            dead = self.wait_lost(poll_seconds)
            if dead and not stopping.is_set():
                nodes = sorted({self.servers[name].node_id[:8] for name in dead})
                say(f"node {', '.join(nodes)} lost with {', '.join(dead)}: placing every server again")
                self.replace()
                self._report(say)

    def _report(self, say: Callable[..., None]) -> None:
        for name, server in self.servers.items():
            say(
                name,
                server.label,
                server.url,
                f"node {server.node_id[:8]}",
                f"workers {server.workers}",
                f"log {server.log_path}",  # on that node
            )

    # --- what RolloutHarness asks of a stack

    def kill(self, names: list[str] | None = None) -> None:
        """Stop the named servers' process groups (all by default); their actors stay placed."""
        refs = [
            self.servers[name].actor.stop.remote() for name in names or list(self.servers) if self.servers[name].actor
        ]
        with contextlib.suppress(RayActorError):
            ray.get(refs, timeout=STOP_TIMEOUT)

    def start(self, names: list[str] | None = None, *, workers: dict[str, int] | int | None = None) -> None:
        """Make every server run again: a placement of the whole stack (a server restarts only with the others)."""
        del names  # the stack is placed whole: a restore needs fresh processes everywhere
        self.replace(workers=workers)
