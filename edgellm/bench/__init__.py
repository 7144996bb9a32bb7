"""`edgellm bench`: ELIB's benchmarking method for edgellm and its peers.

    from edgellm.bench import BenchPlan, run_bench
    results = run_bench(BenchPlan(prompt_lengths=[128], gen_lengths=[32], repetitions=3, out_dir="out"))

Modules: plan (options, checked up front), engines (the Engine interface: edgellm, llama.cpp,
transformers), worker (one job in a child process), runner (the sweep), metrics (formulas),
device (bandwidth, versions), quantize (the quantization step), report (tables, CSV, JSON, plots).
"""

from .engines import ENGINES, Engine, engine_class
from .metrics import PerplexityResult, Stats, perplexity, summarize
from .plan import BenchArgumentError, BenchPlan, validate
from .quantize import produce_quantized
from .runner import run_bench

__all__ = ["ENGINES", "BenchArgumentError", "BenchPlan", "Engine", "PerplexityResult", "Stats", "engine_class",
           "perplexity", "produce_quantized", "run_bench", "summarize", "validate"]
