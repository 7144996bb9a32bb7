"""A model pipelined over 2 processes (gloo CPU process group) gives the single-process logits."""

import os

import numpy as np
import pytest
import torch.multiprocessing as mp

import edgellm
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

SPEC = SyntheticSpec(arch="qwen2", n_layers=3, weight_type="Q4_1", embed_type="Q8_0", seed=11)
IDS = [5, 17, 200, 3, 99, 42, 7, 150, 31]


def _rank_main(rank, world, path, out_dir, placement, mode="pipeline"):
    import torch.distributed as dist

    from edgellm.hetero.distributed import load_rank

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rv", rank=rank, world_size=world)
    try:
        m = load_rank(path, rank, world, ["cpu"] * world, placement=placement, ctx=32, prefill_chunk=4, mode=mode)
        full = m.logits(IDS)  # three prefill chunks
        steps = [m.forward(IDS[:5], 0, all_logits=False)[-1]]
        steps += [m.forward([t], 5 + i, all_logits=False)[-1] for i, t in enumerate(IDS[5:])]
        np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.concatenate([full, np.stack(steps)]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("placement", [
    None,  # even: embed + layers 0,1 on rank 0; layer 2 + head on rank 1
    {"embed": "rank:1", "blk.0": "rank:0", "blk.1": "rank:1", "blk.2": "rank:0", "head": "rank:1"},
], ids=["even", "interleaved"])
def test_two_process_pipeline_equals_single_process(tmp_path, placement):
    path = write_synthetic_gguf(tmp_path / "m.gguf", SPEC)
    ref = _single_process(path)
    mp.spawn(_rank_main, args=(2, str(path), str(tmp_path), placement), nprocs=2, join=True)
    for r in range(2):  # every rank got the head's logits
        np.testing.assert_array_equal(np.load(tmp_path / f"rank{r}.npy"), ref)


def _single_process(path):
    m = edgellm.load(path, backend="cpu-fast", ctx=32, prefill_chunk=4)
    full = m.logits(IDS)
    steps = [m.forward(IDS[:5], 0, all_logits=False)[-1]]
    steps += [m.forward([t], 5 + i, all_logits=False)[-1] for i, t in enumerate(IDS[5:])]
    return np.concatenate([full, np.stack(steps)])


def test_two_process_tensor_parallel_equals_single_process(tmp_path):
    """Each rank multiplies half the rows of every matrix (odd row counts: unequal shares)."""
    spec = SyntheticSpec(arch="qwen2", n_layers=2, d_model=96, n_heads=3, n_kv_heads=1, ffn_dim=160,
                         weight_type="Q4_1", embed_type="Q8_0", vocab_size=251, seed=12)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ref = _single_process(path)
    mp.spawn(_rank_main, args=(2, str(path), str(tmp_path), None, "tensor"), nprocs=2, join=True)
    for r in range(2):
        got = np.load(tmp_path / f"rank{r}.npy")
        # the same kernels on fewer rows: equal up to the products' own summation order
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_even_placement_any_world():
    from edgellm.hetero.distributed import even_placement

    units = ["embed"] + [f"blk.{i}" for i in range(7)] + ["head"]
    for world in (1, 2, 3, 5):
        p = even_placement(units, world)
        ranks = [int(p[f"blk.{i}"].split(":")[1]) for i in range(7)]
        assert ranks == sorted(ranks) and set(ranks) == set(range(world)) and p["head"] == f"rank:{world - 1}"
