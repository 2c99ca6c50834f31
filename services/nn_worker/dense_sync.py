"""Synchronous data parallelism for the dense model across NN ranks.

Every global step is one all-reduce: the dense gradients as one flat bucket (for recommendation MLPs
it is small next to the embeddings) with two numbers appended, "I had a batch" and "I still have
batches". The first sums to the number of ranks that contributed, over which the gradients are
averaged; a step to which none contributed (every rank skipped its batch) changes nothing. Ranks that
have run out of batches keep stepping with zero gradients until all are done, so uneven batch counts
never deadlock the collective (the job's batches are never truncated to the shortest rank); a step
where the second sums to zero ends training on every rank at once. Carrying the flags in the
gradients' own collective, not in one of its own before the step, spares every step a round trip
between the ranks.

The rendezvous (master address and port) is found over NATS: rank 0 opens a TCPStore on a free
port and answers ``nn.rendezvous``; nobody hand-sets an address.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist
from persia_nats.common.env import read_env
from persia_nats.common.messages import RendezvousReply, RendezvousRequest
from persia_nats.services.nn_worker.rank_loop import RankLoop
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

log = logging.getLogger(__name__)

#: how long a rank other than 0 looks for the rendezvous rank 0 announces
RENDEZVOUS_DEADLINE_S = 300.0


def default_master_addr(local_world_size: int, world_size: int) -> str:
    """``PERSIA_MASTER_ADDR`` if set; loopback when every rank is on this host; else this host's address."""
    explicit = os.environ.get("PERSIA_MASTER_ADDR")
    if explicit:
        return explicit
    if local_world_size >= world_size:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def device_for_rank(local_rank: int, local_ranks: int, gpus: int, share_gpus: bool) -> int | None:
    """The GPU an NN rank trains on, or None for the CPU: its own (``local_rank``) where the host has one per
    rank; where it has fewer, GPU ``local_rank mod gpus`` when the job shares GPUs (``PERSIA_SHARE_GPUS``),
    else the CPU. NCCL refuses two ranks on one GPU; sharing ranks all-reduce with gloo (:func:`backend_for`)."""
    if gpus < 1:
        return None
    if local_ranks <= gpus:
        return local_rank
    return local_rank % gpus if share_gpus else None


def backend_for(device: torch.device, share_gpus: bool = False) -> str:
    """NCCL for a rank on a GPU of its own, gloo otherwise. A job that shares GPUs all-reduces with gloo on
    every rank, those with a GPU to themselves too: the ranks of one process group need one backend."""
    on_gpu = device.type == "cuda" and not share_gpus
    return "nccl" if on_gpu and dist.is_nccl_available() else "gloo"


class Rendezvous:
    """Rank 0's TCPStore, announced over NATS; other ranks look it up."""

    def __init__(self, rank: int, world_size: int, master_addr: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.store: dist.TCPStore | None = None
        if rank == 0:
            # port 0: the OS picks a free port, so concurrent jobs on one host never collide
            self.store = dist.TCPStore(master_addr, 0, world_size, is_master=True, wait_for_workers=False)

    def info(self, _req: RendezvousRequest | None = None) -> RendezvousReply:
        assert self.store is not None
        return RendezvousReply(self.master_addr, self.store.port, self.world_size)

    def connect(self, addr: str, port: int) -> dist.TCPStore:
        self.store = dist.TCPStore(addr, port, self.world_size, is_master=False)
        return self.store


def join_dense_group(loop: RankLoop, model: torch.nn.Module, device: torch.device, *, rank: int,
                     world_size: int) -> DenseSync:
    """Join the job's dense process group: rank 0 opens the rendezvous and answers ``nn.rendezvous`` on the
    rank's loop, the others find it there; every rank then starts from rank 0's parameters."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    rdv = Rendezvous(rank, world_size, default_master_addr(local, world_size))
    if rank == 0:
        loop.serve_rendezvous(rdv.info)
    else:
        info = loop.find_rendezvous(deadline=RENDEZVOUS_DEADLINE_S)
        rdv.connect(info.addr, info.port)
    assert rdv.store is not None
    backend = init_process_group(rdv.store, rank, world_size, device)
    loop.dense_group_joined()
    sync = DenseSync(model, device, backend=backend, rendezvous=rdv)
    sync.broadcast_state()
    return sync


class DenseSync:
    """The per-step collectives of one rank."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, backend: str = "gloo",
                 rendezvous: Rendezvous | None = None) -> None:
        self.model = model
        self.device = device
        self.backend = backend
        #: rank 0's store lives as long as the group
        self.rendezvous = rendezvous
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = dist.get_world_size()
        self.steps = 0
        #: ranks that still had batches at the last step (0: every rank is done, training ends)
        self.running = self.world_size
        #: ranks that had a batch at the last step
        self.active = self.world_size

    def broadcast_state(self) -> None:
        """Make every rank's parameters and buffers equal to rank 0's."""
        with torch.no_grad():
            tensors = [*self.model.parameters(), *self.model.buffers()]
            for t in tensors:
                dist.broadcast(t.data, src=0)

    def allreduce_grads(self, has_batch: bool, done: bool = False) -> int:
        """Average the gradients over the ranks that had a batch this step; returns how many did.
        With none the gradients are left as they are. ``done``: this rank is out of batches; once every
        rank is, :attr:`running` is 0."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        # filled on the device: a tensor built from host values would be a copy that waits for the GPU
        flags = torch.ones(2, dtype=grads[0].dtype if grads else torch.float32, device=self.device)
        if not has_batch:
            flags[0] = 0
        if done:
            flags[1] = 0
        flat = _flatten_dense_tensors([*grads, flags])
        dist.all_reduce(flat)
        active, self.running = (int(round(float(x))) for x in flat[-2:].tolist())
        self.active = active
        if active == 0:
            return 0
        flat /= active
        for g, synced in zip(grads, _unflatten_dense_tensors(flat[:-2], grads), strict=True):
            g.copy_(synced)
        self.steps += 1
        return active

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_process_group(store: dist.TCPStore, rank: int, world_size: int, device: torch.device) -> str:
    backend = backend_for(device, read_env().share_gpus)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    log.info("rank %d/%d joined the %s process group", rank, world_size, backend)
    return backend
