"""Engines the benchmark measures, behind one small interface.

An engine runs one GGUF file on one backend. The worker process calls, in order:
  Engine.available(backend) -> (ok, reason)   cheap, without loading anything
  engine.prepare(backend)                     imports its libraries (kept out of the load time)
  engine.load(model_path, backend, ctx)       the model ready to run (timed: TTLM)
  engine.prefill(ids)                         ids from an empty KV cache; returns when done
  engine.next_token() -> int                  greedy pick from the last prefill's final logits
  engine.decode(n)                            n single-token steps from an empty cache, each fed
                                              the greedy pick of the step before
  engine.logits(ids) -> [len(ids), vocab]     float logits of every position, from an empty cache
  engine.perplexity(tokens, n_ctx, bos_id)    llama.cpp's method over logits() (metrics.perplexity)
  engine.info() -> dict                       version, threads, KV-cache element size, ...
Every timed call returns only when the device has finished its work.

Engines are named here (ENGINES) or given as 'package.module:Class' for engines outside edgellm.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from typing import Sequence

import numpy as np

from ..errors import EdgeLLMError
from .metrics import PerplexityResult, perplexity


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


def _torch_cuda_ready() -> tuple[bool, str]:
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return False, f"no CUDA device visible to torch {torch.__version__}"
    return True, ""


class Engine:
    name = "engine"
    #: backends the engine knows how to target at all (others are reported unavailable)
    backends: tuple[str, ...] = ("cpu", "cuda")
    #: modules the child process imports before anything else (before edgellm, numpy and torch
    #: load their native libraries): runner.run_job passes them to the child's entry
    preload: tuple[str, ...] = ()

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self.backend: str | None = None

    @classmethod
    def available(cls, backend: str) -> tuple[bool, str]:
        if backend not in cls.backends:
            return False, f"{cls.name} has no '{backend}' backend (it has: {', '.join(cls.backends)})"
        return True, ""

    def prepare(self, backend: str) -> None:
        """Import what load() needs, so that import time does not count as load time."""

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        raise NotImplementedError

    def prefill(self, ids: Sequence[int]) -> None:
        raise NotImplementedError

    def next_token(self) -> int:
        raise NotImplementedError

    def decode(self, n: int) -> None:
        raise NotImplementedError

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        raise NotImplementedError

    def perplexity(self, tokens: Sequence[int], n_ctx: int, bos_id: int | None = None,
                   max_chunks: int | None = None) -> PerplexityResult:
        return perplexity(self.logits, tokens, n_ctx, bos_id=bos_id, max_chunks=max_chunks)

    def vocab_size(self) -> int:
        raise NotImplementedError

    def kv_bytes_per_element(self) -> float | None:
        """Bytes per element of the KV cache the engine keeps (for MBU); None when unknown."""
        return None

    def device_peak_bytes(self) -> int | None:
        """Peak device memory allocated, when the engine runs on a GPU through torch."""
        if self.backend == "cuda" and "torch" in sys.modules:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return int(torch.cuda.max_memory_allocated())
        return None

    def info(self) -> dict:
        return {"engine": self.name, "backend": self.backend, "threads": self.threads}

    def close(self) -> None:
        pass


# -- edgellm ---------------------------------------------------------------------------------------
class EdgeLLMEngine(Engine):
    """This project's engine, through its public API (edgellm.load / Model.forward)."""

    name = "edgellm"
    backends = ()  # any backend edgellm.backends knows

    @classmethod
    def available(cls, backend: str) -> tuple[bool, str]:
        from ..backends import get_backend

        try:
            backend_cls = get_backend(backend)
        except EdgeLLMError as e:
            return False, str(e)
        except ImportError as e:
            return False, f"backend '{backend}' cannot be imported: {e}"
        probe = getattr(backend_cls, "available", None)
        if callable(probe):
            try:
                ok = probe()
            except Exception as e:  # a probe that fails says why
                return False, f"backend '{backend}': {e}"
            if isinstance(ok, tuple):
                return bool(ok[0]), str(ok[1]) if len(ok) > 1 else ""
            if not ok:
                reason = ""
                if backend == "cuda":
                    reason = _torch_cuda_ready()[1]
                return False, f"backend '{backend}' is not available on this machine" + (f": {reason}" if reason else "")
        return True, ""

    def prepare(self, backend: str) -> None:
        import edgellm  # noqa: F401
        from ..backends import get_backend

        get_backend(backend)  # imports torch and the backend's kernels
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        import edgellm

        self.backend = backend
        self.model = edgellm.load(model_path, backend=backend, ctx=ctx)
        self._last: np.ndarray | None = None
        self._start = self._start_token()

    def _start_token(self) -> int:
        tok = self.model.tokenizer
        if tok is not None and tok.bos_id is not None:
            return int(tok.bos_id)
        return min(1, self.model.config.vocab_size - 1)

    def prefill(self, ids: Sequence[int]) -> None:
        self._last = self.model.forward(ids, 0, all_logits=False)  # host numpy: the device is done

    def next_token(self) -> int:
        return int(np.argmax(self._last[-1]))

    def decode(self, n: int) -> None:
        """n greedy steps from an empty context. Where the backend loops on the device (cuda:
        argmax inside the decode step's CUDA graph, the path generate_tokens takes at temperature
        0) only the token ids come back; otherwise logits come to the host, as for llama.cpp."""
        loop = getattr(self.model.programs["decode"], "loop_tokens", None)
        if loop is not None and n <= self.model.ctx:
            for _ in loop(self._start, 0, n):
                pass
            return
        tok = self._start
        for i in range(n):
            tok = int(np.argmax(self.model.forward([tok], i, all_logits=False)[-1]))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.model.forward(ids, 0, all_logits=True)

    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def kv_bytes_per_element(self) -> float | None:
        sizes = [t.element_size() for t in getattr(self.model, "states", {}).values() if hasattr(t, "element_size")]
        return float(sizes[0]) if sizes else None

    def info(self) -> dict:
        d = super().info()
        from .. import __version__

        d["version"] = _version("edgellm") or __version__
        d["describe"] = self.model.backend.describe() if hasattr(self.model, "backend") else None
        if "torch" in sys.modules:
            import torch

            d["threads"] = torch.get_num_threads()
            d["torch"] = torch.__version__
        return d


