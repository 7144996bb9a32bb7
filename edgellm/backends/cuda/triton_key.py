"""Triton's cache key, remembered between processes.

Before it loads any cached kernel, each process's Triton computes `triton_key()`: a SHA-256 of its
own compiler, backends, language modules and its 450 MB libtriton (0.35 s on the H100 host, 0.67 s
on the 2-core CPU machine), so that kernels compiled by another Triton build are never reused. The
key changes only when one of those files does. `memoize_triton_key` keeps it in the engine's cache
(edgellm.cache, under a key made of the size and modification time of every file in those
folders, and the engine's own fingerprint) and installs a function returning it in place of
Triton's: a later process stats ~300 files (a few milliseconds) instead of hashing them. Any
changed, added or removed file there gives a new key, and so the full computation again; a corrupt
entry is recomputed (ProgramCache checks its digest). EDGELLM_CACHE=0 or EDGELLM_TRITON_KEY_MEMO=0
leaves Triton's function as it is.
"""

from __future__ import annotations

import hashlib
import os

_ARTIFACT = "triton_key"


def stat_signature(root: str) -> str:
    """Size and modification time of every file Triton's key reads, and of their neighbours."""
    h = hashlib.sha256()
    for sub in ("compiler", "backends", "language", "runtime", "_C"):
        for d, dirs, files in os.walk(os.path.join(root, sub)):
            dirs.sort()
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for name in sorted(files):
                p = os.path.join(d, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                h.update(f"{os.path.relpath(p, root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def memoize_triton_key() -> str | None:
    """Install the remembered key as `triton.runtime.cache.triton_key` (computing and storing it
    when absent) and return it; None when the cache or the memo is off (Triton's own function stays)."""
    import triton
    import triton.runtime.cache as tc

    from ...cache import ProgramCache, enabled, program_key

    current = tc.triton_key
    if getattr(current, "edgellm_memo", False):
        return current()
    if not enabled() or os.environ.get("EDGELLM_TRITON_KEY_MEMO", "1") == "0":
        return None
    store = ProgramCache()
    key = program_key(artifact=_ARTIFACT, triton=triton.__version__,
                      files=stat_signature(os.path.dirname(os.path.abspath(triton.__file__))))
    payload = store.get(key, _ARTIFACT)
    value = payload.decode("utf-8", "replace") if payload is not None else None
    if not value or not value.startswith(triton.__version__):
        value = current()
        store.put(key, _ARTIFACT, value.encode())

    def remembered() -> str:
        return value

    remembered.edgellm_memo = True
    tc.triton_key = remembered
    return value
