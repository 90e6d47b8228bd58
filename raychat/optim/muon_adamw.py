"""MuonAdamW: nanochat's combined optimizer, with data parallelism built in.

Muon (`raychat.optim.muon`) trains the transformer's matrices, on a stack of a group's same-shape matrices
at once. AdamW (torch's fused kernel: decoupled weight decay, bias correction) trains the embeddings,
value embeddings, lm_head and per-layer scalars. The algorithm is nanochat's (`nanochat/optim.py`),
step for step.

Why the distribution lives here and not in DDP: the optimizer is the only consumer of the summed
gradient, so the reduction can be a reduce-scatter. Each rank receives only the gradient slice it
updates, keeps optimizer state only for that slice (ZeRO-2) and all-gathers the updated parameters.
Gradients are SUM-reduced (the caller divides the loss by the GLOBAL token count), so the update is
the same function of the same rows at any world size; `raychat.optim.shards` says which slice of
each parameter a rank gets.
Reductions are launched asynchronously first (Muon's first, so its orthogonalisation, the heaviest
compute, overlaps AdamW's larger reductions); each group is then updated as its reduction lands and
its all-gather launched, so gathers run while later groups compute.

`state_dict()` gathers the shards into full tensors keyed by parameter name, identical on every rank
and independent of the world size; `load_state_dict()` re-shards such a state for the current one.
Checkpoints do not gather: `owned_pieces` lists the ranges of that canonical state this rank holds
(its AdamW shards, rank 0 also the replicated remainders; the Muon momenta of the matrices it owns)
as views of its own memory, `wanted_ranges` the ranges it needs at the current world size, and
`load_owned` builds its state from them, with no collective (raychat.optim.base).

`SPEC` builds it for a run (--optimizer muon_adamw, the default) with nanochat's schedules.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.adamw import adamw as fused_adamw

from raychat.config import TrainConfig
from raychat.model.gpt import GPT
from raychat.optim.base import (
    OptimizerSpec,
    OwnedPiece,
    Range,
    ReadRange,
    ShardedOptimizer,
    StateBytes,
    check_saved_groups,
)
from raychat.optim.muon import muon_update
from raychat.optim.shards import (
    adam_slots,
    adamw_runs,
    adamw_shard_numel,
    check_saved_state,
    muon_buffers,
    muon_chunk,
    owned_matrices,
    state_shapes,
    world_and_rank,
)
from raychat.scaling import Plan, muon_momentum, muon_weight_decay

# nanochat's AdamW sets: lr source, lr multiplier, scaled by (model_dim / 768) ** -0.5, betas, weight decay
ADAMW_SETS = {
    "lm_head": ("unembedding_lr", 1.0, True, (0.8, 0.96), 0.01),
    "embedding": ("embedding_lr", 1.0, True, (0.8, 0.995), 0.001),
    "value_embeds": ("embedding_lr", 0.5, True, (0.8, 0.995), 0.01),
    "resid": ("scalar_lr", 0.01, False, (0.8, 0.95), 0.05),
    "x0": ("scalar_lr", 1.0, False, (0.96, 0.95), 0.0),  # higher beta1 for x0
    "smear": (None, 0.2, False, (0.8, 0.95), 0.0),  # a fixed lr, not batch-scaled
}
ADAMW_EPS = 1e-10
MUON_DEFAULTS = {"momentum": 0.95, "ns_steps": 5, "beta2": 0.9}


@dataclass
class _InFlight:
    """Collectives launched for one group, and the buffers they read or write."""
    works: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)   # AdamW: parameter -> its reduced gradient run
    stacked: Tensor | None = None                # Muon: the padded stack, gradients then parameters
    chunk_grads: Tensor | None = None            # Muon: the reduced gradients of this rank's matrices

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()


def _flat_grad(p: Tensor) -> Tensor:
    if p.grad is None:
        return torch.zeros(p.numel(), device=p.device, dtype=p.dtype)
    return p.grad.reshape(-1)


class MuonAdamW(ShardedOptimizer):
    """Muon for groups of kind "muon" (lr, momentum, beta2, weight_decay, ns_steps; every parameter of
    one shape), AdamW for kind "adamw" (lr, betas, eps, weight_decay). Every group also carries "names"
    (its parameters' names: the keys of the canonical state dict) and "initial_lr".

    Distributed when torch.distributed is initialized with more than one rank (see the module
    docstring). A parameter without a gradient is updated as if its gradient were zero, so every rank
    takes part in every collective. After step(), `p.grad` still holds this rank's own gradient.
    `bf16_iteration`: run Muon's orthogonalisation in bf16 (where the model computes in bf16).
    """

    name = "muon_adamw"

    def __init__(self, param_groups: list[dict], bf16_iteration: bool = False):
        for group in param_groups:
            group["params"] = list(group["params"])
            if group.get("kind") not in ("adamw", "muon"):
                raise ValueError(f"optimizer group kind must be 'adamw' or 'muon', got {group.get('kind')!r}")
            if len(group.get("names", ())) != len(group["params"]):
                raise ValueError("every optimizer group needs 'names': one name per parameter")
            shapes = {p.shape for p in group["params"]}
            if group["kind"] == "muon" and (len(shapes) > 1 or any(len(shape) != 2 for shape in shapes)):
                raise ValueError("a Muon group stacks its matrices: its parameters must be 2-D, of one shape")
            group.setdefault("initial_lr", group["lr"])
        super().__init__(param_groups)
        params = [p for group in self.param_groups for p in group["params"]]
        names = [name for group in self.param_groups for name in group["names"]]
        if len(set(names)) != len(names):
            raise ValueError("optimizer parameter names must be unique")
        if len({(p.device, p.dtype) for p in params}) > 1:
            raise ValueError("optimizer parameters must share one device and dtype")
        if not all(p.is_contiguous() for p in params):
            raise ValueError("optimizer parameters must be contiguous (flat views are updated in place)")
        self._layout: tuple[int, int] | None = None  # (world, rank) the state is sharded for
        self.bf16_iteration = bf16_iteration

    def _groups(self, kind: str) -> list[dict]:
        return [group for group in self.param_groups if group["kind"] == kind]

    def _check_layout(self) -> tuple[int, int]:
        layout = world_and_rank()
        if self._layout is not None and self._layout != layout:
            raise RuntimeError(f"optimizer state is sharded for (world size, rank) {self._layout}, the "
                               f"process group is now {layout}: move it via state_dict() to a new optimizer")
        self._layout = layout
        return layout

    # ---- sharded state ------------------------------------------------------------------------

    def _ensure_state(self, world: int, rank: int) -> None:
        for group in self._groups("adamw"):
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p]["slots"] = adam_slots(p, world, rank)
        for group in self._groups("muon"):
            state = self.state[group["params"][0]]  # a group's state lives with its first matrix
            if not state:
                state.update(muon_buffers(group["params"], world, rank))

    # ---- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        world, rank = self._check_layout()
        self._ensure_state(world, rank)
        muon_groups, adamw_groups = self._groups("muon"), self._groups("adamw")
        # Phase 1: launch every reduction, Muon's first: its orthogonalisation is the heaviest compute,
        # so it starts while AdamW's (larger) gradients are still being reduced
        muon_reduces = [self._reduce_muon(group, world) for group in muon_groups]
        replicated = self._reduce_replicated(adamw_groups, world)
        adamw_reduces = [self._reduce_adamw(group, world) for group in adamw_groups]
        # Phase 2: update each group as its reduction lands, then launch its all-gather
        gathers = [self._update_muon(group, reduce, world, rank)
                   for group, reduce in zip(muon_groups, muon_reduces, strict=True)]
        replicated.wait()
        gathers += [self._update_adamw(group, reduce, replicated, world, rank)
                    for group, reduce in zip(adamw_groups, adamw_reduces, strict=True)]
        # Phase 3: wait for the gathers; Muon's matrices go back from the stack into the parameters
        for group, gather in zip(muon_groups + adamw_groups, gathers, strict=True):
            gather.wait()
            if group["kind"] == "muon":
                torch._foreach_copy_(group["params"], list(gather.stacked[:len(group["params"])].unbind(0)))

    def _reduce_muon(self, group: dict, world: int) -> _InFlight:
        """Stack the group's gradients (zero-padded to chunk * world) and reduce-scatter the stack."""
        params = group["params"]
        chunk = muon_chunk(len(params), world)
        stacked = torch.empty(chunk * world, *params[0].shape, device=params[0].device, dtype=params[0].dtype)
        torch._foreach_copy_(list(stacked[:len(params)].unbind(0)),
                             [p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        stacked[len(params):].zero_()
        if world == 1:
            return _InFlight(stacked=stacked, chunk_grads=stacked)
        chunk_grads = torch.empty_like(stacked[:chunk])
        work = dist.reduce_scatter_single(chunk_grads, stacked, async_op=True)
        return _InFlight(works=[work], stacked=stacked, chunk_grads=chunk_grads)

    def _reduce_replicated(self, groups: list[dict], world: int) -> _InFlight:
        """One all-reduce for the replicated runs of every AdamW tensor (small tensors, shard remainders)."""
        params = [p for group in groups for p in group["params"]]
        if world == 1 or not params:
            return _InFlight()
        tails = [_flat_grad(p)[adamw_shard_numel(p.numel(), world) * world:] for p in params]
        flat = torch.cat(tails)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        grads = dict(zip(params, flat.split([t.numel() for t in tails]), strict=True))
        return _InFlight(works=[work], grads=grads)

    def _reduce_adamw(self, group: dict, world: int) -> _InFlight:
        """Reduce-scatter the sharded part of each large tensor, straight from its gradient."""
        reduce = _InFlight()
        for p in group["params"]:
            shard = adamw_shard_numel(p.numel(), world)
            if shard:
                reduce.grads[p] = torch.empty(shard, device=p.device, dtype=p.dtype)
                reduce.works.append(dist.reduce_scatter_single(reduce.grads[p], _flat_grad(p)[:shard * world],
                                                               async_op=True))
        return reduce

    def _update_muon(self, group: dict, reduce: _InFlight, world: int, rank: int) -> _InFlight:
        """Muon on the matrices this rank owns, in its rows of the stack, then all-gather the stack."""
        reduce.wait()
        params = group["params"]
        chunk = muon_chunk(len(params), world)
        owned = params[rank * chunk:(rank + 1) * chunk]
        if world == 1:
            stacked = own_rows = torch.stack(params)
        else:
            # the reduce-scatter has read the gradients: the stack becomes the all-gather buffer
            stacked = reduce.stacked
            own_rows = stacked[rank * chunk:(rank + 1) * chunk]
            if owned:
                torch._foreach_copy_(list(own_rows[:len(owned)].unbind(0)), owned)
        if owned:
            state = self.state[params[0]]
            n = len(owned)
            muon_update(reduce.chunk_grads[:n], own_rows[:n], state["momentum_buffer"][:n],
                        state["second_momentum_buffer"][:n], momentum=group["momentum"], lr=group["lr"],
                        weight_decay=group["weight_decay"], beta2=group["beta2"] or 0.0,
                        ns_steps=group["ns_steps"], bf16=self.bf16_iteration)
        gather = _InFlight(stacked=stacked)
        if world > 1:
            gather.works.append(dist.all_gather_single(stacked, own_rows, async_op=True))
        return gather

    def _update_adamw(self, group: dict, reduce: _InFlight, replicated: _InFlight, world: int,
                      rank: int) -> _InFlight:
        """One fused AdamW call over this rank's runs of the group, then all-gather the shards in place."""
        reduce.wait()
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            sharded_numel = adamw_shard_numel(p.numel(), world) * world
            for slot in self.state[p]["slots"]:
                params.append(slot.of(p))
                if world == 1:
                    grads.append(slot.of(_flat_grad(p)))
                else:
                    grads.append(reduce.grads[p] if slot.start < sharded_numel else replicated.grads[p])
                exp_avgs.append(slot.exp_avg)
                exp_avg_sqs.append(slot.exp_avg_sq)
                steps.append(slot.step)
        beta1, beta2 = group["betas"]
        fused_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False,
                    maximize=False, beta1=beta1, beta2=beta2, lr=group["lr"], eps=group["eps"],
                    weight_decay=group["weight_decay"])
        gather = _InFlight()
        for p in group["params"]:
            shard = adamw_shard_numel(p.numel(), world)
            if shard:
                flat = p.view(-1)
                own = flat[rank * shard:(rank + 1) * shard]
                gather.works.append(dist.all_gather_single(flat[:shard * world], own, async_op=True))
        return gather

    # ---- canonical state dict -----------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self) -> dict:
        """{"state": {name: {...full tensors...}}, "param_groups": [hyperparameters and "names"]}.
        When distributed this is a collective (it gathers the shards) and every rank gets the same."""
        world, _ = self._check_layout()
        state = {}
        for group in self.param_groups:
            if group["kind"] == "adamw":
                for name, p in zip(group["names"], group["params"], strict=True):
                    if self.state[p]:
                        state[name] = self._gather_adamw(p, world)
            elif self.state[group["params"][0]]:
                state.update(self._gather_muon(group, world))
        groups = [{key: value for key, value in group.items() if key != "params"}
                  for group in self.param_groups]
        return {"state": state, "param_groups": groups}

    def _gather_adamw(self, p: Tensor, world: int) -> dict:
        slots = self.state[p]["slots"]
        sharded_numel = adamw_shard_numel(p.numel(), world) * world
        entry: dict = {"step": int(slots[0].step.item())}
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.empty_like(p)
            for slot in slots:
                if slot.start < sharded_numel:
                    dist.all_gather_single(full.view(-1)[:sharded_numel], getattr(slot, key))
                else:
                    slot.of(full).copy_(getattr(slot, key))
            entry[key] = full
        return entry

    def _gather_muon(self, group: dict, world: int) -> dict:
        state = self.state[group["params"][0]]
        full = {}
        for key in ("momentum_buffer", "second_momentum_buffer"):
            full[key] = state[key]
            if world > 1:
                full[key] = state[key].new_empty(state[key].shape[0] * world, *state[key].shape[1:])
                dist.all_gather_single(full[key], state[key])
        return {name: {key: full[key][i].clone() for key in full} for i, name in enumerate(group["names"])}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a canonical state, saved at any world size, sharding it for the current one."""
        check_saved_state(self.param_groups, state_dict)
        saved_state = state_dict["state"]
        world, rank = world_and_rank()
        self._layout = (world, rank)
        self.state.clear()
        # Only the state is restored: the groups keep the hyperparameters this run was built with
        # (learning rates and their scale, betas, eps, weight decay), so a rerun with lower rates
        # after a NaN, or another batch size, trains with what it asked for from this step on.
        for group in self.param_groups:
            if group["kind"] == "adamw":
                for name, p in zip(group["names"], group["params"], strict=True):
                    if name in saved_state:
                        entry = saved_state[name]
                        self.state[p]["slots"] = adam_slots(p, world, rank, entry, entry["step"])
            elif all(name in saved_state for name in group["names"]):
                full = {key: torch.stack([saved_state[name][key] for name in group["names"]])
                        for key in ("momentum_buffer", "second_momentum_buffer")}
                self.state[group["params"][0]].update(muon_buffers(group["params"], world, rank, full))

    # ---- each rank's own ranges, for checkpoints ------------------------------------------------

    def owned_pieces(self) -> tuple[list[OwnedPiece], dict]:
        world, rank = self._check_layout()
        pieces: list[OwnedPiece] = []
        groups = [{key: value for key, value in g.items() if key != "params"} for g in self.param_groups]
        plain: dict = {"param_groups": groups, "steps": {}, "stateful": []}
        for group in self.param_groups:
            if group["kind"] == "adamw":
                for name, p in zip(group["names"], group["params"], strict=True):
                    slots = self.state[p].get("slots")
                    if not slots:
                        continue
                    plain["stateful"].append(name)
                    plain["steps"][name] = int(slots[0].step.item())
                    sharded = adamw_shard_numel(p.numel(), world) * world
                    for slot in slots:
                        if slot.start < sharded or rank == 0:  # a replicated run is written once, by rank 0
                            pieces += [(name, "exp_avg", tuple(p.shape), slot.start, slot.exp_avg),
                                       (name, "exp_avg_sq", tuple(p.shape), slot.start, slot.exp_avg_sq)]
                continue
            state = self.state[group["params"][0]]
            if not state:
                continue
            plain["stateful"] += group["names"]
            shapes = state_shapes("muon", group["params"][0].shape)
            for row, i in enumerate(owned_matrices(len(group["params"]), world, rank)):
                for key, shape in shapes.items():
                    pieces.append((group["names"][i], key, shape, 0, state[key][row]))
        return pieces, plain

    def wanted_ranges(self, stateful: list[str]) -> list[Range]:
        world, rank = world_and_rank()
        has_state = set(stateful)
        ranges: list[Range] = []
        for group in self.param_groups:
            if group["kind"] == "adamw":
                for name, p in zip(group["names"], group["params"], strict=True):
                    if name in has_state:
                        for start, length in adamw_runs(p.numel(), world, rank):
                            ranges += [(name, key, tuple(p.shape), start, length)
                                       for key in ("exp_avg", "exp_avg_sq")]
            elif group["names"][0] in has_state:
                shapes = state_shapes("muon", group["params"][0].shape)
                for i in owned_matrices(len(group["params"]), world, rank):
                    ranges += [(group["names"][i], key, shape, 0, shape[0] * shape[1])
                               for key, shape in shapes.items()]
        return ranges

    @torch.no_grad()
    def load_owned(self, plain: dict, read: ReadRange) -> None:
        check_saved_groups(self.param_groups, plain["param_groups"])
        world, rank = world_and_rank()
        self._layout = (world, rank)
        self.state.clear()
        has_state = set(plain["stateful"])
        # Only the state is restored: the groups keep the hyperparameters this run was built with
        # (learning rates and their scale, betas, eps, weight decay), so a rerun with lower rates after a
        # NaN, or another batch size, trains with what it asked for from this step on.
        for group in self.param_groups:
            if group["kind"] == "adamw":
                for name, p in zip(group["names"], group["params"], strict=True):
                    if name in has_state:
                        slots = adam_slots(p, world, rank, step=plain["steps"][name])
                        for slot in slots:
                            slot.exp_avg.copy_(read(name, "exp_avg", slot.start))
                            slot.exp_avg_sq.copy_(read(name, "exp_avg_sq", slot.start))
                        self.state[p]["slots"] = slots
            elif group["names"][0] in has_state:
                buffers = muon_buffers(group["params"], world, rank)
                for row, i in enumerate(owned_matrices(len(group["params"]), world, rank)):
                    for key, buffer in buffers.items():
                        buffer[row].copy_(read(group["names"][i], key, 0).view(buffer.shape[1:]))
                self.state[group["params"][0]].update(buffers)


def build_optimizer(model: GPT, *, embedding_lr: float, unembedding_lr: float, matrix_lr: float,
                    scalar_lr: float, weight_decay: float) -> MuonAdamW:
    """nanochat's GPT.setup_optimizer: the AdamW sets with their own lrs, betas and weight decays
    (embedding and lm_head lrs scaled by (model_dim / 768) ** -0.5), one Muon group per matrix shape.
    The lrs are used as given: the caller has already applied the batch-size lr scale. Muon iterates
    in bf16 when the model computes in bf16 (its --dtype), as nanochat's does on GPUs."""
    names = {id(p): name for name, p in model.named_parameters()}
    sets = model.optimizer_param_sets()
    placed = [id(p) for params in sets.values() for p in params]
    if sorted(placed) != sorted(names):
        raise ValueError("optimizer_param_sets() must place every model parameter in exactly one set")
    unknown = set(sets) - set(ADAMW_SETS) - {"matrix"}
    if unknown:
        raise ValueError(f"optimizer_param_sets() has sets without an optimizer rule: {sorted(unknown)}")

    dmodel_lr_scale = (model.config.n_embd / 768) ** -0.5
    base_lrs = {"embedding_lr": embedding_lr, "unembedding_lr": unembedding_lr, "scalar_lr": scalar_lr,
                None: 1.0}
    groups = []
    for set_name, (lr_source, multiplier, dmodel_scaled, betas, weight_decay_) in ADAMW_SETS.items():
        params = sets.get(set_name, [])
        if params:
            lr = base_lrs[lr_source] * multiplier * (dmodel_lr_scale if dmodel_scaled else 1.0)
            groups.append({"kind": "adamw", "params": params, "names": [names[id(p)] for p in params],
                           "lr": lr, "betas": betas, "eps": ADAMW_EPS, "weight_decay": weight_decay_})
    matrices = sets.get("matrix", [])
    for shape in sorted({tuple(p.shape) for p in matrices}):
        params = [p for p in matrices if tuple(p.shape) == shape]
        groups.append({"kind": "muon", "params": params, "names": [names[id(p)] for p in params],
                       "lr": matrix_lr, "weight_decay": weight_decay, **MUON_DEFAULTS})
    return MuonAdamW(groups, bf16_iteration=model.compute_dtype == torch.bfloat16)


class MuonAdamWSpec(OptimizerSpec):
    """--optimizer muon_adamw: nanochat's lrs (--embedding-lr, --unembedding-lr, --matrix-lr,
    --scalar-lr, times the batch-size scale), and its Muon momentum and weight decay schedules."""

    def build(self, model: GPT, cfg: TrainConfig, plan: Plan) -> MuonAdamW:
        return build_optimizer(model, embedding_lr=cfg.embedding_lr * plan.lr_scale,
                               unembedding_lr=cfg.unembedding_lr * plan.lr_scale,
                               matrix_lr=cfg.matrix_lr * plan.lr_scale,
                               scalar_lr=cfg.scalar_lr * plan.lr_scale, weight_decay=plan.weight_decay)

    def schedule(self, optimizer: ShardedOptimizer, cfg: TrainConfig, plan: Plan, step: int) -> None:
        momentum = muon_momentum(step, plan.num_iterations, cfg.warmdown_ratio)
        weight_decay = muon_weight_decay(step, plan.num_iterations, plan.weight_decay)
        for group in optimizer.param_groups:
            if group["kind"] == "muon":
                group["momentum"] = momentum
                group["weight_decay"] = weight_decay

    def state_bytes(self, cfg: TrainConfig, params: dict[str, int], world_size: int) -> StateBytes:
        """With M parameters in the transformer's matrices (Muon) and A others (AdamW), fp32: AdamW's
        two moments and Muon's momentum, sharded (Muon's factored second moment, one value per row,
        is left out); during the step a Muon group's stacked matrices (its all-gather buffer) and the
        reduce-scattered AdamW shards. Each rank saves what it holds."""
        muon = params["transformer_matrices"]
        adamw = params["total"] - muon
        state = (8 * adamw + 4 * muon) // world_size
        return StateBytes(state=state, step_buffers=4 * muon + 4 * adamw // world_size, saved=state)


SPEC = MuonAdamWSpec()
