"""The node layout of a run and the two sub-transports of node-aware rounds: the node's ranks, and one rank per node.

NOTE [ Node groups ]
Node-aware rounds (NOTE [ Node-aware rounds ] in planning/nodes.py) exchange within a node (its P ranks: states,
pooled items, moved samples) and across nodes (the N ranks that share a local rank: one `NodeState` each), while
the per-step all_reduce stays on the world transport, so `StepInfo`'s global counts, and the exact loss, are
the world's. The layout is the launcher's fact, as the rank is: `ODBConfig.nproc_per_node`, else torchrun's
`LOCAL_WORLD_SIZE`, else one node (`node_layout`). `node_transports` builds both sub-transports at loader
construction, on the main thread:
  * first it makes every rank agree on the layout: one all_gather of the ranks per node over the world
    transport, which also runs the transport's pending settings check (NOTE [ Ranks agree on their settings ]:
    `nproc_per_node` is a setting), so ranks launched with different layouts raise `DesyncError` at
    construction instead of creating different groups;
  * Gloo: `dist.new_group` for every node, then for every local rank, on every rank in that order (new_group is
    a collective of the default group); each rank keeps the two it belongs to. They share the world transport's
    courier thread, heartbeat and `TransportStats` (so `LoaderMetrics.sync_bytes` counts them) and are destroyed
    by `NodeTransports.close()` or at interpreter exit (NOTE [ Threads at interpreter exit ]);
  * virtual ranks: one `VirtualHub` per group, shared by the threads of the world's hub.
Cost: N + P groups created once per loader (each rank joins two); nothing per round beyond the rounds' own
exchanges.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from odb_core.planning.nodes import NodeLayout
from odb_core.ranks.sync import _OPEN, JOIN_TIMEOUT_S, GlooTransport, PeerError, Transport, TransportStats, _Courier
from odb_core.ranks.virtual import VirtualHub, VirtualTransport
from odb_core.settings.config import ODBConfig

LAUNCHER_NODE_SIZE = "LOCAL_WORLD_SIZE"  # set by torchrun (and torch.distributed.launch) in every rank's process


def node_layout(config: ODBConfig, world: int) -> NodeLayout:
    """The run's layout: `config.nproc_per_node`, else the launcher's `LOCAL_WORLD_SIZE`, else one node. Raises
    ValueError when the ranks per node do not divide the world size."""
    launcher = os.environ.get(LAUNCHER_NODE_SIZE)
    if world == 1 or config.planning != "global":
        return NodeLayout(world=world, per_node=world)  # the layout changes nothing
    per_node = config.nproc_per_node or (int(launcher) if launcher else world)
    if per_node < 1 or world % per_node:
        given = f"ODBConfig.nproc_per_node={config.nproc_per_node}" if config.nproc_per_node else \
            f"the launcher's {LAUNCHER_NODE_SIZE}={launcher}"
        raise ValueError(f"{given} ranks per node do not divide the world size {world}: node-aware planning needs "
                         "nodes of equal size; set nproc_per_node, or planning='cluster' (one pool over every rank)")
    return NodeLayout(world=world, per_node=per_node)


@dataclass(frozen=True, slots=True)
class NodeTransports:
    """This rank's node (`node`: its P ranks, rank = local rank) and its peers on the other nodes (`across`: the N
    ranks with its local rank, rank = node index); `offset` is its node's first world rank."""

    node: Transport
    across: Transport
    offset: int

    def close(self) -> None:
        self.node.close()
        self.across.close()


def node_transports(world: Transport, layout: NodeLayout) -> NodeTransports:
    """Agree on `layout`, then build this rank's two sub-transports (NOTE [ Node groups ]); every rank calls it
    at the same point, on the main thread."""
    layouts = {v[0] for v in world.all_gather([layout.per_node])}
    if layouts != {layout.per_node}:  # the settings check catches it first; kept for a transport without one
        raise ValueError(f"rank {world.rank}: the ranks run nodes of {sorted(layouts)} ranks; set one nproc_per_node")
    groups = [list(layout.ranks_of(n)) for n in range(layout.n_nodes)]
    groups += [list(range(local, layout.world, layout.per_node)) for local in range(layout.per_node)]
    if isinstance(world, GlooTransport):
        mine = _gloo_groups(world, groups)
    elif isinstance(world, VirtualTransport):
        mine = [_virtual_group(world, ranks) for ranks in groups if world.rank in ranks]
    else:
        raise TypeError(f"node-aware planning needs a GlooTransport or a VirtualTransport, not "
                        f"{type(world).__name__}; use planning='cluster' with this transport")
    return NodeTransports(node=mine[0], across=mine[1], offset=layout.node_of(world.rank) * layout.per_node)


