"""edgellm cuda and llama.cpp (llama-bench) on the same GGUF files, in the same run.

    python benchmarks/bench_vs_llamacpp.py --llama-bench PATH/llama-bench [MODEL.gguf ...]
        [--synthetic smollm2-135m,llama-3.2-1b,llama-3.1-8b --formats F16,Q8_0,Q4_0 --model-dir DIR]
        [--llama-quantize PATH/llama-quantize]
        [-p 512,1024] [-n 128,256] [-r 5] [--fa 1] [--json OUT.json]
        [--variant NAME:VAR=VAL[,VAR=VAL...] ...]

--synthetic writes random-weight GGUF files (edgellm.synthetic presets: normal, std 0.02, the
llama.cpp quantizer's policy for the output projection) into --model-dir, once per shape and
format (an existing file is reused), and adds them to the models. With --llama-quantize, a mix
format (Q4_K_M, Q5_K_M) is made by llama.cpp's own quantizer from the shape's F16 file (written
first if missing) as `NAME-FMT-lq.gguf`, as issue 17's table asks, instead of edgellm's random
blocks of the same mix. For each file: llama-bench
-ngl 99 -p P -n N -fa FA -r R (its own warm-up; mean and stddev), then edgellm's measurement of
the same tests (gpu_check.py's `measure`: warm-up, median of R; prefill from an empty cache,
decode from an empty context). The file's runs are adjacent, so drift hits both engines alike.
Prints one table with both engines' tokens/s and the ratio, plus edgellm's decode MBU against a
measured copy bandwidth.

--variant measures edgellm once more per file with environment variables set for that load (e.g.
`--variant tune0:EDGELLM_TUNE=0 --variant tune1:EDGELLM_TUNE=1`); each variant gets its own row,
all against the same llama-bench run. The JSON keeps, per variant, the decode GEMVs' launch
configurations and whether they were tuned, read from the tuning cache or defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def parse_llama_bench(text: str) -> dict:
    """llama-bench -o json's output -> {"pp512": tokens/s, "pp512_sd": stddev, "tg128": ..., ...}
    (a prompt test has n_gen 0, a generation test n_prompt 0; -pg and -d tests are not used here)."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON ({e}): {text[:120]!r}") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"llama-bench JSON: expected a non-empty list of tests, got {text[:120]!r}")
    res = {}
    for row in rows:
        try:
            key = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
            res[key], res[key + "_sd"] = float(row["avg_ts"]), float(row["stddev_ts"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"llama-bench JSON: a test without n_prompt/n_gen/avg_ts/stddev_ts ({e!r})") from None
    return res


def llama_bench(exe: str, path: str, p: list[int], n: list[int], r: int, fa: int, timeout: int = 900) -> dict:
    """Run llama-bench -ngl 99 on one file (its environment: this process's, e.g. VK_DRIVER_FILES
    for a Vulkan build); the parsed speeds, or {"error": ...}."""
    cmd = [exe, "-m", path, "-ngl", "99", "-p", ",".join(map(str, p)), "-n", ",".join(map(str, n)),
           "-fa", str(fa), "-r", str(r), "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"llama-bench timed out after {timeout} s"}
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    try:
        return parse_llama_bench(out.stdout)
    except ValueError as e:
        return {"error": str(e)}


def synthetic_models(names: str, formats: str, folder: str, llama_quantize: str | None = None) -> list[str]:
    from edgellm.synthetic import MIXES, preset, write_synthetic_gguf

    def written(name: str, fmt: str) -> str:
        path = os.path.join(folder, f"{name}-{fmt}.gguf")
        if not os.path.exists(path):
            t = time.perf_counter()
            write_synthetic_gguf(path, preset(name, weight_type=fmt), fast=True)
            print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
        return path

    paths = []
    os.makedirs(folder, exist_ok=True)
    for name in [x for x in names.split(",") if x]:
        for fmt in [x for x in formats.split(",") if x]:
            if llama_quantize and fmt.upper() in MIXES:
                path = os.path.join(folder, f"{name}-{fmt}-lq.gguf")
                if not os.path.exists(path):
                    src = written(name, "F16")
                    t = time.perf_counter()
                    out = subprocess.run([llama_quantize, src, path + ".tmp", fmt.upper()], capture_output=True, text=True)
                    if out.returncode or not os.path.isfile(path + ".tmp"):
                        if os.path.exists(path + ".tmp"):
                            os.remove(path + ".tmp")
                        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
                        raise SystemExit(f"{llama_quantize} {src} -> {fmt}: exit {out.returncode}: {' / '.join(tail)}")
                    os.replace(path + ".tmp", path)
                    print(f"quantized {path} with llama-quantize ({time.perf_counter() - t:.0f} s)", flush=True)
                paths.append(path)
            else:
                paths.append(written(name, fmt))
    return paths


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return vals


def variant_arg(text: str) -> tuple[str, dict]:
    """argparse type of --variant NAME:VAR=VAL[,VAR=VAL...] (also bench_onnx.py's)."""
    name, _, assigns = text.partition(":")
    env = {}
    for item in filter(None, assigns.split(",")):
        var, eq, val = item.partition("=")
        if not eq or not var:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:VAR=VAL[,VAR=VAL...]")
        env[var] = val
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: the name before ':' is empty")
    return name, env


@contextlib.contextmanager
def environment(env: dict):
    """These environment variables set inside the block, the previous values restored after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _measure_with(env: dict, *args) -> dict:
    from gpu_check import measure

    with environment(env):
        try:
            return measure(*args)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:200]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--llama-bench", required=True, help="llama-bench's path, or none (edgellm alone, e.g. to "
                                                          "compare --variant rows)")
    ap.add_argument("--synthetic", default="", help="preset names to write (edgellm.synthetic.PRESETS)")
    ap.add_argument("--formats", default="F16,Q8_0,Q4_0")
    ap.add_argument("--model-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "edgellm-synthetic"))
    ap.add_argument("--llama-quantize", default=None, help="llama-quantize's path: mixes (Q4_K_M, Q5_K_M) made by it "
                                                           "from the F16 files")
    ap.add_argument("-p", type=_ints, default=[512])
    ap.add_argument("-n", type=_ints, default=[128])
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--fa", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", action="append", default=[], type=variant_arg,
                    help="NAME:VAR=VAL[,VAR=VAL]: measure edgellm again with these environment variables")
    a = ap.parse_args()
    from gpu_check import copy_bandwidth  # torch with CUDA

    if a.llama_bench != "none" and not os.access(a.llama_bench, os.X_OK):
        ap.error(f"--llama-bench {a.llama_bench}: not an executable file")
    if a.llama_quantize and not os.access(a.llama_quantize, os.X_OK):
        ap.error(f"--llama-quantize {a.llama_quantize}: not an executable file")
    models = list(a.models) + synthetic_models(a.synthetic, a.formats, a.model_dir, a.llama_quantize)
    if not models:
        ap.error("no models: give GGUF paths or --synthetic")
    for path in models:
        if not os.path.isfile(path):
            ap.error(f"model {path}: no such file")
    bw = copy_bandwidth()
    import torch

    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows = []
    for path in models:
        name = os.path.basename(path).removesuffix(".gguf")
        lc = llama_bench(a.llama_bench, path, a.p, a.n, a.r, a.fa) if a.llama_bench != "none" else {}
        for label, env in a.variant or [("", {})]:
            ours = _measure_with(env, path, a.p, a.n, a.r, bw)
            rows.append({"model": f"{name} [{label}]" if label else name, "variant": label, "env": env,
                         "llama.cpp": lc, "edgellm": ours})
            print(json.dumps(rows[-1]), flush=True)
    tests = [f"pp{q}" for q in a.p] + [f"tg{k}" for k in a.n]
    print("\n| model | " + " | ".join(f"{t} llama.cpp | {t} edgellm | ratio" for t in tests) + " | edgellm MBU tg |")
    print("|---|" + "---:|---:|---:|" * len(tests) + "---:|")
    for r in rows:
        lc, us = r["llama.cpp"], r["edgellm"]

        def cell(d, k):
            return f"{d[k]:,.1f}" if k in d else d.get("error", "-")[:40]

        def ratio(k):
            return f"{us[k] / lc[k]:.2f}x" if k in us and k in lc else "-"

        mbu = " / ".join(f"{100 * us[f'tg{k}_mbu']:.1f}%" for k in a.n if f"tg{k}_mbu" in us) or "-"
        print(f"| {r['model']} | " + " | ".join(f"{cell(lc, t)} | {cell(us, t)} | {ratio(t)}" for t in tests)
              + f" | {mbu} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "p": a.p, "n": a.n,
                       "r": a.r, "fa": a.fa, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
