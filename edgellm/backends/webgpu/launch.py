"""Run one kernel outside a program, on buffers made from host arrays: for the kernel tests, the
GEMV benchmark and the tuner. Timing uses timestamp queries where the adapter has them (the GPU's
own clock, no submit overhead), else the host clock around a waited submit."""

from __future__ import annotations

import os
import time

import numpy as np

from . import kernels
from .device import Device


# Chain.time: an idle gap longer than CLOCK_IDLE_S (gaps of 0.2-0.3 s between a probe's timings,
# pipelines compiled between them, let an H200's clock fall to 660-735 MHz and 345; 2026-11-30), and
CLOCK_IDLE_S = 0.15
CLOCK_WARMUP_S = 0.4  # this much sustained load before timing (Chain._clock_up)
MIN_PASS_S = 0.005  # Chain.time: a timed pass shorter than this is timed again, longer (not on software adapters)
MAX_REPEAT = 4096


class Launch:
    """A kernel bound once to buffers: `run(grid)` dispatches it; `time(grid)` times it.

    buffers: binding name -> buffer, or a list of such dicts (copies of the operands, e.g. weights
    larger together than the GPU's L2 cache): timing then cycles through them, as a model's layers do."""

    def __init__(self, dev: Device, kernel: kernels.Kernel, buffers: dict | list[dict]):
        self.dev, self.kernel = dev, kernel
        self.step_buf = dev.buffer(kernels.STEP_BYTES, uniform=True)
        layout = dev.layout(kernel.kinds)
        self.pipeline = dev.pipeline(kernel.source, layout)
        self.bind_groups = []
        for bufs in ([buffers] if isinstance(buffers, dict) else buffers):
            entries = []
            for i, b in enumerate(kernel.bindings):
                key = b.name[:-3] if b.name.endswith("_v4") else b.name
                buf = self.step_buf if key == "step" else bufs[key]
                size = kernels.STEP_BYTES if key == "step" else buf.size
                entries.append({"binding": i, "resource": {"buffer": buf, "offset": 0, "size": size}})
            self.bind_groups.append(dev.device.create_bind_group(layout=layout, entries=entries))
        self.bind_group = self.bind_groups[0]

    def set_step(self, seq: int = 1, start: int = 0, kv_len: int | None = None, split_len: int | None = None,
                 n_splits: int = 1) -> None:
        kv = start + seq if kv_len is None else kv_len
        self.dev.write(self.step_buf, np.array([seq, start, kv, split_len or (1 << 30), n_splits, 0, 0, 0], np.uint32))

    def run(self, grid: tuple[int, int, int]) -> None:
        Chain(self.dev, [(self, grid)]).run()

    def time(self, grid: tuple[int, int, int], repeat: int = 20) -> float:
        """Seconds per dispatch (Chain.time of this launch alone)."""
        return Chain(self.dev, [(self, grid)]).time(repeat)


class Chain:
    """Launches dispatched one after another, each on its own grid, the whole `repeat` times over
    in one compute pass: what a program runs for one op made of several dispatches (x quantized,
    then the GEMV reading it), timed together. Each repetition takes the next of every launch's
    bind groups (their copies of the operands), as a model's layers do."""

    def __init__(self, dev: Device, items: list[tuple[Launch, tuple[int, int, int]]]):
        self.dev, self.items = dev, items

    def _encode(self, cpass, repeat: int) -> None:
        for i in range(repeat):
            for L, grid in self.items:
                cpass.set_pipeline(L.pipeline)
                cpass.set_bind_group(0, L.bind_groups[i % len(L.bind_groups)], dynamic_offsets(L.kernel.kinds))
                cpass.dispatch_workgroups(*grid)

    def run(self) -> None:
        enc = self.dev.device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        self._encode(cpass, 1)
        cpass.end()
        self.dev.queue.submit([enc.finish()])

    def _wait(self) -> None:
        L = self.items[0][0]
        self.dev.read(L.step_buf, 0, 4)

    def _clock_up(self) -> None:
        """Dispatch these launches back to back for CLOCK_WARMUP_S where the GPU has idled longer
        than CLOCK_IDLE_S since the last timing: GPUs lower their clock when idle and raise it
        only under sustained load (an H200 through the NVIDIA Vulkan driver 580: 1,980 -> 345 MHz
        after about a second idle, back after 0.3-0.4 s of load; a read kernel ran at 1.8 TB/s
        instead of 4.4 there), so a timing after a pause on the host (weights generated,
        pipelines compiled) would measure the idle clock. Not on software adapters."""
        dev = self.dev
        if dev.info.software or time.perf_counter() - getattr(dev, "_timed_at", 0.0) < CLOCK_IDLE_S:
            return
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < CLOCK_WARMUP_S:
            enc = dev.device.create_command_encoder()
            cpass = enc.begin_compute_pass()
            self._encode(cpass, 16)
            cpass.end()
            dev.queue.submit([enc.finish()])
            self._wait()

    def time(self, repeat: int = 20) -> float:
        """Seconds per repetition (all the launches once), over `repeat` of them in one pass
        (after one warm-up, and after _clock_up where the GPU idled). On a GPU a pass shorter than
        MIN_PASS_S is followed by one of about that length (at most MAX_REPEAT repetitions) and
        the faster kept: a few dispatches of tens of microseconds each, with the host's work
        between timings (a tuner's or a probe's), leave the GPU idle most of the time, and its
        clock fell from 1,980 MHz to 660-735 and 345 within such a series of timings (H200
        through Vulkan, 2026-11-30: `nvidia-smi --query-gpu=clocks.sm` beside
        `benchmarks/webgpu_probe.py`), as it does after an idle gap."""
        dev = self.dev
        self.run()
        self._wait()
        self._clock_up()
        try:
            t = self._time(repeat)
            if not dev.info.software and 0 < t * repeat < MIN_PASS_S and repeat < MAX_REPEAT:
                t = min(t, self._time(min(MAX_REPEAT, max(repeat + 1, int(MIN_PASS_S / t)))))
            return t
        finally:
            dev._timed_at = time.perf_counter()

    def _time(self, repeat: int) -> float:
        dev = self.dev
        if dev.has_timestamps:
            wgpu = dev.wgpu
            qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
            res = dev.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            enc = dev.device.create_command_encoder()
            cpass = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                             "end_of_pass_write_index": 1})
            self._encode(cpass, repeat)
            cpass.end()
            enc.resolve_query_set(qs, 0, 2, res, 0)
            dev.queue.submit([enc.finish()])
            t = np.frombuffer(dev.read(res, 0, 16), np.uint64)
            ns = float(t[1] - t[0])  # wgpu-native reports timestamps in nanoseconds
            if ns > 0:
                return ns * 1e-9 / repeat
        t0 = time.perf_counter()
        enc = dev.device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        self._encode(cpass, repeat)
        cpass.end()
        dev.queue.submit([enc.finish()])
        self._wait()
        return (time.perf_counter() - t0) / repeat


