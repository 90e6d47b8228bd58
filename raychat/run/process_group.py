"""The worker group's torch.distributed process group, set up by Ray Train's backend hooks: what Ray's
TorchConfig does for raychat's workers (gloo on CPUs, NCCL on GPUs, one rank per worker), from a
module that does not import torch.

Ray Train's controller is a process of its own on every run's start, and it unpickles the trainer's
backend config: Ray's TorchConfig lives in ray.train.torch.config, which imports torch at its top,
1.5-2 s of CPU of the controller's 3.6 s on a 2-core node (measured: a tiny run's processes), taken
from the CPUs the worker group starts on. Here torch is imported only by the functions the workers
run, which import it anyway (the controller still loads it to unpickle a worker's torch error, on
a failure's path). The config names no framework: Ray Train's state tracking would then fetch
torch's version from a worker for the dashboard's Train view, a `TorchVersion` whose unpickling
imports torch in the controller after all (the view lists Ray's version alone).
"""

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

SHUTDOWN_S = 30.0  # how long the group's end waits for its ranks to leave the process group
SHUTDOWN_ENV = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"  # Ray's name for it, which overrides it
logger = logging.getLogger(__name__)


class _CudaDevice:
    """Ray Train's context around the train function: a GPU worker's current CUDA device is its own."""

    def __enter__(self) -> None:
        import torch
        from ray.train.torch import get_device

        if torch.cuda.is_available():
            device = get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc: object) -> bool:
        return False


@dataclass
class ProcessGroupConfig(BackendConfig):
    """One process group over the worker group: NCCL when the workers have GPUs, gloo otherwise.
    `timeout_s`: how long a collective waits for a rank (Ray's default)."""

    timeout_s: int = 1800

    def to_dict(self) -> dict[str, Any]:  # the dashboard's Train view shows it
        return {"backend": "nccl on GPUs, gloo otherwise", "init_method": "env", "timeout_s": self.timeout_s}

    @property
    def backend_cls(self) -> type[Backend]:
        return _ProcessGroup

    @property
    def train_func_context(self) -> type:
        return _CudaDevice


class _ProcessGroup(Backend):
    share_cuda_visible_devices: bool = True  # NCCL wants every GPU of a node visible to its ranks

    def on_start(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        address, port = worker_group.execute_single(0, rendezvous_address)
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, join_process_group, backend=backend, world_rank=rank,
                                                   world_size=size, address=address, port=port,
                                                   timeout_s=backend_config.timeout_s)
                 for rank in range(size)])

    def on_shutdown(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        futures = worker_group.execute_async(leave_process_group, destroy=len(worker_group) > 1)
        # A rank stuck in a collective is not waited for: Ray Train ends its process next.
        timeout_s = float(os.environ.get(SHUTDOWN_ENV) or SHUTDOWN_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning(f"the process group did not end within {timeout_s:.0f} s ({SHUTDOWN_ENV})")


def rendezvous_address() -> tuple[str, int]:
    """On rank 0: its node's address and a port free there, where the other ranks meet it."""
    address = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind(("", 0))
        return address, s.getsockname()[1]


def join_process_group(backend: str, world_rank: int, world_size: int, address: str, port: int,
                       timeout_s: int) -> None:
    """On each worker: the variables torch's env:// rendezvous reads (and torchrun sets, which some
    libraries read), then the process group."""
    import torch.distributed as dist

    context = ray.train.get_context()
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(world_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(context.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(context.get_local_world_size()),
                      NODE_RANK=str(context.get_node_rank()))
    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        # a collective that times out fails the attempt (Ray Train restarts it) instead of hanging it
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend=backend, init_method="env://", rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def leave_process_group(destroy: bool) -> None:
    """On each worker as the group ends: leave the process group, give the GPU's cached memory back."""
    import torch
    import torch.distributed as dist

    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