class GlooGroupTransport(GlooTransport):
    """A Gloo group of some ranks (`ranks`, world ranks in group-rank order) that runs its collectives on the
    world transport's courier, under its heartbeat, and counts into its stats."""

    def __init__(self, world: GlooTransport, ranks: Sequence[int], group: dist.ProcessGroup) -> None:
        Transport.__init__(self)
        self.stats, self.timeout_s, self.liveness, self._courier = world.stats, world.timeout_s, world.liveness, \
            world._courier
        self.rank, self.world_size, self.group = list(ranks).index(world.rank), len(ranks), group
        self.world_rank, self.members = world.rank, tuple(ranks)
        _OPEN.add(self)

    def _fail(self, what: str, exc: Exception) -> PeerError:
        """The world transport's error, naming world ranks: this rank's and the group's."""
        return PeerError(f"rank {self.world_rank}: ODB metadata {what} among ranks {list(self.members)} failed "
                         f"(timeout {self.timeout_s:g}s): a peer rank probably died, hung, or stopped iterating early "
                         f"({type(exc).__name__}: {exc})")

    def close(self) -> None:
        """Destroy this group only (the world transport owns the threads); idempotent, runs no collective."""
        group, self.group = self.group, None
        _OPEN.discard(self)
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # destroyed already
                pass


class GlooLaneTransport(GlooGroupTransport):
    """The Gloo group of a move lane (NOTE [ Moves overlap training ] in moves_ahead.py): a courier thread of its
    own, so that a move in flight never holds up the rounds' metadata collectives, and stats of its own (the
    moved bytes are not `sync_bytes`); the world transport's heartbeat."""

    def __init__(self, world: GlooTransport, ranks: Sequence[int], group: dist.ProcessGroup) -> None:
        super().__init__(world, ranks, group)
        self.stats, self._courier = TransportStats(), _Courier()

    def _fail(self, what: str, exc: Exception) -> PeerError:
        return PeerError(f"rank {self.world_rank}: ODB's sample move among ranks {list(self.members)} failed ({what}, "
                         f"timeout {self.timeout_s:g}s): a peer rank probably died or hung "
                         f"({type(exc).__name__}: {exc})")

    def close(self) -> None:
        self._courier.stop(JOIN_TIMEOUT_S)
        super().close()


def lane_transport(world: Transport, layout: NodeLayout) -> Transport | None:
    """The transport of this rank's move lane over its node's ranks (all ranks on one node), or None for a
    transport that cannot make one (moves then run in line). Every rank calls it at the same point, on the thread
    that calls `iter()`; its all_gather runs the settings check first, so ranks that disagree on whether to open
    a lane raise `DesyncError` instead of creating different groups."""
    if not isinstance(world, GlooTransport | VirtualTransport):
        return None
    world.all_gather([layout.per_node])
    groups = [list(layout.ranks_of(n)) for n in range(layout.n_nodes)]
    if isinstance(world, VirtualTransport):
        mine = next(ranks for ranks in groups if world.rank in ranks)
        lane = _virtual_group(world, mine, tag="lane")
        lane.stats = TransportStats()
        return lane
    return _gloo_groups(world, groups, GlooLaneTransport)[0]


def _gloo_groups(world: GlooTransport, groups: list[list[int]],
                 wrap: type[GlooGroupTransport] = GlooGroupTransport) -> list[Transport]:
    """Every group created on every rank, in order; the ones holding this rank, wrapped."""
    timeout = timedelta(seconds=world.timeout_s)
    mine: list[Transport] = []
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if world.rank in ranks:
            mine.append(wrap(world, ranks, group))
    return mine


_SUB_HUBS: weakref.WeakKeyDictionary[VirtualHub, dict[tuple, VirtualHub]] = weakref.WeakKeyDictionary()
_SUB_HUBS_LOCK = threading.Lock()


def _virtual_group(world: VirtualTransport, ranks: list[int], tag: str = "") -> VirtualTransport:
    """This virtual rank's transport on the hub that the world hub's threads share for `ranks` (and `tag`: a move
    lane's hub is not its node group's)."""
    with _SUB_HUBS_LOCK:
        hubs = _SUB_HUBS.setdefault(world.hub, {})
        hub = hubs.setdefault((tag, *ranks), VirtualHub(len(ranks), timeout_s=world.hub.timeout_s))
    transport = VirtualTransport(hub, ranks.index(world.rank))
    transport.stats = world.stats
    return transport
