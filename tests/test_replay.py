"""Start-up images (edgellm/backends/cuda/replay.py, replay_record.py) without a GPU: the host-side
rules a replay recomputes against the cuda programs' own (on Triton's interpreter), the steps a
generation needs against the steps Model.generate_tokens runs, and a recorded graph's work
replayed through a simulated driver (addresses rewritten into new allocations, contents restored
outside the caches). tests/test_cuda_replay.py replays real models on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import edgellm  # noqa: E402
from edgellm.backends.cuda import driver  # noqa: E402
from edgellm.backends.cuda import replay as R  # noqa: E402
from edgellm.backends.cuda import replay_record as RR  # noqa: E402
from edgellm.sampling import DeviceDraw, SamplingParams  # noqa: E402
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

SPEC = SyntheticSpec(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                     weight_type="F16", std=0.1, seed=41)
CTX = 24


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")


def test_replay_path_imports_neither_torch_nor_triton():
    code = ("import sys, edgellm.cli, edgellm.onnx.cli, edgellm.model, edgellm.backends.cuda.replay, "
            "edgellm.backends.cuda.early, edgellm.sampling, edgellm.progress; "
            "bad = [m for m in ('torch', 'triton', 'sympy') if m in sys.modules]; assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.skipif(CUDA, reason="checks the machine without a GPU")
def test_no_image_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_synthetic_gguf(tmp_path / "m.gguf", SPEC)
    assert R.load_replay(path, ctx=CTX) is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
])
def test_a_recorded_choice_plan_is_captured_with_the_same_plan(params):
    from edgellm.backends.cuda.backend import DeviceChooser
    from edgellm.backends.cuda import kernels as K

    plan = R.draw_plan(params, 64)
    draw = RR._draw_for(plan, 64)
    chooser = DeviceChooser(K, [draw], torch.device("cpu"), 64)
    want = DeviceChooser(K, [None if params.greedy else DeviceDraw(params, 3)], torch.device("cpu"), 64)
    assert chooser.plan == want.plan
    assert json.dumps(list(want.plan) if want.plan is not None else None) == plan


def _trace(model):
    """Wrap the model's programs: the (program, kind, key) of every step a request runs, from the
    programs' own rules (CudaProgram._padded and _context_splits, DeviceChooser.plan)."""
    from edgellm.backends.cuda.backend import DeviceChooser

    seen = set()
    for name, prog in model.programs.items():
        ctx = max(t.shape[0] for t in prog.states.values())

        def run(inputs, prog=prog, name=name):
            seq, start = len(inputs["tokens"]), int(inputs["start_pos"])
            padded = prog._padded(seq, start, ctx)
            seen.add((name, "step", f"{padded}:{prog._context_splits(start + padded)}"))
            return type(prog).run(prog, inputs)

        def loop(first, start, n, draw=None, stop=(), prog=prog, name=name, traced_run=run):
            vocab = prog._buffer("logits", 1, ctx).shape[-1]
            plan = DeviceChooser(prog.K, [draw], prog.dev, vocab).plan
            plan = json.dumps(list(plan) if plan is not None else None)
            seen.update((name, "loop", f"{prog._context_splits(start + 1 + i)}:{plan}") for i in range(n))
            del prog.run  # the loop's own first step (the torch backend's, which a replay skips) untraced
            try:
                yield from type(prog).loop_tokens(prog, first, start, n, draw, stop)
            finally:
                prog.run = traced_run
        prog.run = run
        prog.loop_tokens = loop
    return seen


