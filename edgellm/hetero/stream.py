"""Matrix products on a GPU from weights that live in host memory, streamed over the link.

A layer the GPU's memory budget cannot hold can still use the GPU: its weights stay in pinned host
memory in the cuda kernels' layout and are copied, product by product, into a few device slots
just before they are multiplied. The copies run on their own stream, ahead of use: while the GPU
multiplies one product (or the CPU works on its share of the rows, or on the layer's attention),
the next products' weights are on the way. What bounds such a product is the link (PCIe: about 54
GB/s each way on the H100 machine, 2026-11-27, `benchmarks/host_probe.py`), not the GPU.

Used by the split executor's row splits 'rows cpu SHARE | cuda:N' (executor.py): the layer runs on
the CPU (cpu-fast: attention, norms, its KV cache), the CPU multiplies SHARE of each product's rows
from its own packs while the GPU multiplies the rest from streamed weights, at the same time; a
prefill chunk (more than STREAM_ALL_TOKENS tokens) streams every row, since there the GPU's
arithmetic is worth the whole link and the CPU's is not.

Scheduling: a product's rows are streamed in pieces of at most SLOT_BYTES (the GPU memory it
takes is N_SLOTS such slots, whatever the model). The pieces of a step are met in the same order
every step of a kind (decode, or a prefill chunk), so the first step of a kind records that order
and later steps prefetch along it, wrapping into the next step. Piece use number c takes slot
c % n_slots; the copy for use c + j (j < n_slots) is queued as soon as use c + j - n_slots has
finished reading that slot (an event on the compute stream). Every use checks that its slot holds
what it needs for that use number, and copies it (in order) when a prediction was wrong (a step of
another kind, a different product), so a wrong guess costs time, never a wrong result.

On a machine without a GPU the same code runs with the device 'cpu' (the cuda kernels in Triton's
interpreter, copies done at once): the tests check the scheduling that way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import EdgeLLMError

# a product with more tokens than this streams all its rows (prefill); fewer: the decode share
STREAM_ALL_TOKENS = 8
# a product is streamed in pieces of rows of at most SLOT_BYTES each, through N_SLOTS slots: the
# GPU memory streaming takes is N_SLOTS x SLOT_BYTES (or less for smaller products), whatever the
# model; while one piece is multiplied, the next N_SLOTS - 1 are on their way
# (EDGELLM_STREAM_SLOTS and EDGELLM_STREAM_PIECE_MB change them, for experiments: smaller pieces
# wait less behind each other on the link's copy engine)
N_SLOTS = int(os.environ.get("EDGELLM_STREAM_SLOTS", "3"))
SLOT_BYTES = int(float(os.environ.get("EDGELLM_STREAM_PIECE_MB", "40")) * (1 << 20))
_ALIGN = 256


@dataclass
class _Piece:
    """Rows [a, b) of a stacked weight, in the cuda layout, that fit one slot."""
    fmt: str
    shape: tuple[int, int]
    source_fmt: str
    parts: dict  # tensor name -> (pinned host tensor [rows, ...] view, byte offset in a slot)
    nbytes: int


class StreamedProducts:
    """The GPU side of row splits whose weights stay in host memory (see the module docstring)."""

    def __init__(self, file, device: torch.device):
        from ..backends.cuda.backend import CudaWeights, _kernels

        self.device = device
        self.gpu = device.type == "cuda"
        self.K = _kernels()
        self._host = CudaWeights(file, torch.device("cpu"))  # packs built on the host, in the kernels' layout
        self._full: dict[tuple, object] = {}  # names -> host PackedWeight of all rows (pinned)
        self._shares: dict[tuple, _Piece] = {}  # (names, rows) of a piece -> the piece
        self._pieces: dict[tuple, list[tuple]] = {}  # a prepared row range -> its pieces' keys
        self.slot_limit = SLOT_BYTES  # read here: tests set the module's value first
        self.n_slots = max(2, N_SLOTS)
        self._slots: list[torch.Tensor] = []
        self._slot_bytes = 0  # the slots' size now
        self._need = 0  # the largest piece prepared
        self._holds: list[tuple | None] = [None] * self.n_slots  # (call number, share key) per slot
        self._loaded: list = [None] * self.n_slots  # copy-stream events
        self._freed: list = [None] * self.n_slots  # compute-stream events: the slot's last reader is done
        self._views: dict[tuple, object] = {}  # (share key, slot) -> device PackedWeight
        self.copy_stream = torch.cuda.Stream(device) if self.gpu else None
        self._calls = 0
        self._kind: str | None = None
        self._pos = 0
        self._orders: dict[str, list[tuple]] = {}
        self._recording: list[tuple] | None = None
        self._stage: dict[str, torch.Tensor] = {}  # staging buffers (_staging)
        self._mapped_x = os.environ.get("EDGELLM_STREAM_X", "mapped") != "copy"
        self.bytes_copied = 0

    # -- load time ---------------------------------------------------------------------------------
    def prepare(self, names: tuple[str, ...], rows: tuple[int, int]) -> tuple:
        """Keep rows [a, b) of the stacked weight `names` for streaming, in pieces that fit a slot;
        returns the key that start() takes."""
        key = (names, (int(rows[0]), int(rows[1])))
        if key in self._pieces:
            return key
        a, b = key[1]
        w = self._full_weight(names)
        if not 0 <= a < b <= w.shape[0]:
            raise EdgeLLMError(f"streamed rows {a}..{b} of {list(names)}: the weight has {w.shape[0]} rows")
        per_row = sum(t[0].numel() * t.element_size() for t in w.tensors.values())
        step = max(1, self.slot_limit // max(per_row, 1))
        if step < b - a and step >= 64:
            step = step // 32 * 32  # whole 32-row groups: the kernels' tiles stay aligned
        self._pieces[key] = [self._piece(names, (i, min(b, i + step))) for i in range(a, b, step)]
        return key

    def _full_weight(self, names):
        full = self._full.get(names)
        if full is None:
            w = self._host.packed(*names)
            self._host._packed.clear()  # the pinned copy below is the only one kept
            moved = {k: (v.pin_memory() if self.gpu else v.contiguous()) for k, v in w.tensors.items()}
            full = self._full[names] = self.K.PackedWeight(w.fmt, w.shape, source_fmt=w.source_fmt,
                                                          layout=w.layout, **moved)
        return full

    def _piece(self, names, rows) -> tuple:
        key = (names, rows)
        if key in self._shares:
            return key
        full = self._full_weight(names)
        a, b = rows
        parts, off = {}, 0
        for k, t in full.tensors.items():
            part = t[a:b]
            parts[k] = (part, off)
            off += -(-part.numel() * part.element_size() // _ALIGN) * _ALIGN
        self._shares[key] = _Piece(full.fmt, (b - a, full.shape[1]), full.source_fmt, parts, off)
        self._need = max(self._need, off)
        return key

    def slot_bytes_needed(self) -> int:
        return self._need

    def _ensure_slots(self) -> None:
        """Slots as large as the largest piece prepared (made at the first product, remade if a
        larger piece was prepared since)."""
        nbytes = self._need
        if nbytes <= self._slot_bytes:
            return
        self._slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.n_slots)]
        self._slot_bytes = nbytes
        self._views.clear()
        self._holds = [None] * self.n_slots
        self._loaded = [None] * self.n_slots
        self._freed = [None] * self.n_slots

    # -- run time ----------------------------------------------------------------------------------
    def begin_step(self, kind: str) -> None:
        """A step of the split program starts: 'decode' or 'prefill' (the order of its products)."""
        if self._recording is not None and self._kind is not None and self._kind not in self._orders:
            self._orders[self._kind] = self._recording
        self._kind, self._pos = kind, 0
        self._recording = [] if kind not in self._orders else None

    def _view(self, key: tuple, slot: int):
        v = self._views.get((key, slot))
        if v is None:
            s = self._shares[key]
            buf = self._slots[slot]
            ts = {}
            for k, (part, off) in s.parts.items():
                n = part.numel() * part.element_size()
                ts[k] = buf[off:off + n].view(part.dtype).view(part.shape)
            v = self._views[(key, slot)] = self.K.PackedWeight(s.fmt, s.shape, source_fmt=s.source_fmt, **ts)
        return v

    def _load(self, call: int, key: tuple) -> None:
        """Queue the copy of share `key` into the slot of call number `call`."""
        slot = call % self.n_slots
        if self._holds[slot] == (call, key):
            return
        s = self._shares[key]
        view = self._view(key, slot)
        if self.gpu:
            with torch.cuda.stream(self.copy_stream):
                if self._freed[slot] is not None:
                    self.copy_stream.wait_event(self._freed[slot])
                for k, (part, _) in s.parts.items():
                    view.tensors[k].copy_(part, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
            self._loaded[slot] = ev
        else:
            for k, (part, _) in s.parts.items():
                view.tensors[k].copy_(part)
        self._holds[slot] = (call, key)
        self.bytes_copied += s.nbytes

    def _prefetch(self, call: int) -> None:
        order = self._orders.get(self._kind) if self._kind else None
        if not order:
            return
        for j in range(1, self.n_slots):  # past the step's end: the next step of the same kind
            self._load(call + j, order[(self._pos + j) % len(order)])

    def start(self, key: tuple, x: torch.Tensor):
        """Begin x @ W[a:b].T on the GPU (x: float32 [m, k] on the host); returns a handle whose
        result() is the float32 [m, b - a] host tensor. The copies, the products and the copy back
        are queued without waiting, so the caller can work meanwhile."""
        pieces = self._pieces.get(key)
        if pieces is None:
            raise EdgeLLMError(f"streamed product {key[0]} rows {key[1]} was not prepared")
        self._ensure_slots()
        m, k = x.shape
        n = key[1][1] - key[1][0]
        if self.gpu:
            cur = torch.cuda.current_stream(self.device)
            xd = self._staging("x_dev", m * k, torch.float16, self.device).view(m, k)
            self._upload(x, xd)
            hy = self._staging("y", m * n, torch.float16)
        else:
            xd = x.to(torch.float16)
            hy = torch.empty(m * n, dtype=torch.float16)
        # each piece's fp16 product is copied to the host as it comes (contiguous, so the copy is
        # asynchronous; result() lays the pieces side by side): the GPU holds one piece's output
        # at a time, not the whole result
        off, spans = 0, []
        for pk in pieces:
            slot = self._next_call(pk)
            w = self._view(pk, slot)
            if self.gpu:
                cur.wait_event(self._loaded[slot])
            part = self.K.linear(xd, w)
            if self.gpu:
                freed = torch.cuda.Event()
                freed.record(cur)
                self._freed[slot] = freed
            pn = part.shape[1]
            hy[off:off + m * pn].view(m, pn).copy_(part, non_blocking=True)
            spans.append((off, pn))
            off += m * pn
        if not self.gpu:
            return _Done(_side_by_side(hy, spans, m, n))
        done = torch.cuda.Event()
        done.record(cur)
        return _Pending(done, hy, spans, m, n)

    def _next_call(self, pk: tuple) -> int:
        """Number this piece's use, make sure its slot holds it, queue the next ones; its slot."""
        call = self._calls
        self._calls += 1
        if self._recording is not None:
            self._recording.append(pk)
        self._load(call, pk)  # a no-op when the prefetch got it right
        self._prefetch(call)
        self._pos += 1
        return call % self.n_slots

    def _upload(self, x: torch.Tensor, xd: torch.Tensor) -> None:
        """x (float32, host) to the device in fp16, on the compute stream. A decode step's x (a few
        rows) is read by a kernel from pinned memory over the link itself: a copy would go to the
        link's copy engine and wait there behind the weight pieces already queued for the next
        products (about a millisecond at 54 GB/s). A prefill chunk's x (megabytes) is rounded to
        fp16 here and copied (half the bytes). Where the kernel cannot read host memory, or with
        EDGELLM_STREAM_X=copy, the copy is used for both."""
        m, k = x.shape
        if self._mapped_x and m <= STREAM_ALL_TOKENS:
            h32 = self._staging("x32", m * k, torch.float32).view(m, k)
            h32.copy_(x)
            try:
                self.K.upload_fp16(h32, xd)
                return
            except (ValueError, RuntimeError):
                self._mapped_x = False
        h16 = self._staging("x16", m * k, torch.float16).view(m, k)
        h16.copy_(x)
        xd.copy_(h16, non_blocking=True)

    def _staging(self, name: str, n: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """The first n elements of a staging buffer, grown to the largest call: pinned on the host,
        or on `device`. A call's result() is taken before the next call starts, so one serves all."""
        buf = self._stage.get(name)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._stage[name] = buf = buf if device is not None else buf.pin_memory()
        return buf[:n]


class _Done:
    def __init__(self, y):
        self._y = y

    def result(self) -> torch.Tensor:
        return self._y


def _side_by_side(flat: torch.Tensor, spans: list, m: int, n: int) -> torch.Tensor:
    """The float32 [m, n] result from the pieces' fp16 outputs stored one after another."""
    y = torch.empty(m, n, dtype=torch.float32)
    col = 0
    for off, pn in spans:
        y[:, col:col + pn].copy_(flat[off:off + m * pn].view(m, pn))
        col += pn
    return y


class _Pending:
    def __init__(self, event, host_y, spans, m, n):
        self._event, self._y, self._spans, self._m, self._n = event, host_y, spans, m, n

    def result(self) -> torch.Tensor:
        self._event.synchronize()
        return _side_by_side(self._y, self._spans, self._m, self._n)


def share_rows(n: int, cpu_share: float) -> int:
    """The first row the GPU multiplies when the CPU takes `cpu_share` of n rows (whole 32-row
    groups where it can, so both sides keep aligned tiles)."""
    cut = int(round(n * cpu_share))
    if 0 < cut < n and n >= 64:
        cut = max(32, min(n - 32, (cut + 16) // 32 * 32))
    return max(0, min(n, cut))


__all__ = ["StreamedProducts", "STREAM_ALL_TOKENS", "share_rows"]
