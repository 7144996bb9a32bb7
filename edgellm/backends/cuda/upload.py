"""A model file's bytes to the GPU through page-locked memory, read on several threads.

`tensor.to("cuda")` of a weight that is a view of the memory-mapped file first touches every page
of it in this process (a page fault per 4 KiB even when the file is in the page cache) and then
copies it from pageable memory, which the driver stages through a small pinned buffer of its own:
on the H100 host an 8B Q4_0 file's 4.6 GB of weights took 0.9-1.3 s of a warm load that way
(docs/benchmarks.md, 2026-11-28). Here the bytes are read with pread() (the kernel copies from
its page cache; no mapping, the GIL released) into a few reusable page-locked slots, each slot's
chunk then copied to the device by DMA on a stream of its own, the slots worked by threads so
that reads and copies of different chunks overlap.

Used for weights that are one contiguous run of the file (every stored tensor; not a column slice
of one, which tensor parallelism cuts). EDGELLM_PINNED_UPLOAD=0 keeps the plain path.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK = 4 << 20  # bytes a slot carries (a 4096 x 4096 Q4_0 weight is 9.4 MB: three chunks at once)
SLOTS = 8  # page-locked slots (CHUNK each) and threads working them
MIN_BYTES = 1 << 20  # smaller tensors take the plain path (a pread and a DMA cost more than they save)


def enabled() -> bool:
    """On unless EDGELLM_PINNED_UPLOAD=0, where the platform has os.preadv (Linux, macOS, BSDs)."""
    return os.environ.get("EDGELLM_PINNED_UPLOAD", "1") != "0" and hasattr(os, "preadv")


class Uploader:
    """Copies runs of one file's bytes to one CUDA device. upload(offset, nbytes) -> uint8 tensor."""

    def __init__(self, path: str | os.PathLike, device: torch.device, chunk: int = CHUNK, slots: int = SLOTS):
        self.path, self.device, self.chunk = str(path), device, chunk
        self.fd = os.open(self.path, os.O_RDONLY)
        self._slots: queue.Queue = queue.Queue()
        self._n_slots = slots
        self._made = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="edgellm-upload")
        self.bytes = 0
        self.calls = 0

    def _slot(self):
        """A free slot (page-locked buffer, stream, event), made on first need, at most SLOTS of them."""
        try:
            return self._slots.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._made < self._n_slots:
                self._made += 1
                if self.device.type != "cuda":  # (a CPU device: the same reads, plain buffers; for tests)
                    buf = torch.empty(self.chunk, dtype=torch.uint8)
                    return buf, buf.numpy(), None, None
                buf = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
                return buf, buf.numpy(), torch.cuda.Stream(self.device), torch.cuda.Event()
        return self._slots.get()

    def _copy(self, dst: torch.Tensor, offset: int, start: int, n: int) -> None:
        buf, view, stream, event = self._slot()
        try:
            got = 0
            while got < n:  # pread may return less than asked
                k = os.preadv(self.fd, [memoryview(view)[got:n]], offset + start + got)
                if k <= 0:
                    raise OSError(f"{self.path}: the file ended at byte {offset + start + got} while reading a weight")
                got += k
            if stream is None:
                dst[start:start + n].copy_(buf[:n])
                return
            with torch.cuda.stream(stream):
                dst[start:start + n].copy_(buf[:n], non_blocking=True)
                event.record(stream)
            event.synchronize()  # the slot is free again once its DMA has read it (waits without the GIL)
        finally:
            self._slots.put((buf, view, stream, event))

    def upload(self, offset: int, nbytes: int) -> torch.Tensor:
        """The file's bytes [offset, offset + nbytes) as a uint8 tensor on the device, complete when
        this returns (every chunk's copy has finished)."""
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        jobs = [self._pool.submit(self._copy, dst, offset, s, min(self.chunk, nbytes - s))
                for s in range(0, nbytes, self.chunk)]
        for j in jobs:
            j.result()  # the first error, if any
        self.bytes += nbytes
        self.calls += 1
        return dst

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            os.close(self.fd)
        except OSError:
            pass
        while not self._slots.empty():  # the page-locked buffers go back to the allocator's cache
            self._slots.get_nowait()
