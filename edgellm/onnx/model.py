"""OnnxModel: an imported network on a backend, called with numpy arrays.

    m = edgellm.load("resnet18.onnx")             # backend="cpu" (reference), "cuda" or "webgpu"
    out = m(image_batch)                           # positional, in the model's input order
    out = m({"input": image_batch})                # or by name
    out["logits"]                                  # a dict: output name -> numpy array
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import torch

from ..errors import BackendUnavailableError, EdgeLLMError
from .importer import ImportedModel, import_onnx
from .runtime import GraphRunner, InputError


class OnnxModel:
    def __init__(self, imported: ImportedModel, backend: str = "cpu", *, fuse: bool = True, dtype: str | None = None):
        self.imported = imported
        self.path = imported.path
        self.graph = imported.graph
        self.input_names = list(imported.inputs)
        self.output_names = list(imported.outputs)
        self.backend_name = backend
        t0 = time.perf_counter()
        if backend == "cpu":
            from ..backends.cpu import CPU_KERNELS

            if dtype not in (None, "f32", "float32"):
                raise EdgeLLMError(f"the cpu backend computes in float32, got dtype={dtype!r}")
            device, tdtype = torch.device("cpu"), torch.float32
            kernels, supported = CPU_KERNELS, set(CPU_KERNELS)
        elif backend == "cuda":
            from ..backends.cuda.vision import CUDA_ND_KERNELS, vision_device

            device = vision_device()
            tdtype = {None: torch.float16 if device.type == "cuda" else torch.float32, "f16": torch.float16,
                      "float16": torch.float16, "f32": torch.float32, "float32": torch.float32}.get(dtype)
            if tdtype is None:
                raise EdgeLLMError(f"dtype must be 'f16' or 'f32', got {dtype!r}")
            kernels, supported = CUDA_ND_KERNELS, set(CUDA_ND_KERNELS)
        elif backend == "webgpu":
            from ..backends.webgpu.vision import WebgpuNd

            storage = {None: "f32", "f32": "f32", "float32": "f32", "f16": "f16", "float16": "f16"}.get(dtype)
            if storage is None:
                raise EdgeLLMError(f"dtype must be 'f32' or 'f16' (storage; the kernels compute in float32), got {dtype!r}")
            tensor_ops = WebgpuNd(dtype=storage)  # BackendUnavailableError without wgpu or an adapter
            device, tdtype = torch.device("cpu"), torch.float32  # the delegated ops' host tensors
            kernels = tensor_ops.kernels()
            supported = set(kernels)
        else:
            raise BackendUnavailableError(f"backend '{backend}' cannot run ONNX models (cpu, cuda, webgpu)")
        self.device, self.dtype = device, tdtype
        self.tensor_ops = tensor_ops if backend == "webgpu" else None
        if backend == "webgpu":
            weights = {n: tensor_ops.weight(a) for n, a in imported.weights.items()}
        else:
            weights = {n: _weight(a, device, tdtype) for n, a in imported.weights.items()}
        # cuda: CUDA graphs per input sizes (EDGELLM_CUDA_GRAPHS=0 turns them off, as for language models)
        graphs = device.type == "cuda" and os.environ.get("EDGELLM_CUDA_GRAPHS", "1") != "0"
        self.runner = GraphRunner(self.graph, weights, kernels, supported, backend, device, tdtype, fuse=fuse,
                                  use_arena=device.type == "cpu" or backend == "webgpu", graphs=graphs,
                                  tensor_ops=self.tensor_ops)
        self.load_s = time.perf_counter() - t0

    def _arrays(self, args, kwargs) -> dict[str, np.ndarray]:
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            given = dict(args[0])
        else:
            if len(args) > len(self.input_names):
                raise InputError(f"{os.path.basename(self.path)}: {len(args)} inputs given, the model takes "
                                 f"{len(self.input_names)} ({', '.join(self.input_names)})")
            given = dict(zip(self.input_names, args))
            given.update(kwargs)
        extra = sorted(set(given) - set(self.input_names))
        missing = [n for n in self.input_names if n not in given]
        if extra or missing:
            raise InputError(f"{os.path.basename(self.path)}: inputs {self.input_names} expected; "
                             + (f"missing {missing}" if missing else "") + (f" unknown {extra}" if extra else ""))
        out = {}
        for n, v in given.items():
            a = np.asarray(v)
            if not np.issubdtype(a.dtype, np.floating):
                raise InputError(f"input '{n}': expected floating-point values, got dtype {a.dtype}")
            out[n] = a.astype(np.float32, copy=False)
        return out

    def __call__(self, *args, **kwargs) -> dict[str, np.ndarray]:
        arrays = self._arrays(args, kwargs)
        if self.runner.graphs:
            outs = self.run_device({n: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, self.dtype)
                                    for n, a in arrays.items()})
            return {n: o.float().cpu().numpy() for n, o in outs.items()}
        outs = self.runner.run(arrays)
        return dict(zip(self.output_names, outs))

    def run_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Device tensors in, device tensors out (no host copies; for timing and pipelines). The
        outputs of a CUDA-graph replay are the graph's own buffers: copy them to keep them.
        webgpu: host tensors in (written to the recording's input buffers), its output buffers out
        (vision.NdTensor; `.read(m.tensor_ops.dev)` reads one), valid until the next call."""
        missing = [n for n in self.input_names if n not in tensors]
        if missing:
            raise InputError(f"{os.path.basename(self.path)}: inputs {missing} not given")
        outs = self.runner.run_device({n: tensors[n].to(self.device, self.dtype).contiguous() for n in self.input_names})
        return dict(zip(self.output_names, outs))

    def compiled(self, **sizes: int):
        """The compiled graph (passes, segments, memory plans) for these symbol sizes."""
        return self.runner.compile(sizes)

    def describe(self) -> str:
        if self.backend_name == "webgpu":
            ops = self.tensor_ops
            store = "float16 storage, float32 maths" if ops.dtype == "f16" else "float32"
            d = f"webgpu ({ops.dev.info.line()}; WGSL kernels, {store}, {'tiled' if ops.tiled else 'untiled'} GEMM"
        else:
            d = f"{self.backend_name} ({self.device}, {str(self.dtype).replace('torch.', '')}"
        return d + self.delegation() + ")"

    def delegation(self) -> str:
        """'; N of M ops delegated to the cpu: kinds' for the sizes run last ('' when none are)."""
        if self.backend_name == "cpu" or not self.runner._bound:
            return ""
        b = list(self.runner._bound.values())[-1]
        names = set(b.delegated) | set(getattr(b.recording, "delegated", ()))  # webgpu: also what its kernels handed back
        if not names:
            return ""
        kinds = sorted({op.kind for op in b.ops if op.name in names})
        return f"; {len(names)} of {len(b.ops)} ops delegated to the cpu: {', '.join(kinds)}"


def _weight(a: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """float32 weights on the cpu are used in place (a memory-mapped initializer stays mapped: no
    kernel writes into a weight); elsewhere they are converted once at load."""
    if device.type == "cpu" and dtype == torch.float32 and a.dtype == np.float32 and a.flags.c_contiguous:
        with warnings.catch_warnings():  # read-only views (mmap, protobuf bytes) are never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device, dtype)


def load_onnx(path: str | os.PathLike, backend: str = "cpu", *, fuse: bool = True, dtype: str | None = None) -> OnnxModel:
    return OnnxModel(import_onnx(path), backend, fuse=fuse, dtype=dtype)
