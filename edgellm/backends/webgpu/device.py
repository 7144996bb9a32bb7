"""WebGPU adapters and devices through wgpu-py (wgpu-native).

Importing this module does not import wgpu; every function that needs it imports it lazily and
turns its absence (or the absence of any adapter) into a BackendUnavailableError, so that the
rest of edgellm runs without the package.

A software adapter (Mesa's lavapipe, `adapter_type` "CPU") runs every kernel correctly but more
slowly than the cpu backend's torch kernels on the same cores, so `auto` never picks it: it is
for tests, and for `--backend webgpu` when asked for by name.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import BackendUnavailableError, EdgeLLMError
from .codegen import H2_NATIVE, H2_PORTABLE

# features the kernels use when the adapter has them (each kernel has a fallback without)
WANTED_FEATURES = ("shader-f16", "subgroup", "timestamp-query", "timestamp-query-inside-passes")
# limits raised from WebGPU's defaults to the adapter's own (the defaults allow 128 MiB bindings,
# 8 storage buffers per stage and 16 KiB of workgroup memory)
RAISED_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
                 "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup",
                 "max-compute-workgroup-size-x", "max-compute-workgroups-per-dimension")


def import_wgpu():
    # Mesa's software Vulkan warns on stderr when XDG_RUNTIME_DIR is unset (it wants it for window
    # surfaces, which compute never uses)
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        import wgpu  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(f"the webgpu backend needs the wgpu package (pip install 'edgellm[webgpu]'): "
                                      f"{e}") from None
    try:
        from wgpu.backends.wgpu_native._ffi import ffi
    except ImportError:  # another wgpu backend: nothing to speed up
        return wgpu
    fast_struct_types(ffi)
    return wgpu


_TYPE_DECL = re.compile(r"\s*([A-Za-z_]\w*)\s*(\*|\[\s*\])?\s*$")


def fast_struct_types(ffi) -> bool:
    """Resolve the C types wgpu-py asks cffi for by name ("WGPUBufferDescriptor *",
    "WGPUBindGroupEntry[]", "uint8_t []": a typedef of wgpu.h or a C primitive, or a pointer to or
    array of one) from cffi's parsed declarations, instead of cffi's parser: that parses each new
    type string as a C source that first re-declares all of the header's ~430 typedefs, 12-22 ms
    a string on the 2-core machine (2026-11-30), and a webgpu load asks for 40-50 of them, in
    every process. The cffi type object made is the one the parser's result maps to (through
    cffi's own cache of backend types); any other string (the callbacks' function types), or a
    cffi without these internals, goes to cffi's parser as before. Returns whether installed."""
    try:
        from cffi import model

        decls, slow = ffi._parser._declarations, ffi._typeof_locked
        parsed, cached = ffi._parsed_types, ffi._get_cached_btype
    except (ImportError, AttributeError):
        return False
    if getattr(slow, "_edgellm_fast", False):
        return True

    def typeof_locked(cdecl):  # cffi calls it with ffi._lock held
        hit = parsed.get(cdecl)
        if hit is not None:
            return hit
        m = _TYPE_DECL.match(cdecl) if isinstance(cdecl, str) else None
        td = decls.get("typedef " + m.group(1)) if m else None
        if td is None and m and m.group(1) in model.PrimitiveType.ALL_PRIMITIVE_TYPES:
            td = model.PrimitiveType(m.group(1)), 0
        if td is None or isinstance(td[0], model.RawFunctionType):
            return slow(cdecl)
        tp, quals = td
        kind = m.group(2)
        tp = tp if kind is None else model.PointerType(tp, quals) if kind == "*" else model.ArrayType(tp, None)
        result = parsed[cdecl] = (cached(tp), False)
        return result

    typeof_locked._edgellm_fast = True
    ffi._typeof_locked = typeof_locked
    return True


