"""edgellm over several GPUs of one host (tensor parallel, pipelined) against one GPU and llama.cpp's splits.

    python benchmarks/bench_multi_gpu.py --llama-bench PATH/llama-bench [--preset llama-3.1-8b]
        [--formats F16,Q8_0] [--gpus 2] [-p 512] [-n 128] [-r 3] [--ctx 1024] [--model-dir DIR] [--out DIR]

Per file (the preset's shape with random weights, written once, `fast`):
1. the all_reduce a tensor-parallel step makes, timed on these GPUs (captured in a CUDA graph, as the
   engine runs it), and the solver's choice from it (edgellm.hetero.plan.plan_gpus);
0. a trained model (--chat-check, the embedded default one): its greedy answers to three chat
   prompts on one GPU and tensor parallel over --gpus (equal or not);
2. edgellm on one GPU, tensor parallel over --gpus (the all_reduce inside the norm after it, and
   as a kernel of its own: tensor-unfused) and pipelined over --gpus (layers in even runs),
   each in fresh processes: load time, pp (one forward over p tokens from an empty cache), tg (n
   greedy tokens after a 1-token prompt through Model.generate_tokens, the CLI's loop: its decode
   tokens/s), median of r; and the check: the logits of a 64-token prompt (max difference against
   one GPU's, relative to their largest magnitude) and 3 greedy continuations of 32 tokens (equal
   to one GPU's or not);
3. llama-bench -ngl 99 -fa 1 on the same file: -sm none on one GPU, -sm layer, -sm row and -sm tensor
   (llama.cpp's own tensor parallelism; its CUDA backend no longer offers row's split buffers) on all;
4. one table, and the JSON of every measurement in --out.
NCCL runs as the environment sets it (NVLink multicast stays off: NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

MODES = ("one", "tensor", "tensor-unfused", "pipeline")
# variants of the tensor-parallel run, by the environment they set: NCCL's all_reduce instead of the
# one-shot form; the one-shot all_reduce as a kernel of its own instead of inside the norm after it
MODE_ENV = {"tensor-nccl": {"EDGELLM_ALL_REDUCE": "nccl"}, "tensor-unfused": {"EDGELLM_ALL_REDUCE_FUSE": "0"}}
# llama-bench's split modes: one GPU, then its splits over all (row: split buffers, which the CUDA
# backend of llama.cpp from the llama-cpp-python 0.3.36 sdist no longer provides, "failed to load
# model"; tensor: its tensor parallelism, flash attention required)
LLAMA_SPLITS = ("none", "layer", "row", "tensor")
CHAT_PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


def _rank_main(rank: int, world: int, mode: str, path: str, a, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import edgellm
    from edgellm.model import GenerationStats
    from edgellm.sampling import SamplingParams

    import faulthandler

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    faulthandler.dump_traceback_later(a.timeout - 10, exit=False)  # a hung rank says where
    torch.cuda.set_device(rank)
    os.environ.update(MODE_ENV.get(mode, {}))
    if world > 1:
        dist.init_process_group("nccl", init_method=f"file://{out_dir}/rv-{mode}", rank=rank, world_size=world)
    try:
        res: dict = {"mode": mode, "world": world}
        if mode == "probe":  # the all_reduce link for the solver
            from edgellm.gguf_file import open_gguf
            from edgellm.hetero.profile import Profile, profile_all_reduce
            from edgellm.models import config_from_gguf

            d = config_from_gguf(open_gguf(path)).d_model
            link = profile_all_reduce(Profile(), d, rows=a.p).links[f"all_reduce*{world}"]
            res.update(latency_s=link.latency_s, bandwidth=link.bandwidth)
        elif mode.startswith("chat-"):  # a trained model's greedy answers, one GPU or split
            if mode == "chat-one":
                m = edgellm.load(path, backend="cuda", ctx=a.ctx)
            else:
                from edgellm.hetero.distributed import load_rank

                m = load_rank(path, rank, world, [f"cuda:{i}" for i in range(world)], ctx=a.ctx, mode="tensor")
            greedy = SamplingParams(temperature=0)
            res["chat"] = [list(m.generate_tokens(m.prompt_tokens(q), 32, greedy)) for q in CHAT_PROMPTS]
            res["answers"] = [m.tokenizer.decode(t) for t in res["chat"]]
        else:
            t0 = time.perf_counter()
            if mode == "one":
                m = edgellm.load(path, backend="cuda", ctx=a.ctx, prefill_chunk=a.p)
            else:
                from edgellm.hetero.distributed import load_rank

                m = load_rank(path, rank, world, [f"cuda:{i}" for i in range(world)], ctx=a.ctx,
                              prefill_chunk=a.p, mode=mode.split("-")[0])
            res["load_s"] = time.perf_counter() - t0
            res["gpu_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            rng = np.random.default_rng(0)
            vocab = m.config.vocab_size
            check_ids = rng.integers(3, vocab, 64).tolist()
            check = m.forward(check_ids, 0, all_logits=True)
            greedy = SamplingParams(temperature=0)
            res["greedy"] = [list(m.generate_tokens(rng.integers(3, vocab, 16).tolist(), 32, greedy))
                             for _ in range(3)]
            prompt = rng.integers(3, vocab, a.p).tolist()
            m.forward(prompt, 0, all_logits=False)  # the p-token shape's first run (compiles, captures)
            pp, tg = [], []
            for _ in range(a.r):
                torch.cuda.synchronize()
                t = time.perf_counter()
                m.forward(prompt, 0, all_logits=False)
                pp.append(a.p / (time.perf_counter() - t))
                stats = GenerationStats(prompt_tokens=1)
                for _tok in m.generate_tokens([1], a.n, greedy, stats):
                    pass
                tg.append(stats.decode_tps)
            again = m.forward(check_ids, 0, all_logits=True)  # after every shape ran: the same logits?
            res.update(pp=statistics.median(pp), tg=statistics.median(tg), pp_all=pp, tg_all=tg,
                       describe=m.backend.describe(), repeat_max_diff=float(np.abs(again - check).max()))
            if rank == 0:
                np.save(os.path.join(out_dir, f"logits-{mode}.npy"), check)
        if rank == 0:
            with open(os.path.join(out_dir, f"{mode}.json"), "w") as fh:
                json.dump(res, fh)
    finally:
        if world > 1:  # the model (its CUDA graphs, which may hold NCCL work) goes before the group
            from edgellm.hetero.distributed import end_process_group

            m = None  # noqa: F841
            end_process_group()


def run_mode(mode: str, world: int, path: str, a, out_dir: str) -> dict:
    """One mode's ranks in fresh processes, stopped after --timeout seconds."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_main, args=(world, mode, path, a, out_dir), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + a.timeout
    try:
        while not ctx.join(timeout=max(1.0, min(10.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                done = os.path.join(out_dir, f"{mode}.json")
                if os.path.exists(done):  # measured, then stuck on the way out (a collective's teardown)
                    with open(done) as fh:
                        return {**json.load(fh), "exit": f"ranks did not exit within {a.timeout} s"}
                return {"mode": mode, "error": f"no result in {a.timeout} s (hung?)"}
    except Exception as e:  # noqa: BLE001 - a failed mode is a row that says why
        return {"mode": mode, "error": str(e).strip().splitlines()[-1][:300]}
    with open(os.path.join(out_dir, f"{mode}.json")) as fh:
        return json.load(fh)


def llama_bench(exe: str, path: str, split: str, gpus: int, a) -> dict:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(1 if split == "none" else gpus))
    cmd = [exe, "-m", path, "-ngl", "99", "-fa", "1", "-sm", split, "-p", str(a.p), "-n", str(a.n),
           "-r", str(a.r), "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if out.returncode:
        lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
        return {"error": " / ".join(lines[-3:])[:400], "stderr_tail": lines[-25:]}
    res = {}
    for row in json.loads(out.stdout):
        res["pp" if row["n_gen"] == 0 else "tg"] = row["avg_ts"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", default=None, help="llama-bench executable (CUDA build)")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--formats", default="F16,Q8_0", help="synthetic files to measure ('none': only --chat-check)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {MODES + ('tensor-nccl',)}")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--model-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "edgellm-synthetic"))
    ap.add_argument("--out", default=None, help="folder for the JSON results (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one mode's processes may take")
    ap.add_argument("--chat-check", default="default", help="a trained model file whose greedy answers to three "
                    "chat prompts are compared, one GPU against tensor parallel ('default': the embedded model; "
                    "'none': skip)")
    a = ap.parse_args()

    import torch

    from edgellm.hetero.plan import plan_gpus
    from edgellm.hetero.profile import Link, Profile, profile_cuda
    from edgellm.synthetic import preset, write_synthetic_gguf

    if torch.cuda.device_count() < a.gpus:
        sys.exit(f"--gpus {a.gpus}: only {torch.cuda.device_count()} GPU(s) visible")
    out_root = a.out or tempfile.mkdtemp(prefix="bench-multi-gpu-")
    os.makedirs(a.model_dir, exist_ok=True)
    gpus = [f"cuda:{i}" for i in range(a.gpus)]
    prof = Profile()
    for g in gpus:
        profile_cuda(prof, g)
    results = {}
    if a.chat_check != "none":
        from edgellm.default_model import default_model_path

        chat_path = str(default_model_path()) if a.chat_check == "default" else a.chat_check
        out_dir = os.path.join(out_root, "chat")
        os.makedirs(out_dir, exist_ok=True)
        one, split = run_mode("chat-one", 1, chat_path, a, out_dir), run_mode("chat-tensor", a.gpus, chat_path, a, out_dir)
        same = [x == y for x, y in zip(one.get("chat", []), split.get("chat", []))] if "chat" in one else []
        results["chat"] = {"file": os.path.basename(chat_path), "one": one, "tensor": split, "equal": same}
        print(json.dumps({"chat greedy equal": same, "one": one.get("answers", one.get("error")),
                          "tensor": split.get("answers", split.get("error"))}), flush=True)
    for fmt in [f for f in a.formats.split(",") if f and f != "none"]:
        path = os.path.join(a.model_dir, f"{a.preset}-{fmt}.gguf")
        if not os.path.exists(path):
            t = time.perf_counter()
            write_synthetic_gguf(path, preset(a.preset, weight_type=fmt), fast=True)
            print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
        out_dir = os.path.join(out_root, fmt)
        os.makedirs(out_dir, exist_ok=True)
        probe = run_mode("probe", a.gpus, path, a, out_dir)
        if "latency_s" in probe:
            prof.links[f"all_reduce*{a.gpus}"] = Link(probe["latency_s"], probe["bandwidth"])
        plan = plan_gpus(path, gpus, ctx=a.ctx, prefill=a.p, profile=prof)
        row = {"file": os.path.basename(path), "GB": os.path.getsize(path) / 1e9, "all_reduce": probe,
               "solver": {"mode": plan["mode"], "tensor_decode_ms": plan["tensor"]["predicted_decode_s"] * 1e3,
                          "pipeline_decode_ms": plan["pipeline"]["predicted_decode_s"] * 1e3,
                          "pipeline_runs": plan["pipeline"]["runs"]}}
        print(json.dumps({"file": row["file"], "all_reduce": probe, "solver": row["solver"]}), flush=True)
        for mode in a.modes.split(","):
            row[mode] = run_mode(mode, 1 if mode == "one" else a.gpus, path, a, out_dir)
            print(json.dumps({mode: {k: v for k, v in row[mode].items() if k != "greedy"}}), flush=True)
        ref_logits = os.path.join(out_dir, "logits-one.npy")
        for mode in ("tensor", "tensor-nccl", "tensor-unfused", "pipeline"):
            got = os.path.join(out_dir, f"logits-{mode}.npy")
            if os.path.exists(ref_logits) and os.path.exists(got) and "greedy" in row.get("one", {}):
                ref, lg = np.load(ref_logits), np.load(got)
                row[mode]["logits_rel_diff"] = float(np.abs(lg - ref).max() / np.abs(ref).max())
                row[mode]["greedy_equal"] = sum(x == y for x, y in zip(row[mode].get("greedy", []), row["one"]["greedy"]))
        one_shot = os.path.join(out_dir, "logits-tensor.npy")
        for other in ("tensor-nccl", "tensor-unfused"):  # the other all_reduce forms: the same sums?
            got = os.path.join(out_dir, f"logits-{other}.npy")
            if os.path.exists(one_shot) and os.path.exists(got):
                x, y = np.load(one_shot), np.load(got)
                row["tensor"][f"vs_{other}_rel_diff"] = diff = float(np.abs(x - y).max() / np.abs(y).max())
                print(json.dumps({f"tensor vs {other}": diff}), flush=True)
        if a.llama_bench:
            for _ in range(600):  # a build started beside this run (benchmarks/gpu_session.sh build_llama)
                if os.path.exists(a.llama_bench):
                    break
                time.sleep(1)
            row["llama"] = {s: llama_bench(a.llama_bench, path, s, a.gpus, a) for s in LLAMA_SPLITS}
            print(json.dumps({"llama": row["llama"]}), flush=True)
        results[fmt] = row
        with open(os.path.join(out_root, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1)

    with open(os.path.join(out_root, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(a.gpus))
    print(f"\n{time.strftime('%Y-%m-%d')}, {a.gpus} GPUs ({names}), {a.preset}, ctx {a.ctx}, pp{a.p} tg{a.n}, "
          f"median of {a.r}; results in {out_root}\n")
    print("| file | run | tg tok/s | pp tok/s | tg vs one GPU | tg vs llama.cpp best split | load s | logits diff | "
          "greedy equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt, row in results.items():
        if fmt == "chat":
            continue
        one = row.get("one", {}).get("tg")
        ll = row.get("llama", {})
        best = max([ll[s]["tg"] for s in LLAMA_SPLITS[1:] if "tg" in ll.get(s, {})], default=None)
        for mode in a.modes.split(","):
            r = row.get(mode, {})
            if "error" in r:
                print(f"| {row['file']} | edgellm {mode} | {r['error']} ||||||| ")
                continue
            pick = " (solver's pick)" if mode == row["solver"]["mode"] else ""
            vs_one = f"{r['tg'] / one:.2f}x" if one and mode != "one" else "-"
            vs_ll = f"{r['tg'] / best:.2f}x" if best and mode != "one" else "-"
            diff = f"{r['logits_rel_diff']:.1e}" if "logits_rel_diff" in r else "-"
            eq = f"{r['greedy_equal']}/3" if "greedy_equal" in r else "-"
            print(f"| {row['file']} | edgellm {mode}{pick} | {r['tg']:.1f} | {r['pp']:.0f} | {vs_one} | {vs_ll} | "
                  f"{r['load_s']:.1f} | {diff} | {eq} |")
        for s in LLAMA_SPLITS:
            r = ll.get(s, {})
            if r:
                print(f"| {row['file']} | llama.cpp -sm {s} | {r.get('tg', r.get('error', '-'))} | {r.get('pp', '-')} "
                      f"||||||")
    if "chat" in results:
        c = results["chat"]
        print(f"\n{c['file']}: greedy answers (32 tokens) to {len(CHAT_PROMPTS)} chat prompts, tensor parallel over "
              f"{a.gpus} GPUs equal to one GPU's: {sum(c['equal'])}/{len(CHAT_PROMPTS)}")


if __name__ == "__main__":
    main()