def test_needed_steps_are_the_steps_a_generation_runs(tmp_path, monkeypatch):
    """needed_keys (what an image must hold for a request) against the steps Model.generate_tokens
    runs through the cuda programs, for prompts of one token, one chunk and several chunks, the
    device loop (argmax and drawn) and the host loop (a penalty), with context buckets of 8 keys and
    prefill padding of 4 rows (the interpreter's programs pad nothing by themselves); splits and
    padded_rows against the programs' own rules at every length."""
    from edgellm.backends.cuda.kernels import configs

    from edgellm.backends.cuda import kernels as K

    monkeypatch.setattr(configs, "ATTN_DECODE_KEYS_PER_SPLIT", 8)
    monkeypatch.setattr(K, "default_decode_splits", lambda *a, **k: 3)  # the device's split cap (SMs)
    path = write_synthetic_gguf(tmp_path / "m.gguf", SPEC)
    m = edgellm.load(path, backend="cuda", ctx=CTX, prefill_chunk=8, cache=False)
    for prog in m.programs.values():
        if prog.max_seq > 1:
            prog.prefill_pad = 4
    # the split caps are found at a program's first short step (a recording runs after its request)
    m.forward([1], 0, all_logits=False)
    m.forward([1, 2], 0, all_logits=False)
    metas = {n: m.programs[n].replay_meta() for n in ("last", "decode")}
    for name, meta in metas.items():
        prog = m.programs[name]
        assert meta["vocab"] == SPEC.vocab_size
        assert [R.splits(meta, n) for n in range(1, CTX + 1)] == [prog._context_splits(n) for n in range(1, CTX + 1)]
        assert len({R.splits(meta, n) for n in range(1, CTX + 1)}) == 3  # the test crosses buckets
        for start in range(CTX):
            for seq in range(1, min(prog.max_seq, CTX - start) + 1):
                assert R.padded_rows(meta, seq, start) == prog._padded(seq, start, CTX), (name, seq, start)
    m.tokenizer = None  # no end-of-generation token: every request runs to max_tokens or the context
    rng = np.random.default_rng(5)
    cases = [(1, 6, SamplingParams(temperature=0.0)), (5, 12, SamplingParams(temperature=0.0)),
             (13, 9, SamplingParams(temperature=0.8, seed=1)), (3, 30, SamplingParams(temperature=0.7, top_k=0, top_p=0.9)),
             (6, 5, SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=2)), (4, 1, SamplingParams(temperature=0.0))]
    for n_prompt, max_tokens, params in cases:
        m.default_slot.reset()
        seen = _trace(m)
        ids = rng.integers(0, SPEC.vocab_size, n_prompt).tolist()
        list(m.generate_tokens(ids, max_tokens, params))
        for prog in m.programs.values():  # unwrapped for the next case
            prog.__dict__.pop("run", None)
            prog.__dict__.pop("loop_tokens", None)
        want = R.needed_keys(metas, m.kv_chunk, n_prompt, max_tokens, params, SPEC.vocab_size)
        assert want == seen, (n_prompt, max_tokens, params, sorted(want ^ seen))


