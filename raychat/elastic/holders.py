"""Where the memory tier's replicas live: one `ReplicaHolder` actor per node of the worker group,
created and owned by the run's coordinator (raychat.elastic.coordinator), and what a rank hands it, a
`Replica` (raychat.elastic.replicas has the ranks' side and the restore).

Apart from the ranks' side so that the coordinator, which starts the holders and imports this module,
does not import torch: it is a process on the run's start path, and a torch import costs seconds of
CPU on a small node. A holder's own process does import it, as it starts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raychat.elastic.cadence import REPLICA_KEEP_STEPS

if TYPE_CHECKING:
    import torch

    from raychat.checkpoint.meta import LoopState
    from raychat.checkpoint.sharded import Piece
    from raychat.data.cursor import RankCursor

HOLDER_CALL_S = 30.0  # how long a rank or the restore waits on one holder before counting it lost


@dataclasses.dataclass
class Replica:
    """What one rank hands its holders at one step: its pieces and cursor; rank 0 also the loop's state,
    the optimizer's plain data and what merging the cursors needs."""

    epoch: int  # the run lease's epoch: a superseded driver's replicas are never restored
    attempt: int  # which start of the worker group made it (the coordinator's count)
    step: int  # the state before this optimizer step
    rank: int
    world_size: int
    pieces: list[Piece]
    cursor: RankCursor
    loop_state: LoopState | None = None  # rank 0
    extra: dict | None = None  # rank 0: the optimizer's plain data, as a checkpoint's index keeps it
    units: tuple[int, int | None] | None = None  # rank 0: (train units, shuffle seed) for merge_cursor
    log_tail: list[str] | None = None  # rank 0: the metrics log's records not yet written

    @property
    def key(self) -> tuple[int, int]:
        """Which set it belongs to, in the order sets are made (a later attempt's step N follows)."""
        return self.step, self.attempt

    @property
    def nbytes(self) -> int:
        return sum(p.tensor.numel() * p.tensor.element_size() for p in self.pieces)

    def summary(self) -> dict:
        """What the restore needs to know of it without its tensors."""
        return {"epoch": self.epoch, "key": self.key, "rank": self.rank, "world_size": self.world_size,
                "pieces": [(p.name, p.shape, p.start, p.tensor.numel(), p.tensor.dtype) for p in self.pieces]}


@ray.remote(num_cpus=0)
class ReplicaHolder:
    """One node's store of replicas (see the module's docstring)."""

    def __init__(self):
        # What a put unpickles (torch, the pieces, the cursor, the loop state), loaded now, as the
        # holder's process starts, not in the first put: that would make the attempt's first replica
        # take seconds, and the steps after it be skipped.
        import torch  # noqa: F401

        import raychat.checkpoint.meta  # noqa: F401
        import raychat.checkpoint.sharded  # noqa: F401
        import raychat.data.cursor  # noqa: F401

        self.replicas: dict[int, dict[tuple[int, int], Replica]] = {}  # rank -> key -> replica

    def put(self, replica: Replica) -> int:
        """Keep `replica`, drop that rank's older ones beyond REPLICA_KEEP_STEPS; the bytes now held."""
        kept = self.replicas.setdefault(replica.rank, {})
        kept[replica.key] = replica
        for key in sorted(kept)[:-REPLICA_KEEP_STEPS]:
            del kept[key]
        return self.nbytes()

    def retain(self, key: tuple[int, int] | None) -> None:
        """A new attempt started from set `key` (None: from storage): keep only that set's replicas,
        its fallback until the attempt's own sets are complete. Others are older than what the run
        resumed from, or a dead attempt's future that no restore may mix with the new one's."""
        for rank in list(self.replicas):
            self.replicas[rank] = {k: r for k, r in self.replicas[rank].items() if k == key}

    def inventory(self) -> list[dict]:
        return [r.summary() for kept in self.replicas.values() for r in kept.values()]

    def state(self, key: tuple[int, int], rank: int) -> tuple[RankCursor, LoopState | None, dict | None,
                                                             tuple[int, int | None] | None, list[str] | None]:
        r = self.replicas[rank][tuple(key)]
        return r.cursor, r.loop_state, r.extra, r.units, r.log_tail

    def read(self, key: tuple[int, int], parts: list[tuple[int, str, int, int, int]]) -> list[torch.Tensor]:
        """For each (rank, name, start, offset, numel): elements [offset, offset + numel) of that rank's
        piece of `name` starting at `start` (copies: a view would send its whole buffer)."""
        out = []
        for rank, name, start, offset, numel in parts:
            pieces = {(p.name, p.start): p for p in self.replicas[rank][tuple(key)].pieces}
            out.append(pieces[(name, start)].tensor[offset:offset + numel].clone())
        return out

    def nbytes(self) -> int:
        return sum(r.nbytes for kept in self.replicas.values() for r in kept.values())


def start_holders(existing: dict[str, Any], node_ids: list[str]) -> dict[str, Any]:
    """A holder on each of `node_ids` that has none, or whose holder died (killed for memory, say)
    while the node lives on (called inside the coordinator, which owns them). Each node once: asked
    again for a node whose holder it has just started, it would wait for that holder's process to
    start (seconds, on every attempt's set-up path) to learn that it is alive."""
    for node_id in dict.fromkeys(node_ids):
        if node_id in existing:
            try:
                ray.get(existing[node_id].nbytes.remote(), timeout=HOLDER_CALL_S)
            except ray.exceptions.RayActorError:
                del existing[node_id]
            except ray.exceptions.GetTimeoutError:
                pass  # alive and busy (a put of a large replica): it keeps what it has
        if node_id not in existing:
            on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
            existing[node_id] = ReplicaHolder.options(num_cpus=0, scheduling_strategy=on_node).remote()
    return existing
