"""The CUDA driver API through ctypes: what a replayed start-up image needs (replay.py) and what
reading a captured CUDA graph back needs (replay_record.py), without torch or Triton.

Only the calls used are bound, each checked: a failing call raises DriverError naming the call
and the driver's own error name. Handles are plain ints.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_void_p

from ...errors import EdgeLLMError


class DriverError(EdgeLLMError):
    """A CUDA driver call failed."""


# enum values from cuda.h
NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_EMPTY = 0, 1, 2, 5
_STREAM_NON_BLOCKING = 1
_CAPTURE_THREAD_LOCAL = 1
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_DEP_PROGRAMMATIC = 1  # CUgraphDependencyType of an edge from a launch with programmatic serialization
_FUNC_SHARED_SIZE_BYTES = 1
_FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEV_MAX_SHARED_PER_BLOCK_OPTIN = 97
_DEV_CC_MAJOR, _DEV_CC_MINOR = 75, 76
_ERROR_INVALID_VALUE = 1


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", c_void_p), ("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint),
                ("kernelParams", POINTER(c_void_p)), ("extra", POINTER(c_void_p)),
                ("kern", c_void_p), ("ctx", c_void_p)]


class MemsetNodeParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", c_uint64), ("pitch", c_size_t), ("value", c_uint), ("elementSize", c_uint),
                ("width", c_size_t), ("height", c_size_t)]


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", c_ubyte), ("to_port", c_ubyte), ("type", c_ubyte), ("reserved", c_ubyte * 5)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", c_int), ("pad", c_ubyte * 4), ("value", c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", POINTER(LaunchAttribute)), ("numAttrs", c_uint)]


_lib = None


def lib():
    """libcuda, loaded once; DriverError where the machine has no NVIDIA driver."""
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DriverError(f"no CUDA driver (libcuda.so.1: {e})") from None
    return _lib


def check(name: str, *args) -> None:
    r = getattr(lib(), name)(*args)
    if r != 0:
        s = c_void_p()
        lib().cuGetErrorName(r, byref(s))
        what = ctypes.cast(s, ctypes.c_char_p).value.decode() if s.value else f"error {r}"
        raise DriverError(f"{name}: {what}")


def status(name: str, *args) -> int:
    """A call whose failure the caller handles (the driver's result code)."""
    return getattr(lib(), name)(*args)


# -- device and context --------------------------------------------------------------------------
def init_device(ordinal: int = 0) -> dict:
    """Initialise the driver, make device `ordinal`'s primary context current on this thread, and
    describe the device (the key of anything recorded on it)."""
    check("cuInit", 0)
    dev, ctx = c_int(0), c_void_p()
    check("cuDeviceGet", byref(dev), ordinal)
    check("cuDevicePrimaryCtxRetain", byref(ctx), dev)
    check("cuCtxSetCurrent", ctx)
    name = ctypes.create_string_buffer(256)
    check("cuDeviceGetName", name, 256, dev)
    uuid = (c_ubyte * 16)()
    check("cuDeviceGetUuid", uuid, dev)
    version, major, minor, optin = c_int(), c_int(), c_int(), c_int()
    check("cuDriverGetVersion", byref(version))
    check("cuDeviceGetAttribute", byref(major), _DEV_CC_MAJOR, dev)
    check("cuDeviceGetAttribute", byref(minor), _DEV_CC_MINOR, dev)
    check("cuDeviceGetAttribute", byref(optin), _DEV_MAX_SHARED_PER_BLOCK_OPTIN, dev)
    return {"name": name.value.decode(), "uuid": bytes(uuid).hex(), "driver": version.value,
            "cc": f"{major.value}.{minor.value}", "smem_optin": optin.value}


def device_count() -> int:
    n = c_int(0)
    check("cuInit", 0)
    check("cuDeviceGetCount", byref(n))
    return n.value


# -- memory --------------------------------------------------------------------------------------
def mem_alloc(nbytes: int) -> int:
    p = c_uint64()
    check("cuMemAlloc_v2", byref(p), c_size_t(nbytes))
    return p.value


def mem_free(ptr: int) -> None:
    check("cuMemFree_v2", c_uint64(ptr))


def host_alloc(nbytes: int) -> int:
    """Page-locked host memory (the device copies it without staging)."""
    p = c_void_p()
    check("cuMemHostAlloc", byref(p), c_size_t(nbytes), 0)
    return p.value


def address_range(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation holding ptr; None where ptr is not device memory."""
    base, size = c_uint64(), c_size_t()
    if status("cuMemGetAddressRange_v2", byref(base), byref(size), c_uint64(ptr)) != 0:
        return None
    return base.value, size.value


def copy_htod(dst: int, src: int, nbytes: int, stream: int | None = None) -> None:
    if stream is None:
        check("cuMemcpyHtoD_v2", c_uint64(dst), c_void_p(src), c_size_t(nbytes))
    else:
        check("cuMemcpyHtoDAsync_v2", c_uint64(dst), c_void_p(src), c_size_t(nbytes), c_void_p(stream))


def copy_dtoh(dst: int, src: int, nbytes: int, stream: int | None = None) -> None:
    if stream is None:
        check("cuMemcpyDtoH_v2", c_void_p(dst), c_uint64(src), c_size_t(nbytes))
    else:
        check("cuMemcpyDtoHAsync_v2", c_void_p(dst), c_uint64(src), c_size_t(nbytes), c_void_p(stream))


def memset_d8(dst: int, value: int, nbytes: int, stream: int) -> None:
    check("cuMemsetD8Async", c_uint64(dst), ctypes.c_ubyte(value), c_size_t(nbytes), c_void_p(stream))


def memset_d32(dst: int, value: int, count: int, stream: int) -> None:
    check("cuMemsetD32Async", c_uint64(dst), c_uint(value), c_size_t(count), c_void_p(stream))


# -- streams, modules, launches, graphs ----------------------------------------------------------
def stream_create() -> int:
    s = c_void_p()
    check("cuStreamCreate", byref(s), _STREAM_NON_BLOCKING)
    return s.value


def synchronize(stream: int) -> None:
    check("cuStreamSynchronize", c_void_p(stream))


def load_function(image: int, name: str, shared: int, smem_optin: int) -> int:
    """A kernel from a cubin image at host address `image`, with the dynamic shared memory it
    needs allowed as Triton's loader allows it (everything the device permits past 48 KiB)."""
    mod, fn = c_void_p(), c_void_p()
    check("cuModuleLoadData", byref(mod), c_void_p(image))
    check("cuModuleGetFunction", byref(fn), mod, name.encode())
    if shared > 49152 and smem_optin > 49152:
        static = c_int()
        check("cuFuncGetAttribute", byref(static), _FUNC_SHARED_SIZE_BYTES, fn)
        check("cuFuncSetAttribute", fn, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_optin - static.value)
    return fn.value


def launch(fn: int, grid, block, shared: int, stream: int, params, programmatic: bool) -> None:
    """cuLaunchKernelEx; `params` a ctypes array of pointers to the argument values."""
    attr = LaunchAttribute()
    cfg = LaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, c_void_p(stream), None, 0)
    if programmatic:
        attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        ctypes.cast(attr.value, POINTER(c_int))[0] = 1
        cfg.attrs, cfg.numAttrs = ctypes.pointer(attr), 1
    check("cuLaunchKernelEx", byref(cfg), c_void_p(fn), params, None)


def begin_capture(stream: int) -> None:
    check("cuStreamBeginCapture_v2", c_void_p(stream), _CAPTURE_THREAD_LOCAL)


def end_capture(stream: int) -> int:
    """The captured graph, instantiated: an executable graph handle."""
    g, exe = c_void_p(), c_void_p()
    check("cuStreamEndCapture", c_void_p(stream), byref(g))
    try:
        check("cuGraphInstantiateWithFlags", byref(exe), g, c_uint64(0))
    finally:
        status("cuGraphDestroy", g)
    return exe.value


def graph_launch(exe: int, stream: int) -> None:
    check("cuGraphLaunch", c_void_p(exe), c_void_p(stream))


# -- reading a captured graph --------------------------------------------------------------------
def graph_nodes(graph: int) -> list[int]:
    n = c_size_t(0)
    check("cuGraphGetNodes", c_void_p(graph), None, byref(n))
    arr = (c_void_p * n.value)()
    check("cuGraphGetNodes", c_void_p(graph), arr, byref(n))
    return [a or 0 for a in arr[:n.value]]


def graph_edges(graph: int) -> list[tuple[int, int, int]]:
    """(from node, to node, dependency type) of every edge; type 1 marks a programmatic edge
    (the later kernel was launched with programmatic stream serialization)."""
    n = c_size_t(0)
    try:
        check("cuGraphGetEdges_v2", c_void_p(graph), None, None, None, byref(n))
    except (DriverError, AttributeError):  # a driver before 12.3: no edge data
        check("cuGraphGetEdges", c_void_p(graph), None, None, byref(n))
        a, b = (c_void_p * n.value)(), (c_void_p * n.value)()
        check("cuGraphGetEdges", c_void_p(graph), a, b, byref(n))
        return [(a[i] or 0, b[i] or 0, 0) for i in range(n.value)]
    a, b, d = (c_void_p * n.value)(), (c_void_p * n.value)(), (EdgeData * n.value)()
    check("cuGraphGetEdges_v2", c_void_p(graph), a, b, d, byref(n))
    return [(a[i] or 0, b[i] or 0, int(d[i].type)) for i in range(n.value)]


def node_type(node: int) -> int:
    t = c_int()
    check("cuGraphNodeGetType", c_void_p(node), byref(t))
    return t.value


def kernel_node(node: int) -> dict:
    """A kernel node's function, launch shape and argument bytes (one bytes value per parameter)."""
    p = KernelNodeParams()
    check("cuGraphKernelNodeGetParams_v2", c_void_p(node), byref(p))
    if not p.kernelParams:
        raise DriverError("a kernel node passes its arguments as an 'extra' buffer, which replay does not read")
    args = []
    off, size = c_size_t(), c_size_t()
    i = 0
    while True:
        r = status("cuFuncGetParamInfo", c_void_p(p.func), c_size_t(i), byref(off), byref(size))
        if r == _ERROR_INVALID_VALUE:
            break
        if r != 0:
            raise DriverError(f"cuFuncGetParamInfo: error {r}")
        args.append(ctypes.string_at(p.kernelParams[i], size.value))
        i += 1
    return {"func": p.func or 0, "grid": (p.gridDimX, p.gridDimY, p.gridDimZ),
            "block": (p.blockDimX, p.blockDimY, p.blockDimZ), "shared": p.sharedMemBytes, "args": args}


def memset_node(node: int) -> dict:
    p = MemsetNodeParams()
    check("cuGraphMemsetNodeGetParams", c_void_p(node), byref(p))
    return {"dst": p.dst, "pitch": p.pitch, "value": p.value, "element": p.elementSize,
            "width": p.width, "height": p.height}


def func_name(fn: int) -> str:
    """A kernel's name (for messages)."""
    s = ctypes.c_char_p()
    if status("cuFuncGetName", byref(s), c_void_p(fn)) != 0 or not s.value:
        return f"function {fn:#x}"
    return s.value.decode(errors="replace")
