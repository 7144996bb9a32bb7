"""Weights read from the file through a few reusable slots on threads (edgellm/backends/cuda/upload.py):
every byte of every run lands where it belongs, whatever the chunking; a file that ends early is an
error naming it. On a GPU, the same through page-locked slots and DMA, and the cuda backend's packed
weights are the same with and without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgellm.backends.cuda.upload import Uploader


@pytest.fixture()
def blob(tmp_path):
    data = np.random.default_rng().integers(0, 256, size=3 * (1 << 20) + 12345, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    return path, data


def _check(up: Uploader, data: np.ndarray, runs) -> None:
    for off, n in runs:
        got = up.upload(off, n)
        assert got.dtype == torch.uint8 and got.numel() == n
        np.testing.assert_array_equal(got.cpu().numpy(), data[off:off + n])


@pytest.mark.parametrize("chunk,slots", [(4096, 3), (1000, 2), (1 << 20, 8)])
def test_every_byte_lands_in_place(blob, chunk, slots):
    path, data = blob
    up = Uploader(path, torch.device("cpu"), chunk=chunk, slots=slots)
    try:
        runs = [(0, len(data)), (1, 7), (12345, min(3 * chunk + 17, len(data) - 12345)), (len(data) - 5000, 5000),
                (777, chunk)]
        _check(up, data, runs)
        assert up.calls == len(runs) and up.bytes == sum(n for _, n in runs)
    finally:
        up.close()


def test_a_file_that_ends_early_is_named(blob):
    path, data = blob
    up = Uploader(path, torch.device("cpu"), chunk=4096, slots=2)
    try:
        with pytest.raises(OSError, match=r"blob\.bin.*ended"):
            up.upload(len(data) - 100, 5000)
    finally:
        up.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_page_locked_slots_to_the_gpu(blob):
    path, data = blob
    up = Uploader(path, torch.device("cuda"), chunk=64 << 10, slots=4)
    try:
        _check(up, data, [(0, len(data)), (333, 1 << 20), (len(data) - 70000, 70000)])
    finally:
        up.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "F16"])
def test_cuda_backend_gives_the_same_logits_through_the_slots(tmp_path, monkeypatch, fmt):
    import edgellm
    from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

    monkeypatch.setenv("EDGELLM_CACHE", "0")
    spec = SyntheticSpec(n_layers=2, d_model=1024, n_heads=8, n_kv_heads=4, ffn_dim=4096, vocab_size=1024,
                         weight_type=fmt, seed=3)
    path = write_synthetic_gguf(tmp_path / f"m-{fmt}.gguf", spec)
    ids = [5, 900, 17, 3, 64, 1000, 2]
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("EDGELLM_PINNED_UPLOAD", mode)
        m = edgellm.load(path, backend="cuda", ctx=64)
        out[mode] = m.logits(ids)
        w = m.backend.weights
        assert w._uploader is None  # closed once the programs were built
        assert (w.uploaded_bytes > 0) == (mode == "1"), (mode, w.uploaded_bytes)
    np.testing.assert_array_equal(out["1"], out["0"])