@dataclass
class AdapterInfo:
    """What `edgellm info` shows of one adapter, and what the backend specialises kernels on."""

    name: str
    vendor: str
    backend: str  # Vulkan, Metal, D3D12, ...
    adapter_type: str  # DiscreteGPU, IntegratedGPU, CPU, ...
    driver: str
    features: tuple[str, ...]
    limits: dict = field(default_factory=dict)
    subgroup_min: int = 0
    subgroup_max: int = 0

    @property
    def software(self) -> bool:
        """A CPU implementation (lavapipe, SwiftShader, WARP): correct, slower than the cpu backend."""
        low = (self.name + " " + self.vendor).lower()
        return self.adapter_type.upper() == "CPU" or any(s in low for s in ("llvmpipe", "lavapipe", "swiftshader",
                                                                               "microsoft basic render"))

    def key(self) -> str:
        """A string naming the adapter and driver, for per-adapter caches (tuning)."""
        return f"{self.name}|{self.backend}|{self.driver}"

    def line(self) -> str:
        kind = "software (CPU)" if self.software else self.adapter_type
        return f"{self.name} [{self.backend}, {kind}; {self.driver}]"


def _info(adapter) -> AdapterInfo:
    i = adapter.info
    limits = dict(adapter.limits)
    # wgpu-py 0.32 spells the subgroup sizes 'stackgroup_*' in its info dict; accept both
    smin = i.get("subgroup_min_size", i.get("stackgroup_min_size", 0)) or 0
    smax = i.get("subgroup_max_size", i.get("stackgroup_max_size", 0)) or 0
    return AdapterInfo(name=i.get("device", "") or "unknown", vendor=i.get("vendor", ""),
                       backend=i.get("backend_type", ""), adapter_type=i.get("adapter_type", ""),
                       driver=i.get("description", ""), features=tuple(sorted(adapter.features)), limits=limits,
                       subgroup_min=int(smin), subgroup_max=int(smax))


def list_adapters() -> list[AdapterInfo]:
    """Every adapter wgpu finds (empty when wgpu is missing or no driver is installed)."""
    try:
        wgpu = import_wgpu()
        return [_info(a) for a in wgpu.gpu.enumerate_adapters_sync()]
    except BackendUnavailableError:
        return []
    except Exception:  # a broken driver: report no adapters rather than fail `edgellm info`
        return []


def _gpu_device_nodes_absent() -> bool:
    """On Linux a hardware adapter needs a GPU device node (/dev/dri/renderD*: Mesa and AMD/Intel
    drivers; /dev/nvidia*: NVIDIA's; /dev/dxg: WSL2). Without one only software adapters can
    exist, so `auto` need not load wgpu and enumerate them (about 0.9 s on a 2-core machine)."""
    if not sys.platform.startswith("linux"):
        return False
    dev = Path("/dev")
    return not (any(dev.glob("dri/renderD*")) or any(dev.glob("nvidia[0-9]*")) or (dev / "dxg").exists())


def hardware_adapter_available() -> bool:
    """For `auto`: a GPU adapter (not a software one) exists."""
    if _gpu_device_nodes_absent():
        return False
    return any(not a.software for a in list_adapters())


def describe_adapters(verbose: bool = False) -> list[str]:
    """Lines for `edgellm info`: one per adapter, with features and main limits when verbose."""
    try:
        import_wgpu()
    except BackendUnavailableError as e:
        return [f"webgpu: unavailable ({e})"]
    adapters = list_adapters()
    if not adapters:
        return ["webgpu: no adapter found (install a Vulkan driver, e.g. mesa-vulkan-drivers)"]
    lines = []
    for k, a in enumerate(adapters):
        lines.append(f"webgpu adapter {k}: {a.line()}")
        if verbose:
            used = [f for f in a.features if f in WANTED_FEATURES or f.startswith("subgroup") or "f16" in f]
            lines.append(f"  features used: {', '.join(used) or 'none'}")
            lines.append(f"  max storage binding {a.limits.get('max-storage-buffer-binding-size', 0) / 2**20:.0f} MiB, "
                         f"max buffer {a.limits.get('max-buffer-size', 0) / 2**20:.0f} MiB, workgroup memory "
                         f"{a.limits.get('max-compute-workgroup-storage-size', 0) // 1024} KiB, subgroup "
                         f"{a.subgroup_min}-{a.subgroup_max}")
            lines.append(f"  all features: {', '.join(a.features)}")
    return lines