def upload_f32(dev: Device, a: np.ndarray):
    return dev.upload(np.ascontiguousarray(a, dtype=np.float32))


def read_f32(dev: Device, buf, n: int) -> np.ndarray:
    return np.frombuffer(dev.read(buf, 0, 4 * n), np.float32).copy()


def raw_pass_functions():
    """wgpu-native's own compute-pass functions, called without wgpu-py's per-call wrappers: a
    decode token records a few hundred dispatches from Python, and the public methods cost 4-17 us
    per dispatch against about 3 us through its checked C calls (lavapipe machine, 300 dispatches),
    1.5 us through the bare ones taken here. Bare is safe for these three: wgpu-core records a
    pass's commands and validates them when the pass ends, which goes through wgpu-py's checked
    call and raises there. wgpu-py's private API, so anything unexpected falls back to the
    public calls (EDGELLM_WEBGPU_RAW=0 forces that). Returns (set_pipeline, set_bind_group,
    dispatch, NULL, ffi) or None."""
    if os.environ.get("EDGELLM_WEBGPU_RAW", "1") == "0":
        return None
    try:
        from .device import import_wgpu

        import_wgpu()
        from wgpu.backends.wgpu_native._api import ffi, lib

        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL, ffi)
    except Exception:  # noqa: BLE001 - another wgpu-py layout: the public API works the same
        return None


def dynamic_offsets(kinds: tuple[str, ...], offset: int = 0) -> tuple[int, ...]:
    """The dynamic offsets a set_bind_group of a kernel with these binding kinds takes: one per
    uniform binding (Device.layout), `offset` bytes into the step buffer (0: its first step)."""
    return (offset,) * kinds.count("uniform")


_C_OFFSETS: dict[tuple[int, ...], object] = {}  # dynamic offsets as C arrays, made once per distinct tuple


def _c_offsets(raw, offsets: tuple[int, ...]):
    if not offsets:
        return raw[3]
    a = _C_OFFSETS.get(offsets)
    if a is None:
        a = _C_OFFSETS[offsets] = raw[4].new("uint32_t[]", list(offsets))
    return a


def encode_dispatch(cpass, pipeline, bind_group, grid: tuple[int, int, int], raw=None,
                    offsets: tuple[int, ...] = ()) -> None:
    """One dispatch into a compute pass (through raw_pass_functions' calls when given); offsets:
    the bind group's dynamic offsets (dynamic_offsets)."""
    x, y, z = grid
    if raw is not None:
        sp, sb, dw = raw[:3]
        c = cpass._internal
        sp(c, pipeline._internal)
        sb(c, 0, bind_group._internal, len(offsets), _c_offsets(raw, offsets))
        dw(c, x, y, z)
        return
    cpass.set_pipeline(pipeline)
    cpass.set_bind_group(0, bind_group, offsets)
    cpass.dispatch_workgroups(x, y, z)


def replay_dispatches(cpass, flat: list, raw, offset: int = 0) -> None:
    """Dispatches given as (pipeline, bind group, x, y, z, dynamic offset count) of wgpu-native
    handles into a compute pass, through raw_pass_functions' calls (a decode step's replayed
    list), each uniform binding at `offset` bytes (the step's values in the step buffer)."""
    sp, sb, dw, null = raw[:4]
    c = cpass._internal
    one = _c_offsets(raw, (offset,))
    for p, b, x, y, z, n in flat:
        sp(c, p)
        sb(c, 0, b, n, one if n else null)
        dw(c, x, y, z)


def grid2(n: int, limit: int) -> tuple[int, int]:
    """n workgroups as (x, y) within the per-dimension limit (kernels flatten wid.x + wid.y * nwg.x)."""
    if n <= limit:
        return n, 1
    y = -(-n // limit)
    return -(-n // y), y
