"""Start-up images: a cuda model's recorded steps replayed without torch or Triton.

A warm `edgellm run` on the cuda backend spent most of its time before the first token on
importing torch (1.2-1.5 s on the H100 host) and on a load whose every result was already known
from the run before (the same kernels, the same CUDA graphs, the same weights in the same layouts).
An image keeps what those steps are, at the level of the CUDA driver: every kernel of every CUDA
graph a run replayed (its cubin, launch shape and argument bytes, the arguments that are device
addresses rewritten as (allocation, offset)), the sizes of the device allocations those addresses
fall in, and the contents of those allocations (weights in their kernel layouts, tables) except
the KV cache and the activation arenas, which every step writes before it reads. A later run of
the same model, engine, device and settings allocates the same sizes, uploads the contents, loads
the cubins, captures each step into a CUDA graph of its own through the driver (driver.py) and
runs the same prompt-and-decode loop as the torch backend: same kernels, same arguments, same
launch order, so the same tokens.

replay_record.py writes an image after a cuda run (the steps that run needed, and those of the
image it replaces); `edgellm run` loads it first and falls back to the full load where it has no
image, or where the request needs a step the image lacks (covers()). EDGELLM_REPLAY=0 turns both
off. This module imports neither torch nor Triton: that is its point.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import numpy as np

from ...default_model import default_model_path
from ...errors import EdgeLLMError
from ...gguf_file import open_gguf
from ...model import Model, _load_tokenizer
from ...models import config_from_gguf
from ...sampling import DEVICE_DRAW_FIELDS, DeviceDraw, SamplingParams, device_draw_rows, device_sampling_enabled
from . import driver

FORMAT = 1
ARTIFACT = "replay"  # the image: plan as meta, contents and cubins as arrays (cache.put_arrays)
KEYS_ARTIFACT = "replay-keys.json"  # the steps an image holds, read by the next recording
# settings that change nothing a step launches (the rest of EDGELLM_* is part of an image's key)
_NEUTRAL_ENV = {"EDGELLM_REPLAY", "EDGELLM_CACHE", "EDGELLM_CACHE_DIR", "EDGELLM_CACHE_MAX_BYTES",
                "EDGELLM_PREFETCH", "EDGELLM_EARLY_CONTEXT", "EDGELLM_COMPILE_THREADS", "EDGELLM_REPLAY_MAX_BYTES"}
DEFAULT_MAX_BYTES = 2 << 30  # images of larger models are not written (their load is bound by bytes)


class ReplayMiss(EdgeLLMError):
    """The image holds no step for this shape (the caller loads the model in full instead)."""


def enabled() -> bool:
    return os.environ.get("EDGELLM_REPLAY", "1") != "0"


def max_bytes() -> int:
    return int(os.environ.get("EDGELLM_REPLAY_MAX_BYTES", DEFAULT_MAX_BYTES))


def image_key(fingerprint: str, device: dict, ctx: int, prefill_chunk: int, fuse: bool) -> str:
    from ...cache import program_key

    knobs = {k: v for k, v in os.environ.items() if k.startswith("EDGELLM_") and k not in _NEUTRAL_ENV}
    return program_key(model=fingerprint, artifact=ARTIFACT, backend="cuda", ctx=ctx, prefill_chunk=prefill_chunk,
                       fuse=fuse, knobs=knobs, device={k: device[k] for k in ("name", "uuid", "driver", "cc")})


# -- the host-side rules of a step, as CudaProgram applies them ------------------------------------
def splits(meta: dict, seq_len: int) -> int:
    """CudaProgram._context_splits: the context bucket of a step whose cache holds seq_len tokens."""
    n = max(1, -(-int(seq_len) // meta["per"]))
    return min(n, meta["cap"]) if meta["cap"] is not None else n


def padded_rows(meta: dict, seq: int, start: int) -> int:
    """CudaProgram._padded: the rows a prefill step of seq tokens at start runs with."""
    pad = meta["pad"]
    if not pad or seq <= 1:
        return seq
    p = min(-(-seq // pad) * pad, meta["max_seq"])
    return p if start + p <= meta["ctx"] else seq


def draw_plan(params: SamplingParams, vocab: int) -> str:
    """The decode loop's choice plan (DeviceChooser.plan) as a key: 'null' for the argmax."""
    plan, _ = device_draw_rows([None if params.greedy else DeviceDraw(params, 0)], vocab)
    return json.dumps(list(plan) if plan is not None else None)