class Device:
    """One wgpu device with the features and limits the kernels use.

    EDGELLM_WEBGPU_ADAPTER=N picks the N-th adapter of `edgellm info`; by default the
    high-performance one (a discrete GPU before an integrated one before software)."""

    def __init__(self):
        wgpu = import_wgpu()
        self.wgpu = wgpu
        want = os.environ.get("EDGELLM_WEBGPU_ADAPTER")
        try:
            if want is not None:
                adapters = wgpu.gpu.enumerate_adapters_sync()
                if not want.isdigit() or int(want) >= len(adapters):
                    raise BackendUnavailableError(f"EDGELLM_WEBGPU_ADAPTER={want}: there are {len(adapters)} adapters "
                                                  f"(0..{len(adapters) - 1}; see `edgellm info`)")
                adapter = adapters[int(want)]
            else:
                adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        except BackendUnavailableError:
            raise
        except Exception as e:
            adapter = None
            err = e
        else:
            err = None
        if adapter is None:
            raise BackendUnavailableError(f"the webgpu backend found no adapter ({err or 'none'}); install a Vulkan "
                                          "driver (mesa-vulkan-drivers for a software one) or use --backend cpu")
        self.adapter = adapter
        self.info = _info(adapter)
        self.features = frozenset(f for f in WANTED_FEATURES if f in adapter.features)
        limits = {k: self.info.limits[k] for k in RAISED_LIMITS if k in self.info.limits}
        self.device = adapter.request_device_sync(required_features=sorted(self.features), required_limits=limits)
        self.limits = dict(self.device.limits)
        self.queue = self.device.queue
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"]) & ~255
        self.max_buffer = int(self.limits["max-buffer-size"])
        self.max_workgroup_memory = int(self.limits["max-compute-workgroup-storage-size"])
        self.max_groups = int(self.limits["max-compute-workgroups-per-dimension"])
        self.max_storage_buffers = int(self.limits["max-storage-buffers-per-shader-stage"])
        # a step's uniform values sit this far apart where several steps' go in one buffer (the
        # dynamic offset of a program's step binding: Device.layout)
        self.step_stride = max(16, int(self.limits.get("min-uniform-buffer-offset-alignment", 256)))
        self.has_f16 = "shader-f16" in self.features
        self.has_subgroups = "subgroup" in self.features and self.info.subgroup_min >= 4
        self.has_timestamps = "timestamp-query" in self.features
        self._pipelines: dict[str, object] = {}
        self._layouts: dict[tuple, object] = {}
        self._reader = None  # submission_reader's, made at first use
        self.has_f16_unpack = self._compiles(  # else every kernel's h2 takes codegen.H2_PORTABLE (Device.pipeline)
            "@group(0) @binding(0) var<storage, read_write> O: array<f32>;\n"
            "@compute @workgroup_size(1) fn main() { O[0] = unpack2x16float(0x3c003c00u).x; }\n")
        self.subgroup_size = self._subgroup_size() if self.has_subgroups else 0

    def _compiles(self, source: str) -> bool:
        """Whether this device takes a WGSL source (a feature probe)."""
        try:
            self.device.create_shader_module(code=source)
        except Exception:  # noqa: BLE001 - its validation error: the feature is missing
            return False
        return True

    def _subgroup_size(self) -> int:
        """The subgroup size compute shaders run with, read from a one-thread-group probe kernel:
        adapters often report only the API's bounds (wgpu: 4..128), while the kernels that
        reduce across a subgroup need the real width (NVIDIA 32). 0 when it varies within the
        workgroup or cannot be read (kernels then reduce in workgroup memory)."""
        import numpy as np

        src = ("@group(0) @binding(0) var<storage, read_write> O: array<u32>;\n"
               "@compute @workgroup_size(128)\n"
               "fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) n: u32) { O[i] = n; }\n")
        try:
            buf = self.buffer(4 * 128)
            lay = self.layout(("storage",))
            pipe = self.pipeline(src, lay)
            bg = self.device.create_bind_group(layout=lay, entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0,
                                                                                                 "size": buf.size}}])
            enc = self.device.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(1)
            cp.end()
            self.queue.submit([enc.finish()])
            sizes = set(np.frombuffer(self.read(buf, 0, 4 * 128), np.uint32).tolist())
        except Exception:  # noqa: BLE001 - a driver without the builtin: no subgroup kernels
            return 0
        n = sizes.pop() if len(sizes) == 1 else 0
        return n if n >= 4 and n & (n - 1) == 0 else 0

    # -- buffers -----------------------------------------------------------------------------
    def buffer(self, nbytes: int, *, uniform: bool = False):
        """A zero-filled storage (or uniform) buffer that can be written and read back."""
        U = self.wgpu.BufferUsage
        usage = (U.UNIFORM if uniform else U.STORAGE) | U.COPY_DST | U.COPY_SRC
        return self.device.create_buffer(size=max(16, -(-int(nbytes) // 16) * 16), usage=usage)

    def upload(self, data) -> object:
        """A storage buffer holding these bytes (padded to a multiple of 16)."""
        import numpy as np

        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        pad = (-raw.size) % 16
        if pad or raw.size == 0:
            raw = np.concatenate([raw, np.zeros(pad or 16, np.uint8)])
        U = self.wgpu.BufferUsage
        return self.device.create_buffer_with_data(data=raw, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)

    def read(self, buf, offset: int = 0, size: int | None = None) -> memoryview:
        return self.queue.read_buffer(buf, offset, size)

    def write(self, buf, data, offset: int = 0) -> None:
        self.queue.write_buffer(buf, offset, data)

    def submission_reader(self) -> "SubmissionReader | QueueReader":
        """What submits command buffers and reads back a buffer one of them wrote, waiting for
        that submission alone (SubmissionReader, wgpu-native's calls), or, where wgpu-py's layout
        does not offer those calls (or EDGELLM_WEBGPU_RAW=0), through wgpu-py's map, which waits
        for all work submitted so far (QueueReader)."""
        if self._reader is None:
            self._reader = QueueReader(self)
            if os.environ.get("EDGELLM_WEBGPU_RAW", "1") != "0":
                try:
                    self._reader = SubmissionReader(self)
                except Exception:  # noqa: BLE001 - another wgpu-py layout: the public API works, slower
                    pass
        return self._reader

    # -- pipelines -----------------------------------------------------------------------------
    def layout(self, kinds: tuple[str, ...]):
        """The bind group layout of a kernel's bindings ('uniform', 'read' or 'storage', in binding order),
        one object per distinct tuple so bind groups are shared by every kernel variant over them.
        A uniform binding (the step's values) takes a dynamic offset (launch.dynamic_offsets: one
        per uniform binding at every set_bind_group): the decode loop puts many tokens' steps in
        one compute pass, each reading its own values from one buffer, with no copy between them."""
        lay = self._layouts.get(kinds)
        if lay is None:
            T = self.wgpu.BufferBindingType
            entries = [{"binding": i, "visibility": self.wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": {"uniform": T.uniform, "read": T.read_only_storage}.get(k, T.storage),
                                   **({"has_dynamic_offset": True} if k == "uniform" else {})}}
                       for i, k in enumerate(kinds)]
            lay = self._layouts[kinds] = self.device.create_bind_group_layout(entries=entries)
        return lay

    def pipeline(self, source: str, layout) -> object:
        """A compute pipeline for this WGSL source over a bind group layout, made once per source
        (every layer's kernels share their pipelines: the source bakes in shapes, not tensors).
        On an adapter without unpack2x16float the kernels' h2 helper is the portable one."""
        p = self._pipelines.get(source)
        if p is None:
            code = source if self.has_f16_unpack else source.replace(H2_NATIVE, H2_PORTABLE)
            m = self.device.create_shader_module(code=code)
            pl = self.device.create_pipeline_layout(bind_group_layouts=[layout])
            p = self.device.create_compute_pipeline(layout=pl, compute={"module": m, "entry_point": "main"})
            self._pipelines[source] = p
        return p

    def precompile(self, kernels: list, now: bool = False) -> None:
        """The pipelines of these kernels (objects with .source and .kinds), compiled side by side
        in threads (wgpu-native's calls release the GIL) instead of one after another as each is
        first used: a program's kernels when it is built, the candidates of a tuning before they
        are timed. On by default on a software adapter only (EDGELLM_WEBGPU_PRECOMPILE=1 / 0 decide
        for any): lavapipe compiles on the calling thread (the webgpu test suite, 2 cores: 66 ->
        34 s), while on the H200 through the NVIDIA Vulkan driver (2026-11-30, a 1B Q4_0 file,
        empty program cache) load and first token took 15.1 s so against 8.8 s one at a time, and
        with a filled cache 4.0-4.4 s against 4.0. A pipeline that fails here is left for its
        first use to meet (and report, or a tuning to skip). now: where threads are off, compiled
        one after another here all the same (a tuning's candidates, so that their timings then
        run back to back, the GPU's clock up, without a compile between them)."""
        todo = list({k.source: k for k in kernels if k.source not in self._pipelines}.values())
        want = os.environ.get("EDGELLM_WEBGPU_PRECOMPILE", "").strip()
        threads = len(todo) >= 2 and (want == "1" if want in ("0", "1") else self.info.software)
        if not (threads or now):
            return
        layouts = {k.kinds: self.layout(k.kinds) for k in todo}  # made here, shared by the threads

        def one(k) -> None:
            try:
                self.pipeline(k.source, layouts[k.kinds])
            except Exception:  # noqa: BLE001
                pass
        if not threads:
            for k in todo:
                one(k)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 4, 16)) as ex:
            list(ex.map(one, todo))

    def describe(self) -> str:
        sub = f"subgroups of {self.subgroup_size}" if self.subgroup_size else "subgroups of no fixed size"
        extras = [f for f, ok in (("f16", self.has_f16), (sub, self.has_subgroups), ("timestamps", self.has_timestamps),
                                  ("no unpack2x16float", not self.has_f16_unpack)) if ok]
        return f"{self.info.line()}; {', '.join(extras) or 'no optional features'}"