# -- a recorded graph replayed through a simulated driver ----------------------------------------
class FakeDevice:
    """Device memory as host byte arrays; the driver calls record and replay use, simulated."""

    def __init__(self):
        self.mem: dict[int, bytearray] = {}
        self.next = 0x7F0000000000
        self.launches = []
        self.capturing = False

    def alloc(self, n):
        base = self.next
        self.next += -(-n // 4096) * 4096 + 4096
        self.mem[base] = bytearray(n)
        return base

    def at(self, ptr):
        for base, buf in self.mem.items():
            if base <= ptr < base + len(buf):
                return base, buf
        raise AssertionError(f"{ptr:#x} is not simulated device memory")

    def install(self, monkeypatch):
        d = self
        monkeypatch.setattr(driver, "address_range",
                            lambda p: next(((b, len(m)) for b, m in d.mem.items() if b <= p < b + len(m)), None))

        def dtoh(dst, src, n, stream=None):
            base, buf = d.at(src)
            import ctypes
            ctypes.memmove(dst, bytes(buf[src - base:src - base + n]), n)

        def htod(dst, src, n, stream=None):
            import ctypes
            base, buf = d.at(dst)
            buf[dst - base:dst - base + n] = ctypes.string_at(src, n)
        monkeypatch.setattr(driver, "copy_dtoh", dtoh)
        monkeypatch.setattr(driver, "copy_htod", htod)
        monkeypatch.setattr(driver, "mem_alloc", d.alloc)
        monkeypatch.setattr(driver, "mem_free", lambda p: d.mem.pop(p))
        monkeypatch.setattr(driver, "stream_create", lambda: 7)
        monkeypatch.setattr(driver, "load_function", lambda image, name, shared, optin: ("fn", name, shared))
        monkeypatch.setattr(driver, "begin_capture", lambda s: d.launches.append("begin"))
        monkeypatch.setattr(driver, "end_capture", lambda s: len(d.launches))

        def launch(fn, grid, block, shared, stream, params, programmatic):
            import ctypes
            sizes = d.arg_sizes[fn[1]]
            args = [ctypes.string_at(params[i], n) for i, n in enumerate(sizes)]
            d.launches.append((fn[1], tuple(grid), tuple(block), shared, programmatic, args))
        monkeypatch.setattr(driver, "launch", launch)
        monkeypatch.setattr(driver, "memset_d8", lambda p, v, n, s: d.launches.append(("memset8", p, v, n)))
        monkeypatch.setattr(driver, "memset_d32", lambda p, v, n, s: d.launches.append(("memset32", p, v, n)))


def test_a_recorded_graph_replays_with_its_addresses_moved(tmp_path, monkeypatch):
    rng = np.random.default_rng(9)
    dev = FakeDevice()
    dev.install(monkeypatch)
    weights, kv, misc = dev.alloc(5000), dev.alloc(3000), dev.alloc(700)
    for base in (weights, kv, misc):
        dev.mem[base][:] = rng.integers(0, 256, len(dev.mem[base]), dtype=np.uint8).tobytes()
    # two kernels and a memset; the second kernel launched with programmatic serialization
    p64 = lambda v: int(v).to_bytes(8, "little")  # noqa: E731
    kernels = {
        11: {"func": 11, "grid": (3, 1, 1), "block": (128, 1, 1), "shared": 0,
             "args": [p64(weights + 256), p64(kv), (77).to_bytes(4, "little"), p64(0), p64(123456789)]},
        12: {"func": 12, "grid": (1, 2, 1), "block": (64, 1, 1), "shared": 60000,
             "args": [p64(misc + 8), (5).to_bytes(4, "little"), p64(kv + 2048)]},
    }
    memset = {"dst": misc + 16, "pitch": 0, "value": 0, "element": 4, "width": 4, "height": 1}
    nodes = [101, 102, 103]  # listed out of dependency order: 103 (memset) -> 101 -> 102
    monkeypatch.setattr(driver, "graph_nodes", lambda g: nodes)
    monkeypatch.setattr(driver, "graph_edges", lambda g: [(103, 101, 0), (101, 102, driver._DEP_PROGRAMMATIC)])
    monkeypatch.setattr(driver, "node_type", lambda n: driver.NODE_MEMSET if n == 103 else driver.NODE_KERNEL)
    monkeypatch.setattr(driver, "kernel_node", lambda n: kernels[{101: 11, 102: 12}[n]])
    monkeypatch.setattr(driver, "memset_node", lambda n: memset)
    for fn, name in ((11, "k_a"), (12, "k_b")):
        (tmp_path / f"{name}.cubin").write_bytes(name.encode() * 10)
        monkeypatch.setitem(RR._loaded, fn, (name, str(tmp_path / f"{name}.cubin")))
    segs, mods = RR._Segments(), RR._Modules()
    launches = RR.extract(0, segs, mods)
    assert [e[0] for e in launches] == ["memset", 0, 1]
    with pytest.raises(RR.Unrecordable):  # a pointer into nothing
        segs.ref(0x1000)
    # the KV allocation and the tail of `misc` are scratch: not saved
    segments, image = segs.snapshot([(kv, 3000), (misc + 600, 4096)])
    assert image.nbytes == 5000 + 600
    meta = {"format": R.FORMAT, "vocab": 64, "segments": segments, "modules": mods.entries,
            "programs": {"decode": {"meta": {}, "io": {}, "steps": {"1:1": {"launches": launches}}, "loops": {}}}}
    arrays = {"image": image, **{f"cubin.{i}": np.frombuffer(c, np.uint8) for i, c in enumerate(mods.cubins)}}
    assert mods.entries == [["k_b", 60000], ["k_a", 0]] or mods.entries == [["k_a", 0], ["k_b", 60000]]
    old = dict(dev.mem)
    dev.arg_sizes = {"k_a": [8, 8, 4, 8, 8], "k_b": [8, 4, 8]}
    im = R.ReplayImage(json.loads(json.dumps(meta)), arrays, {"smem_optin": 232448})
    moved = dict(zip([b for b, _ in segs.spans], im.bases))
    assert set(moved) == {weights, kv, misc} and not set(im.bases) & set(old)
    assert bytes(dev.mem[moved[weights]]) == bytes(old[weights])  # contents restored
    assert bytes(dev.mem[moved[misc]][:600]) == bytes(old[misc][:600])
    im.graph("decode", "step", "1:1")
    got = dev.launches[1:]
    assert got[0] == ("memset32", moved[misc] + 16, 0, 4)
    name, grid, block, shared, programmatic, args = got[1]
    assert (name, grid, block, shared, programmatic) == ("k_a", (3, 1, 1), (128, 1, 1), 0, False)
    assert args == [p64(moved[weights] + 256), p64(moved[kv]), (77).to_bytes(4, "little"), p64(0), p64(123456789)]
    name, grid, block, shared, programmatic, args = got[2]
    assert (name, shared, programmatic) == ("k_b", 60000, True)
    assert args == [p64(moved[misc] + 8), (5).to_bytes(4, "little"), p64(moved[kv] + 2048)]
    with pytest.raises(R.ReplayMiss):
        im.graph("decode", "step", "64:1")


def test_a_step_replay_cannot_reproduce_makes_no_image(tmp_path, monkeypatch):
    dev = FakeDevice()
    dev.install(monkeypatch)
    buf = dev.alloc(256)
    monkeypatch.setattr(driver, "graph_nodes", lambda g: [1])
    monkeypatch.setattr(driver, "graph_edges", lambda g: [])
    monkeypatch.setattr(driver, "func_name", lambda fn: "at::native::fill_kernel")
    monkeypatch.setattr(driver, "node_type", lambda n: driver.NODE_KERNEL)
    monkeypatch.setattr(driver, "kernel_node", lambda n: {"func": 99, "grid": (1, 1, 1), "block": (32, 1, 1),
                                                          "shared": 0, "args": [buf.to_bytes(8, "little")]})
    with pytest.raises(RR.Unrecordable, match="fill_kernel"):  # not a Triton cubin
        RR.extract(0, RR._Segments(), RR._Modules())
    monkeypatch.setattr(driver, "node_type", lambda n: driver.NODE_MEMCPY)
    with pytest.raises(RR.Unrecordable, match="type 1"):
        RR.extract(0, RR._Segments(), RR._Modules())


def test_images_are_read_only_whole_and_of_this_format(tmp_path):
    """An image comes back as written; one of another format version, or truncated, is not used
    (the truncated one is removed); `edgellm cache info` counts images apart."""
    from edgellm.cache import ProgramCache

    pc = ProgramCache(tmp_path)
    image = np.arange(1000, dtype=np.uint32).view(np.uint8)
    pc.put_arrays("a", R.ARTIFACT, {"image": image, "cubin.0": np.frombuffer(b"\x7fELF", np.uint8)},
                  meta={"format": R.FORMAT, "vocab": 64})
    pc.put_arrays("b", R.ARTIFACT, {"image": image}, meta={"format": R.FORMAT + 1})
    meta, arrays = R._read_image(pc, "a")
    assert meta["vocab"] == 64 and np.array_equal(arrays["image"], image) and bytes(arrays["cubin.0"]) == b"\x7fELF"
    assert R._read_image(pc, "b") is None
    parts = pc.info()["parts"]
    assert parts["images"]["items"] == 2 and parts["images"]["bytes"] > 2 * image.nbytes
    path = tmp_path / "programs" / "a" / R.ARTIFACT
    path.write_bytes(path.read_bytes()[:-5])
    assert R._read_image(pc, "a") is None and not path.exists()