def step_key(padded: int, bucket: int) -> str:
    return f"{padded}:{bucket}"


def loop_key(bucket: int, plan: str) -> str:
    return f"{bucket}:{plan}"


def needed_keys(metas: dict, chunk: int, n_prompt: int, max_tokens: int, params: SamplingParams,
                vocab: int) -> set[tuple[str, str, str]]:
    """(program, 'step' or 'loop', key) of every step a generation of up to max_tokens after a
    prompt of n_prompt tokens runs, as Model.generate_tokens runs it."""
    keys: set[tuple[str, str, str]] = set()
    if max_tokens <= 0 or n_prompt <= 0:
        return keys
    d = metas["decode"]
    ctx = d["ctx"]
    if n_prompt == 1:
        keys.add(("decode", "step", step_key(1, splits(d, 1))))
    else:
        m = metas["last"]
        for i in range(0, n_prompt, chunk):
            p = padded_rows(m, min(chunk, n_prompt - i), i)
            keys.add(("last", "step", step_key(p, splits(m, i + p))))
    pos, steps = n_prompt, max_tokens - 1
    if params.chain_only and (params.greedy or device_sampling_enabled()):  # the device loop
        plan = draw_plan(params, vocab)
        for b in {splits(d, pos + 1 + i) for i in range(min(steps, ctx - pos))}:
            keys.add(("decode", "loop", loop_key(b, plan)))
    else:  # one decode step per token, drawn on the host
        for b in {splits(d, p + 1) for p in range(pos, min(pos + steps, ctx))}:
            keys.add(("decode", "step", step_key(1, b)))
    return keys


# -- the image on the device ---------------------------------------------------------------------
class ReplayImage:
    """An image's allocations made and filled, its kernels loaded; each step's CUDA graph is
    captured through the driver at its first use."""

    def __init__(self, meta: dict, arrays: dict, device: dict):
        self.meta, self.device = meta, device
        self.bases: list[int] = []
        self.one_time_s = 0.0
        self._exes: dict[tuple, int] = {}
        self.stream = driver.stream_create()
        try:
            image = arrays["image"]
            src = image.ctypes.data
            for size, runs in meta["segments"]:
                base = driver.mem_alloc(size)
                self.bases.append(base)
                for seg_off, img_off, n in runs:
                    driver.copy_htod(base + seg_off, src + img_off, n)
            self.functions = []
            for i, (name, shared) in enumerate(meta["modules"]):
                cubin = arrays[f"cubin.{i}"]
                self.functions.append(driver.load_function(cubin.ctypes.data, name, shared, device["smem_optin"]))
            self._host = np.zeros(1, dtype=np.int64)
        except Exception:
            self.close()
            raise

    def addr(self, ref) -> int:
        seg, off = ref
        return self.bases[seg] + off

    def graph(self, program: str, kind: str, key: str) -> int:
        """The executable graph of a recorded step, captured at its first use."""
        exe = self._exes.get((program, kind, key))
        if exe is None:
            launches = self.meta["programs"][program][kind + "s"].get(key)
            if launches is None:
                raise ReplayMiss(f"the start-up image holds no {kind} of '{program}' for {key}")
            t0 = time.perf_counter()
            exe = self._exes[(program, kind, key)] = self._capture(launches["launches"])
            self.one_time_s += time.perf_counter() - t0
        return exe

    def _capture(self, launches: list) -> int:
        s = self.stream
        driver.begin_capture(s)
        try:
            for entry in launches:
                if entry[0] == "memset":
                    _, ref, value, element, width = entry
                    if element == 1:
                        driver.memset_d8(self.addr(ref), value, width, s)
                    else:
                        driver.memset_d32(self.addr(ref), value, width, s)
                    continue
                fn, grid, block, shared, programmatic, args, relocs = entry
                values = [bytearray(bytes.fromhex(a)) for a in args]
                for i, seg, off in relocs:
                    values[i][:8] = (self.bases[seg] + off).to_bytes(8, "little")
                bufs = [(ctypes.c_ubyte * len(v)).from_buffer(v) for v in values]
                params = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
                driver.launch(self.functions[fn], grid, block, shared, s, params, bool(programmatic))
        finally:
            try:
                exe = driver.end_capture(s)
            except driver.DriverError:
                exe = None
        if exe is None:
            raise driver.DriverError("the replayed step could not be captured into a CUDA graph")
        return exe

    def write(self, ref, values: np.ndarray) -> None:
        driver.copy_htod(self.addr(ref), values.ctypes.data, values.nbytes, self.stream)

    def read(self, ref, out: np.ndarray) -> np.ndarray:
        driver.copy_dtoh(out.ctypes.data, self.addr(ref), out.nbytes, self.stream)
        driver.synchronize(self.stream)
        return out

    def close(self) -> None:
        for b in self.bases:
            try:
                driver.mem_free(b)
            except driver.DriverError:
                pass
        self.bases = []


