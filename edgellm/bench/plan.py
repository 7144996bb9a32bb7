"""What a benchmark run will do (BenchPlan), checked completely before anything runs."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import BackendUnavailableError, EdgeLLMError, ModelFileError, UnknownTensorTypeError
from .quantize import SOURCE

KNOWN_BACKENDS = ("cpu", "cuda")
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "perplexity_text.txt"


class BenchArgumentError(EdgeLLMError):
    """A benchmark option has a value that cannot work."""


@dataclass
class BenchPlan:
    models: list[str] = field(default_factory=list)  # empty: the embedded default model
    quants: list[str] = field(default_factory=lambda: [SOURCE])
    backends: list[str] = field(default_factory=lambda: ["cpu"])
    engines: list[str] = field(default_factory=lambda: ["edgellm"])
    prompt_lengths: list[int] = field(default_factory=lambda: [512])
    gen_lengths: list[int] = field(default_factory=lambda: [128])
    repetitions: int = 5
    ppl: bool = True
    ppl_file: str | None = None  # None: the text shipped in edgellm/data
    ppl_ctx: int | None = None  # None: 512, or less for a short text
    ppl_chunks: int | None = None  # None: every chunk
    out_dir: str | None = None
    timeout_s: float = 1800.0
    peak_bw_gbps: float | None = None  # None: measured (cached per device)
    quant_cache: str | None = None  # None: OUT/quant with -o, else ~/.cache/edgellm/quant
    quant_policy: str | None = None  # None: the quantizer's default (uniform)
    threads: int | None = None
    warmup: bool = True
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ppl_path(self) -> Path | None:
        if not self.ppl:
            return None
        return Path(self.ppl_file) if self.ppl_file else DEFAULT_TEXT


def _positive_ints(values, what: str) -> list[int]:
    out = []
    for v in values:
        try:
            i = int(v)
        except (TypeError, ValueError):
            raise BenchArgumentError(f"{what}: '{v}' is not a whole number") from None
        if i <= 0 or i != float(v):
            raise BenchArgumentError(f"{what}: values must be positive whole numbers, got {v}")
        out.append(i)
    if not out:
        raise BenchArgumentError(f"{what}: give at least one value")
    return list(dict.fromkeys(out))


def normalize_quant(name: str) -> str:
    key = name.strip()
    if key.lower() in (SOURCE, "src", "orig", "original", "none"):
        return SOURCE
    from ..quant.registry import get_format

    try:
        return get_format(key).name
    except UnknownTensorTypeError as e:
        raise UnknownTensorTypeError(f"--quant: {e}") from None


def check_writable_dir(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".edgellm-write-test-"):
            pass
    except OSError as e:
        raise BenchArgumentError(f"{what} {p} is not writable: {e.strerror or e}") from None
    return p


def validate(plan: BenchPlan) -> BenchPlan:
    """Check every option, normalise names and numbers; raise a one-line error naming the option."""
    from .engines import engine_class

    plan.prompt_lengths = _positive_ints(plan.prompt_lengths, "-p/--n-prompt")
    plan.gen_lengths = _positive_ints(plan.gen_lengths, "-n/--n-gen")
    plan.repetitions = _positive_ints([plan.repetitions], "-r/--repetitions")[0]
    if plan.ppl_ctx is not None:
        plan.ppl_ctx = _positive_ints([plan.ppl_ctx], "--ppl-ctx")[0]
        if plan.ppl_ctx < 4:
            raise BenchArgumentError(f"--ppl-ctx must be at least 4 tokens, got {plan.ppl_ctx}")
    if plan.ppl_chunks is not None:
        plan.ppl_chunks = _positive_ints([plan.ppl_chunks], "--ppl-chunks")[0]
    if plan.threads is not None:
        plan.threads = _positive_ints([plan.threads], "--threads")[0]
    if not (plan.timeout_s and plan.timeout_s > 0):
        raise BenchArgumentError(f"--timeout must be a positive number of seconds, got {plan.timeout_s}")
    if plan.peak_bw_gbps is not None and not plan.peak_bw_gbps > 0:
        raise BenchArgumentError(f"--peak-bw must be a positive number of GB/s, got {plan.peak_bw_gbps}")

    if not plan.engines:
        raise BenchArgumentError("--engine: give at least one engine")
    for e in plan.engines:
        try:
            engine_class(e)
        except EdgeLLMError as err:
            raise BenchArgumentError(f"--engine: {err}") from None
    plan.engines = list(dict.fromkeys(plan.engines))

    plan.backends = list(dict.fromkeys(b.strip().lower() for b in plan.backends))
    if not plan.backends:
        raise BenchArgumentError("--backend: give at least one backend")
    from ..backends import BACKENDS

    known = tuple(dict.fromkeys(KNOWN_BACKENDS + tuple(b for b in BACKENDS if b != "auto")))
    for b in plan.backends:
        if b not in known:
            raise BackendUnavailableError(f"--backend: unknown backend '{b}' (known: {', '.join(known)})")

    plan.quants = list(dict.fromkeys(normalize_quant(q) for q in plan.quants)) or [SOURCE]
    if plan.quant_policy is not None:
        try:
            from ..quant.policy import POLICIES
        except ImportError:
            POLICIES = None
        plan.quant_policy = plan.quant_policy.strip().lower()
        if POLICIES is not None and plan.quant_policy not in POLICIES:
            raise BenchArgumentError(f"--quant-policy: unknown policy '{plan.quant_policy}' (known: {', '.join(POLICIES)})")

    if not plan.models:
        from ..default_model import default_model_path

        plan.models = [str(default_model_path())]
    for m in plan.models:
        p = Path(m)
        if not p.is_file():
            raise ModelFileError(f"model file {m} does not exist" if not p.exists() else f"{m} is not a file")
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelFileError(f"cannot read model file {m}: {e.strerror or e}") from None
        if magic != b"GGUF":
            raise ModelFileError(f"{m} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")

    if plan.ppl:
        path = plan.ppl_path
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise BenchArgumentError(f"perplexity text {path} is not UTF-8: {e.reason} at byte {e.start}") from None
        except OSError as e:
            raise BenchArgumentError(f"cannot read perplexity text {path}: {e.strerror or e}") from None
        if not text.strip():
            raise BenchArgumentError(f"perplexity text {path} is empty")
    if plan.out_dir is not None:  # last: the directory is made only for a run that will happen
        check_writable_dir(plan.out_dir, "output directory")
    return plan
