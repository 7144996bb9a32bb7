"""The all_reduce of a tensor-parallel rank (edgellm.models.blocks: two a layer), on the GPU.

NCCL's all_reduce of one decode row took 21-23 us inside a CUDA graph on two NVLink-connected
H200s (2026-11-26, NVLink multicast off), where the row's bytes take well under a microsecond:
64 of them a token would cost an 8B model's step more than its halved weights save. The one-shot
form reads every rank's partial sum straight from its memory over NVLink (PyTorch's symmetric
memory: buffers every rank maps, a barrier on signal pads, then each rank adds all partials):
6.4 us in the same graph. Its inputs live in symmetric buffers that the projections write
directly; two buffers alternate between consecutive all_reduces, so that a rank writes a buffer
again only after every rank has passed the barrier of the all_reduce in between, i.e. finished
reading it (a program with an odd number gets one buffer per all_reduce).

Where the all_reduce's sum feeds a residual add + RMSNorm (two a layer), the norm kernel does the
reduction itself (peers(): kernels/norm.py's Peers, its own barrier on the buffer's signal pad),
one launch a layer's all_reduce less.

Elsewhere (EDGELLM_ALL_REDUCE=nccl, no symmetric memory, the interpreter's CPU tensors under
gloo) the partial is copied into the output's buffer and reduced there by torch.distributed.
"""

from __future__ import annotations

import os

import torch


class OneShot:
    """Symmetric input buffers for a program's all_reduces, and the reduction itself."""

    def __init__(self, device: torch.device, rows: int, width: int, count: int, dtype=torch.float32):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name
        try:  # required before first use in some PyTorch versions, deprecated in others
            symm_mem.enable_symm_mem_for_group(self.group)
        except Exception:  # noqa: BLE001 - newer versions enable every group themselves
            pass
        self.buffers, self.handles = [], []
        for _ in range(2 if count % 2 == 0 else count):
            buf = symm_mem.empty((rows, width), dtype=dtype, device=device)
            # collective: every rank compiles the same programs
            self.handles.append(symm_mem.rendezvous(buf, self.group))
            self.buffers.append(buf)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_out
        self._peers: dict[int, object] = {}

    def peers(self, k: int):
        """The k-th all_reduce's buffers on every rank and their signal pads, for a kernel that
        reduces them itself (kernels/norm.py's Peers); None where this PyTorch's symmetric memory
        handle does not expose them (the reduction then stays a kernel of its own)."""
        from .kernels.norm import Peers

        i = k % len(self.buffers)
        if i not in self._peers:
            h, buf = self.handles[i], self.buffers[i]
            try:
                ptrs, pads, pad_bytes = list(h.buffer_ptrs), int(h.signal_pad_ptrs_dev), int(h.signal_pad_size)
                rank, world = int(h.rank), int(h.world_size)
            except (AttributeError, TypeError):
                self._peers[i] = None
            else:
                off = buf.data_ptr() - int(ptrs[rank])
                addrs = torch.tensor([int(p) + off for p in ptrs], dtype=torch.int64, device=buf.device)
                self._peers[i] = Peers(addrs, pads, rank, world, pad_bytes // (4 * world))
        return self._peers[i]

    def buffer(self, k: int) -> torch.Tensor:
        """The input buffer of the program's k-th all_reduce."""
        return self.buffers[k % len(self.buffers)]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._op(x, "sum", self.group, out)


def one_shot(device: torch.device, rows: int, width: int, count: int) -> OneShot | None:
    """The one-shot all_reduce where it runs (a GPU, a NCCL process group, symmetric memory),
    else None (torch.distributed's all_reduce serves)."""
    import torch.distributed as dist

    if device.type != "cuda" or os.environ.get("EDGELLM_ALL_REDUCE", "one_shot") == "nccl":
        return None
    if dist.get_backend() != "nccl":
        return None
    try:
        return OneShot(device, rows, width, count)
    except (ImportError, RuntimeError, AttributeError):
        return None