class ReplayProgram:
    """One stage program ('last': prefill with the last row's logits; 'decode': one token, and the
    decode loop) replayed from an image: CudaProgram.run and loop_tokens without torch."""

    def __init__(self, image: ReplayImage, name: str):
        self.image, self.name = image, name
        p = image.meta["programs"][name]
        self.meta, self.io = p["meta"], p["io"]
        self.max_seq = self.meta["max_seq"]
        self.prefill_pad = self.meta["pad"]
        self.vocab = image.meta["vocab"]

    @property
    def one_time_s(self) -> float:  # graph captures, counted once (the image's, shared by its programs)
        return self.image.one_time_s if self.name == "decode" else 0.0

    def run(self, inputs: dict) -> dict:
        ids = np.asarray(inputs["tokens"], dtype=np.int32).reshape(-1)
        seq, start = len(ids), int(inputs["start_pos"])
        padded = padded_rows(self.meta, seq, start)
        key = step_key(padded, splits(self.meta, start + padded))
        exe = self.image.graph(self.name, "step", key)
        im = self.image
        tokens = np.zeros(padded, dtype=np.int32)
        tokens[:seq] = ids
        im.write(self.io["tokens"], tokens)
        im.write(self.io["last_index"], np.array([seq - 1], dtype=np.int64))
        im.write(self.io["start"], np.array([start], dtype=np.int32))
        im.write(self.io["seq_len"], np.array([start + padded], dtype=np.int32))
        driver.graph_launch(exe, im.stream)
        logits = self.meta_logits(key)
        return {"logits": im.read(logits, np.empty((1, self.vocab), dtype=np.float32))}

    def meta_logits(self, key: str):
        return self.image.meta["programs"][self.name]["steps"][key]["logits"]

    def draws_on_device(self, params) -> bool:
        return device_sampling_enabled()

    def loop_tokens(self, first_token: int, start: int, n: int, draw=None, stop=()):
        """CudaProgram.loop_tokens: each step's token chosen on the device feeds the next step in
        one graph launch and an 8-byte read."""
        im = self.image
        plan, values = device_draw_rows([draw], self.vocab)
        plan_s = json.dumps(list(plan) if plan is not None else None)
        io = self.io
        im.write(io["tokens"], np.array([first_token], dtype=np.int32))
        im.write(io["start"], np.array([start], dtype=np.int32))
        im.write(io["seq_len"], np.array([start + 1], dtype=np.int32))
        if plan is not None:
            for name, dtype in DEVICE_DRAW_FIELDS:
                im.write(io[f"draw.{name}"], np.array(values[name], dtype=dtype))
        out = np.zeros(1, dtype=np.int64)
        for i in range(n):
            exe = im.graph(self.name, "loop", loop_key(splits(self.meta, start + 1 + i), plan_s))
            driver.graph_launch(exe, im.stream)
            yield int(im.read(io["next"], out)[0])


