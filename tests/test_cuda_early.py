"""The GPU's context made on a thread while torch imports (edgellm/backends/cuda/early.py).

The driver calls are checked against a stand-in libcuda.so.1 (compiled here, loaded by a child
process through LD_LIBRARY_PATH) that logs each call: what the module asks the driver for, and
when it declines. On a machine with a GPU, torch's runtime is checked to take the context made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cli_fixtures import child_env

FAKE = r"""
#include <stdio.h>
#include <stdlib.h>
static void log_call(const char *what, int v) {
    FILE *f = fopen(getenv("FAKE_CUDA_LOG"), "a"); fprintf(f, "%s %d\n", what, v); fclose(f);
}
int cuInit(unsigned flags) { log_call("cuInit", (int)flags); return atoi(getenv("FAKE_CUDA_INIT")); }
int cuDeviceGetCount(int *n) { *n = atoi(getenv("FAKE_CUDA_COUNT")); log_call("cuDeviceGetCount", *n); return 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = 40 + ordinal; log_call("cuDeviceGet", ordinal); return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x1234; log_call("cuDevicePrimaryCtxRetain", dev); return 0; }
"""

CHILD = ("import sys, json; from edgellm.backends.cuda import early; "
         "started = early.start_for(sys.argv[1]); print(json.dumps([started, early.outcome(10)]))")


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "fake.c")], check=True)
    return d


def _run(fake_driver, tmp_path, backend="cuda", count=1, init=0, **extra):
    import json

    log = tmp_path / f"log-{backend}-{count}-{init}"
    env = child_env(LD_LIBRARY_PATH=f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}",
                    FAKE_CUDA_LOG=str(log), FAKE_CUDA_COUNT=str(count), FAKE_CUDA_INIT=str(init))
    for name in ("EDGELLM_CUDA_DEVICE", "EDGELLM_EARLY_CONTEXT"):  # the test's settings only
        env.pop(name, None)
    env.update(extra)
    r = subprocess.run([sys.executable, "-c", CHILD, backend], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    started, outcome = json.loads(r.stdout)
    calls = log.read_text().split("\n")[:-1] if log.exists() else []
    return started, outcome, calls


def test_one_gpu_gets_its_primary_context(fake_driver, tmp_path):
    for backend in ("cuda", "auto"):
        started, outcome, calls = _run(fake_driver, tmp_path, backend)
        assert started and outcome == {"context": 0x1234}
        assert calls == ["cuInit 0", "cuDeviceGetCount 1", "cuDeviceGet 0", "cuDevicePrimaryCtxRetain 40"]


def test_declines_where_the_device_is_not_certain_or_not_wanted(fake_driver, tmp_path):
    started, outcome, calls = _run(fake_driver, tmp_path, count=2)  # which is torch's device 0?
    assert started and outcome == {"skipped": "2 devices visible"} and "cuDevicePrimaryCtxRetain 40" not in calls
    started, outcome, calls = _run(fake_driver, tmp_path, init=100)  # cuInit failed (CUDA_ERROR_NO_DEVICE)
    assert outcome == {"skipped": "the driver did not initialise"} and calls == ["cuInit 0"]
    for backend, extra in (("cpu", {}), ("cpu-fast", {}), ("webgpu", {}), ("cuda", {"EDGELLM_EARLY_CONTEXT": "0"}),
                           ("cuda", {"EDGELLM_CUDA_DEVICE": "cpu"})):
        started, outcome, calls = _run(fake_driver, tmp_path, backend, **extra)
        assert not started and outcome == {} and calls == [], (backend, extra)


def test_no_driver_is_a_quiet_no(tmp_path):
    env = child_env(LD_LIBRARY_PATH=str(tmp_path))  # an empty folder first; the real driver may still exist
    r = subprocess.run([sys.executable, "-c", CHILD, "cuda"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_torch_takes_the_context_made_early():
    """On a GPU: the context the thread retained is the one torch's runtime then works in."""
    code = ("import ctypes; from edgellm.backends.cuda import early; early.start_context(); o = early.outcome(60); "
            "import torch; x = torch.arange(10, device='cuda').sum().item(); "
            "cur = ctypes.c_void_p(); ctypes.CDLL('libcuda.so.1').cuCtxGetCurrent(ctypes.byref(cur)); "
            "print(o.get('context') == cur.value, x, o)")
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, env=child_env(), timeout=300)
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.skip("needs exactly one visible CUDA GPU")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True 45 "), r.stdout