# -- llama.cpp -------------------------------------------------------------------------------------
class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python (`llama_cpp`), with its default f16 KV cache: loaded by
    Llama(), timed through the C API (llama_decode; argmax over its logits in place)."""

    name = "llama.cpp"
    # imported first in the child process: imported after numpy + torch (or after edgellm), a CUDA
    # build of llama-cpp-python 0.3.36 segfaulted loading a model on the H100 machine; imported
    # first, it ran (benchmarks/gpu_session.sh llama_check, 2026-11-22)
    preload = ("llama_cpp",)

    @classmethod
    def available(cls, backend: str) -> tuple[bool, str]:
        ok, reason = super().available(backend)
        if not ok:
            return ok, reason
        if importlib.util.find_spec("llama_cpp") is None:
            return False, "llama-cpp-python is not installed (pip install llama-cpp-python)"
        if backend == "cuda":
            try:
                import llama_cpp
            except Exception as e:
                return False, f"llama_cpp does not import: {e}"
            if not llama_cpp.llama_supports_gpu_offload():
                return False, "this llama-cpp-python build has no GPU offload (rebuild with CMAKE_ARGS=-DGGML_CUDA=on)"
        return True, ""

    def prepare(self, backend: str) -> None:
        import llama_cpp  # noqa: F401

    @staticmethod
    def extra_bufts(backend: str) -> tuple[bool, str]:
        """Whether llama.cpp may repack CPU weights into its extra buffer types (AMX, AVX/NEON
        interleaved blocks). On the 2-core Sapphire Rapids VMs of our CI, the AMX path segfaults
        inside ggml_backend_amx_mul_mat on SmolLM2 (hidden size 576) although the kernel grants AMX
        state, so they are off where the CPU advertises AMX. EDGELLM_LLAMACPP_EXTRA_BUFTS=0/1 forces it."""
        want = os.environ.get("EDGELLM_LLAMACPP_EXTRA_BUFTS", "auto")
        if want in ("0", "1"):
            return want == "1", "EDGELLM_LLAMACPP_EXTRA_BUFTS"
        if _cpu_has_amx():  # also with GPU offload: the weights llama.cpp keeps on the CPU use them
            return False, "off: llama.cpp's AMX path crashes on this CPU (see LlamaCppEngine.extra_bufts)"
        return True, "llama.cpp default"

    @staticmethod
    def flash_attention(backend: str) -> tuple[bool, str]:
        """Whether the context uses flash attention. llama.cpp's own tools default to 'auto' (on
        where the backend has it: CUDA), llama-cpp-python's Llama() to off, which cost llama.cpp
        ~0.3 ms per decode token on the 1B shape on the H100 (1.28 vs llama-bench -fa 1's 1.0 ms).
        On for cuda, off on the CPU (as the perplexity agreement was measured);
        EDGELLM_LLAMACPP_FLASH_ATTN=0/1 forces it."""
        want = os.environ.get("EDGELLM_LLAMACPP_FLASH_ATTN", "auto")
        if want in ("0", "1"):
            return want == "1", "EDGELLM_LLAMACPP_FLASH_ATTN"
        return (True, "llama.cpp's default on CUDA") if backend == "cuda" else (False, "Llama()'s default")

    def _open(self, logits_all: bool):
        import llama_cpp
        import llama_cpp.llama as high_level

        threads = self.threads or _threads()
        extra, _ = self.extra_bufts(self.backend)
        defaults = llama_cpp.llama_model_default_params

        def model_params():  # Llama() exposes no argument for this field of llama_model_params
            p = defaults()
            if hasattr(p, "use_extra_bufts"):
                p.use_extra_bufts = extra
            return p

        high_level.llama_cpp.llama_model_default_params = model_params
        try:
            return llama_cpp.Llama(model_path=self.path, n_ctx=self.ctx, n_batch=self.ctx,
                                   n_ubatch=min(self.ctx, 512), n_gpu_layers=-1 if self.backend == "cuda" else 0,
                                   n_threads=threads, n_threads_batch=threads, logits_all=logits_all, seed=0,
                                   flash_attn=self.flash_attention(self.backend)[0], verbose=False)
        finally:
            high_level.llama_cpp.llama_model_default_params = defaults

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        import llama_cpp

        self.path, self.backend, self.ctx = str(model_path), backend, ctx
        self.llm = self._open(logits_all=False)
        self._all = None  # a second context that keeps every position's logits (perplexity only)
        # prefill and decode go through the C API, as llama.cpp's own tools do (llama_decode on a
        # batch), and the next token is the argmax over the logits llama_decode left on the host,
        # read in place. Measured per token on the H100 host (1B shape, vocabulary 128,256):
        # llama.cpp's greedy sampler (llama_sampler_sample) fills a 128,256-entry candidate array
        # and cost ~0.6 ms more than Llama.eval + a numpy argmax of a copy; in place, no copy.
        self._one = (llama_cpp.llama_token * 1)()
        self._n_vocab = int(self.llm.n_vocab())
        self.tokens_out: list[int] = []  # the last decode()'s tokens (tests compare them)

    def _clear(self) -> None:
        import llama_cpp

        self.llm.reset()  # the high-level object's n_tokens = 0
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)

    def _decode(self, buf, n: int) -> None:
        import llama_cpp

        rc = llama_cpp.llama_decode(self.llm.ctx, llama_cpp.llama_batch_get_one(buf, n))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on a batch of {n} tokens")

    def prefill(self, ids: Sequence[int]) -> None:
        import llama_cpp

        self._clear()
        self._decode((llama_cpp.llama_token * len(ids))(*ids), len(ids))
        llama_cpp.llama_synchronize(self.llm.ctx)

    def next_token(self) -> int:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # synchronises
        return int(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).argmax())

    def decode(self, n: int) -> None:
        tok = int(self.llm.token_bos()) if self.llm.token_bos() >= 0 else 1
        self._clear()
        out = []
        for _ in range(n):
            self._one[0] = tok
            self._decode(self._one, 1)
            tok = self.next_token()
            out.append(tok)
        self.tokens_out = out

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        if self._all is None:
            self._all = self._open(logits_all=True)
        self._all.reset()  # n_tokens = 0: eval() drops the cache beyond it
        self._all.eval(list(ids))
        return np.array(self._all.scores[: len(ids)], dtype=np.float32)

    def vocab_size(self) -> int:
        return int(self.llm.n_vocab())

    def kv_bytes_per_element(self) -> float | None:
        return 2.0  # llama.cpp's default KV cache type is f16

    def info(self) -> dict:
        d = super().info()
        d["version"] = _version("llama_cpp_python") or getattr(sys.modules.get("llama_cpp"), "__version__", None)
        d["threads"] = self.threads or _threads()
        on, why = self.extra_bufts(self.backend)
        d["extra_buffer_types"] = "on" if on else why
        on, why = self.flash_attention(self.backend)
        d["flash_attention"] = f"{'on' if on else 'off'} ({why})"
        return d


# -- transformers ----------------------------------------------------------------------------------
class TransformersEngine(Engine):
    """Hugging Face transformers reading the GGUF (dequantized: float32 on the CPU, float16 on CUDA)."""

    name = "transformers"

    @classmethod
    def available(cls, backend: str) -> tuple[bool, str]:
        ok, reason = super().available(backend)
        if not ok:
            return ok, reason
        for mod, pkg in (("transformers", "transformers"), ("torch", "torch"), ("gguf", "gguf")):
            if importlib.util.find_spec(mod) is None:
                return False, f"{pkg} is not installed"
        if backend == "cuda":
            return _torch_cuda_ready()
        return True, ""

    def prepare(self, backend: str) -> None:
        import torch
        import transformers  # noqa: F401

        if self.threads:
            torch.set_num_threads(self.threads)

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.backend = backend
        self.torch = torch
        self.device = torch.device("cuda" if backend == "cuda" else "cpu")
        self.dtype = torch.float16 if backend == "cuda" else torch.float32
        path = os.path.abspath(model_path)
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self._last = None
        bos = getattr(self.model.config, "bos_token_id", None)
        self._start = int(bos) if isinstance(bos, int) else 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _ids(self, ids) -> "object":
        return self.torch.tensor([list(ids)], dtype=self.torch.long, device=self.device)

    def prefill(self, ids: Sequence[int]) -> None:
        with self.torch.inference_mode():
            out = self.model(input_ids=self._ids(ids), use_cache=True, logits_to_keep=1)
        self._last = out.logits[0, -1]
        self._sync()

    def next_token(self) -> int:
        return int(self.torch.argmax(self._last).item())

    def decode(self, n: int) -> None:
        from transformers import DynamicCache

        cache = DynamicCache()
        tok = self._start
        with self.torch.inference_mode():
            for _ in range(n):
                out = self.model(input_ids=self._ids([tok]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                tok = int(self.torch.argmax(out.logits[0, -1]).item())  # .item() synchronises

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        with self.torch.inference_mode():
            out = self.model(input_ids=self._ids(ids), use_cache=False)
        return out.logits[0].float().cpu().numpy()

    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def kv_bytes_per_element(self) -> float | None:
        return 2.0 if self.dtype == self.torch.float16 else 4.0

    def info(self) -> dict:
        d = super().info()
        d["version"] = _version("transformers")
        d["threads"] = self.torch.get_num_threads()
        d["dtype"] = str(self.dtype).replace("torch.", "")
        return d


ENGINES: dict[str, type[Engine]] = {
    "edgellm": EdgeLLMEngine,
    "llama.cpp": LlamaCppEngine,
    "transformers": TransformersEngine,
}
ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama-cpp": "llama.cpp", "hf": "transformers"}


def engine_class(name: str) -> type[Engine]:
    """The engine called `name` (see ENGINES), or a class given as 'package.module:Class'."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in ENGINES:
        return ENGINES[key]
    if ":" in name:
        module, _, attr = name.strip().partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise EdgeLLMError(f"engine '{name}' cannot be imported: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Engine)):
            raise EdgeLLMError(f"engine '{name}' is not a subclass of edgellm.bench.engines.Engine")
        return cls
    raise EdgeLLMError(f"unknown engine '{name}' (known: {', '.join(ENGINES)}, or package.module:Class)")


def engine_label(name: str) -> str:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in ENGINES:
        return key
    cls = engine_class(name)
    return getattr(cls, "name", name)