class ReplayBackend:
    """What Model needs of a backend, from an image."""

    name = "cuda"

    def __init__(self, meta: dict, arrays: dict, device: dict):
        self.meta, self.device = meta, device
        self.image = ReplayImage(meta, arrays, device)
        self.programs = {name: ReplayProgram(self.image, name) for name in meta["programs"]}

    def describe(self) -> str:
        return f"cuda ({self.device['name']}, start-up image)"

    @staticmethod
    def to_numpy(x):
        return x

    def prepare(self, n_prompt: int, max_tokens: int, params: SamplingParams, chunk: int) -> bool:
        """Whether the image holds every step this request runs; those steps' graphs are captured
        now, so that a driver's refusal shows before any token (the caller then loads in full)."""
        metas = {n: p["meta"] for n, p in self.meta["programs"].items()}
        progs = self.meta["programs"]
        keys = needed_keys(metas, chunk, n_prompt, max_tokens, params, self.meta["vocab"])
        if not all(prog in progs and key in progs[prog][kind + "s"] for prog, kind, key in keys):
            return False
        try:
            for prog, kind, key in sorted(keys):
                self.image.graph(prog, kind, key)
        except driver.DriverError:
            return False
        return True

    def close(self) -> None:
        self.image.close()


def _read_image(pc, key: str):
    got = pc.get_arrays(key, ARTIFACT)
    if got is None:
        return None
    meta, arrays = got
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "image" not in arrays:
        return None
    return meta, arrays


def load_replay(path=None, ctx: int | None = None, *, prefill_chunk: int = 512, fuse: bool = True):
    """The model from its start-up image (a Model whose programs replay recorded steps), or None
    where there is none for this model, engine, device and settings, or no GPU: the caller then
    loads it in full (edgellm.load). Nothing here imports torch."""
    if not enabled():
        return None
    from ... import cache as cache_mod

    if not cache_mod.enabled() or os.environ.get("EDGELLM_CUDA_DEVICE", "cuda") not in ("cuda", "cuda:0"):
        return None
    t0 = time.perf_counter()
    try:
        if driver.device_count() < 1:
            return None
        device = driver.init_device(0)
    except driver.DriverError:
        return None
    path = str(path) if path is not None else str(default_model_path())
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    ctx = ctx if ctx is not None else min(cfg.context_length, 4096)
    pc = cache_mod.ProgramCache()
    fingerprint = cache_mod.file_fingerprint(path)
    t1 = time.perf_counter()
    got = _read_image(pc, image_key(fingerprint, device, ctx, prefill_chunk, fuse))
    if got is None:
        return None
    t2 = time.perf_counter()
    tok, tok_cached = _load_tokenizer(f, path, pc, fingerprint)
    t3 = time.perf_counter()
    try:
        backend = ReplayBackend(*got, device)
    except driver.DriverError:  # out of memory, or a kernel this driver cannot load: the full load then
        return None
    t4 = time.perf_counter()
    m = ReplayedModel(path=path, backend_name=backend, ctx=ctx, file=f, config=cfg, tokenizer=tok, fuse=fuse,
                      prefill_chunk=prefill_chunk, program_cache=pc, fingerprint=fingerprint,
                      load_phases={"open": t1 - t0, "image": t2 - t1, "tokenizer": t3 - t2, "weights": t4 - t3},
                      cache_hits=(["tokenizer"] if tok_cached else []) + ["start-up image"])
    m.load_s = time.perf_counter() - t0
    return m


class ReplayedModel(Model):
    """A Model whose backend and programs come from a start-up image: no graph compile, no weight
    packing, no kernel compile or graph capture through torch (all recorded)."""

    def __post_init__(self):
        self.backend = self.backend_name  # the ReplayBackend load_replay made
        self.backend_name = self.backend.name
        self.programs = self.backend.programs
        self.states = {}
        self.compiled = {}

    def warmup(self, *, full: bool = False) -> float:
        return 0.0
