"""The partition solver against brute force on random synthetic cost tables."""

import numpy as np
import pytest

from edgellm.hetero.solver import Option, PlacementError, Problem, brute_force, evaluate, parse_bytes, solve

PROCS = ("cuda:0", "cpu")


def _random_problem(rng, n_layers: int, splits: bool, budget_frac: float, prefill_weight: float) -> Problem:
    units = ["embed"] + [f"blk.{i}" for i in range(n_layers)] + ["head"]
    options = []
    for u in units:
        t_gpu, t_cpu = rng.uniform(0.1, 1.0), rng.uniform(1.0, 8.0)
        pf_gpu, pf_cpu = rng.uniform(1, 5), rng.uniform(20, 80)
        w = int(rng.integers(50, 150)) if u != "embed" else 0
        opts = [Option("cuda:0", t_gpu, pf_gpu, {"cuda:0": w}, ("cuda:0",), "cuda:0"),
                Option("cpu", t_cpu, pf_cpu, {"cpu": w}, ("cpu",), "cpu")]
        if splits and u.startswith("blk."):
            for f in (0.25, 0.5, 0.75):
                opts.append(Option(f"rows cuda:0 {f} | cpu", max(f * t_gpu, (1 - f) * t_cpu) + 0.05,
                                   max(f * pf_gpu, (1 - f) * pf_cpu) + 0.5,
                                   {"cuda:0": int(f * w), "cpu": w - int(f * w)}, ("cuda:0", "cpu"), "cuda:0"))
        options.append(opts)
    total = sum(o[0].memory.get("cuda:0", 0) for o in options)
    return Problem(units, options, {"cuda:0": int(budget_frac * total), "cpu": 10**9},
                   {("cuda:0", "cpu"): 0.2, ("cpu", "cuda:0"): 0.15},
                   {("cuda:0", "cpu"): 2.0, ("cpu", "cuda:0"): 1.5}, prefill_weight)


@pytest.mark.parametrize("seed", range(12))
def test_milp_finds_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    p = _random_problem(rng, n_layers=int(rng.integers(2, 5)), splits=seed % 2 == 0,
                        budget_frac=float(rng.uniform(0.3, 0.9)), prefill_weight=float(rng.choice([0.0, 0.01, 0.1])))
    best = brute_force(p)
    got = solve(p)
    assert best is not None
    assert got.objective == pytest.approx(best.objective, rel=1e-9, abs=1e-12)
    assert all(got.memory.get(q, 0) <= b for q, b in p.budgets.items())
    again = evaluate(p, got.choice)  # the reported times are the choice's own
    assert again.decode_s == pytest.approx(got.decode_s) and again.prefill_s == pytest.approx(got.prefill_s)


def test_transfers_make_one_switch_better_than_alternating():
    """Layers that each prefer alternate processors, with costly transfers: the optimum is not
    the per-layer argmin (a greedy guess) but the one that switches least."""
    units = ["blk.0", "blk.1", "blk.2", "blk.3"]
    prefs = ["cpu", "cuda:0", "cpu", "cuda:0"]
    options = [[Option(q, 1.0 if q == pr else 1.2, 0, {q: 1}, (q,), q) for q in PROCS] for pr in prefs]
    p = Problem(units, options, {"cuda:0": 100, "cpu": 100}, {("cpu", "cuda:0"): 1.0, ("cuda:0", "cpu"): 1.0}, {})
    s = solve(p)
    assert s.objective == pytest.approx(brute_force(p).objective)
    assert len({o.name for o in s.options}) == 1  # no switch: 4.4 beats 4.0 + 3 transfers


def test_budget_smaller_than_one_layer_is_a_clear_error():
    rng = np.random.default_rng(0)
    p = _random_problem(rng, 3, False, 0.5, 0.0)
    smallest = min(o[0].memory["cuda:0"] for u, o in zip(p.units, p.options) if u.startswith("blk."))
    p.budgets["cuda:0"] = smallest - 1
    with pytest.raises(PlacementError, match="smaller than one layer"):
        solve(p)


def test_infeasible_budgets_are_a_clear_error():
    units = ["blk.0", "blk.1"]
    options = [[Option(q, 1, 0, {q: 10}, (q,), q) for q in PROCS] for _ in units]
    with pytest.raises(PlacementError, match="no placement fits"):
        solve(Problem(units, options, {"cuda:0": 10, "cpu": 0}, {}, {}))


def test_parse_bytes():
    assert parse_bytes("6GiB") == 6 * 2**30 and parse_bytes("6G") == 6 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(Exception, match="--gpu-memory"):
        parse_bytes("six gigs")


def test_a_runs_measured_times_are_shown_for_its_placement_only(tmp_path, monkeypatch):
    """`edgellm run --gpu-memory` records its measured times (hetero.plan.record_measured) and
    `edgellm plan` shows them beside the prediction, for the same file, context and placement
    only; a changed file or another placement shows none; an unreadable record file is ignored
    and rewritten."""
    import os

    from edgellm.hetero import plan as hp

    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(256))
    p = {"model": str(model), "ctx": 1024, "prefill": 512, "processors": ["cuda:0", "cpu"],
         "placement": {"embed": "cpu", "blk.0": "cuda:0", "blk.1": "rows cpu 1.00 | cuda:0", "head": "cuda:0"},
         "runs": [{"on": "cuda:0", "from": "blk.0", "to": "blk.0", "count": 1}],
         "memory_bytes": {"cuda:0": 2**30}, "budgets": {"cuda:0": 2**31},
         "predicted_decode_s": 0.0250, "predicted_prefill_s": 0.150}
    assert hp.measured_for(p) is None
    hp.record_measured(p, decode_s=0.0265, prompt_s=0.160, prompt_tokens=37)
    got = hp.measured_for(p)
    assert got["decode_s"] == 0.0265 and got["prompt_tokens"] == 37
    text = hp.render({**p, "measured": got})
    assert "measured (edgellm run, " in text and "decode 26.50 ms/token (37.7 tok/s)" in text
    assert "a prompt of 37 tokens 160.0 ms" in text
    assert "-6%" in hp.compare_line(p, 0.0265)  # predicted 25.0 against 26.5 measured

    other = {**p, "placement": {**p["placement"], "blk.1": "cpu"}}
    assert hp.measured_for(other) is None
    assert "measured (" not in hp.render({**other, "measured": hp.measured_for(other)})
    model.write_bytes(os.urandom(256))  # the file changed
    assert hp.measured_for(p) is None

    hp._measured_path().write_text("{not json")
    assert hp.measured_for(p) is None
    hp.record_measured(p, decode_s=0.03, prompt_s=None, prompt_tokens=5)
    assert hp.measured_for(p)["decode_s"] == 0.03
