"""Where a load's time goes: each model is loaded once to fill the engine cache (cold), then again
in a fresh process under cProfile (warm), as `edgellm run` loads it.

    python benchmarks/profile_load.py --backend cuda FILE.gguf [FILE.gguf ...] [--top 30] [--profile cold]

Per file: the load phases (Model.load_phases), the cache hits, and the functions with the largest
cumulative and own time of the warm load (--profile cold: of the first load, with the engine cache
empty; both: of each). A fresh EDGELLM_CACHE_DIR is used unless --keep-cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import cProfile, io, json, pstats, sys, time
backend, path, top, prof = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
t0 = time.perf_counter()
import edgellm
from edgellm.backends import get_backend
get_backend(backend)
t1 = time.perf_counter()
p = cProfile.Profile() if prof else None
if p: p.enable()
t2 = time.perf_counter()
m = edgellm.load(path, backend=backend)
t3 = time.perf_counter()
if p: p.disable()
print(json.dumps({"import_s": round(t1 - t0, 3), "load_s": round(t3 - t2, 3),
                  "phases": {k: round(v, 3) for k, v in m.load_phases.items()}, "hits": m.cache_hits}))
if p:
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats(key).print_stats(top)
        print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:20000])
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--keep-cache", action="store_true", help="use the current engine cache as it is")
    ap.add_argument("--profile", choices=("warm", "cold", "both"), default="warm", help="which load runs under cProfile")
    a = ap.parse_args()
    env = dict(os.environ)
    if not a.keep_cache:
        env["EDGELLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="edgellm-profile-load-")
    for f in a.files:
        first = "first (cache as found)" if a.keep_cache else "cold"
        cold, warm = a.profile in ("cold", "both"), a.profile in ("warm", "both")
        for label, prof in ((first, str(int(cold))), ("warm", str(int(warm))), ("warm again", "0")):
            r = subprocess.run([sys.executable, "-c", CHILD, a.backend, f, str(a.top), prof], env=env,
                               capture_output=True, text=True, timeout=900)
            print(f"== {os.path.basename(f)} {label} (exit {r.returncode})")
            print(r.stdout.strip() or r.stderr.strip()[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