_DEVICE: Device | None = None


class QueueReader:
    """Submit command buffers and read back a buffer through wgpu-py's public calls: a read waits
    for all work submitted before it (Device.submission_reader's fallback)."""

    def __init__(self, dev: Device):
        self.dev = dev

    def submit(self, command_buffer) -> int:
        self.dev.queue.submit([command_buffer])
        return 0

    def read(self, buf, nbytes: int, index: int) -> bytes:
        buf.map_sync(self.dev.wgpu.MapMode.READ, 0, buf.size)
        try:
            return bytes(buf.read_mapped(0, nbytes, copy=True))
        finally:
            buf.unmap()


class SubmissionReader:
    """Submit command buffers and read back a buffer one of them wrote, waiting for that
    submission alone: wgpu-native's wgpuQueueSubmitForIndex, then the buffer mapped with a
    callback of our own and wgpuDevicePoll given that submission's index. wgpu-py's map waits in
    its poll thread with no index, which returns when all submitted work is done: the decode
    loop, reading one batch's token ids with the next batch queued behind it, waited for both
    that way (H200 through Vulkan, 2026-11-30: 1B Q4_0 1.02-1.05 ms a token against 0.91-0.94
    with no batch queued; this way 0.74-0.77). wgpu-py's private API: Device.submission_reader
    falls back to QueueReader where it differs."""

    def __init__(self, dev: Device):
        from wgpu.backends.wgpu_native._api import ffi, lib

        self.ffi, self.lib, self.dev = ffi, lib, dev
        self._done: list = []

        @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
        def mapped(status, _message, _u1, _u2):
            self._done.append(int(status))

        self._mapped = mapped  # kept alive with this object
        self._info = ffi.new("WGPUBufferMapCallbackInfo *")
        self._info.mode = lib.WGPUCallbackMode_AllowProcessEvents
        self._info.callback = mapped
        self._index = ffi.new("uint64_t *")
        self._submit, self._map, self._poll = lib.wgpuQueueSubmitForIndex, lib.wgpuBufferMapAsync, lib.wgpuDevicePoll
        self._range, self._unmap = lib.wgpuBufferGetConstMappedRange, lib.wgpuBufferUnmap

    def submit(self, command_buffer) -> int:
        """Submit; returns the submission's index (for read)."""
        arr = self.ffi.new("WGPUCommandBuffer[]", [command_buffer._internal])
        return int(self._submit(self.dev.queue._internal, 1, arr))

    def read(self, buf, nbytes: int, index: int) -> bytes:
        """The first nbytes of a mappable buffer once submission `index` has completed."""
        h = buf._internal
        self._done.clear()
        self._map(h, self.lib.WGPUMapMode_Read, 0, buf.size, self._info[0])
        self._index[0] = index
        for _ in range(1000):  # a poll that waits returns once the submission is done: one round, or a few
            if self._done:
                break
            self._poll(self.dev.device._internal, 1, self._index)
        if not self._done:
            raise EdgeLLMError("webgpu: a buffer read never completed (the device stopped answering)")
        if self._done[0] != self.lib.WGPUMapAsyncStatus_Success:
            raise EdgeLLMError(f"webgpu: mapping a buffer for reading failed (wgpu-native status {self._done[0]})")
        try:
            return bytes(self.ffi.buffer(self._range(h, 0, buf.size), nbytes))
        finally:
            self._unmap(h)


def get_device() -> Device:
    """The process's one device (wgpu devices are costly to create; programs share it)."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = Device()
    return _DEVICE
