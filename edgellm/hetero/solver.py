"""The partition solver: which processor runs each unit of a model, under memory budgets.

Each unit (embedding, layer, head) has a few options: run wholly on one processor, or (where it
pays) split: the rows of its matrix products cut between two processors that work at once, or,
for prefill, its tokens cut between two processors that both hold the weights. An option has a
decode time per token, a prefill time per prompt, the bytes it needs on each processor, the
processors that need its input activation and the one that holds its output. Between consecutive
units, every processor that needs the input but does not hold the previous output pays a transfer.

The objective is decode time per token + prefill_weight x prefill time per prompt. Solved exactly
as a mixed-integer linear program (scipy.optimize.milp, HiGHS): binary x[u, o] picks option o of
unit u; continuous y[u, a, b] in [0, 1] carries the transfer cost between the options a, b of
units u-1, u (flow constraints force y = x[u-1, a] x[u, b] when x is integral); one knapsack row
per processor budget. `brute_force` enumerates every choice (tests, tiny problems).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import EdgeLLMError


class PlacementError(EdgeLLMError):
    """No placement fits the memory budgets."""


@dataclass(frozen=True)
class Option:
    name: str  # e.g. "cuda:0", "cpu", "rows cuda:0 0.75 | cpu", "seq cuda:0 0.50 | cpu"
    decode_s: float
    prefill_s: float
    memory: dict = field(default_factory=dict)  # processor -> bytes
    inputs_on: tuple = ()  # processors that read the unit's input activation
    output_on: str = ""  # the processor that holds its output

    @property
    def processor(self) -> str:
        return self.output_on


@dataclass
class Problem:
    units: list[str]
    options: list[list[Option]]
    budgets: dict  # processor -> bytes
    transfer_decode_s: dict  # (src, dst) -> seconds to move one token's activation
    transfer_prefill_s: dict  # (src, dst) -> seconds to move a prompt's activations
    prefill_weight: float = 0.0

    def transfer(self, a: Option, b: Option) -> tuple[float, float]:
        d = p = 0.0
        for q in b.inputs_on:
            if q != a.output_on:
                d += self.transfer_decode_s.get((a.output_on, q), 0.0)
                p += self.transfer_prefill_s.get((a.output_on, q), 0.0)
        return d, p


@dataclass
class Solution:
    choice: list[int]
    options: list[Option]
    decode_s: float
    prefill_s: float
    objective: float
    memory: dict

    def placement(self, units: list[str]) -> dict[str, str]:
        return {u: o.name for u, o in zip(units, self.options)}


def evaluate(problem: Problem, choice: list[int]) -> Solution:
    """Predicted times and memory of one choice of options (transfers included)."""
    opts = [problem.options[u][k] for u, k in enumerate(choice)]
    dec = sum(o.decode_s for o in opts)
    pre = sum(o.prefill_s for o in opts)
    for a, b in zip(opts, opts[1:]):
        td, tp = problem.transfer(a, b)
        dec, pre = dec + td, pre + tp
    mem: dict = {}
    for o in opts:
        for p, b in o.memory.items():
            mem[p] = mem.get(p, 0) + b
    return Solution(list(choice), opts, dec, pre, dec + problem.prefill_weight * pre, mem)


def _fits(problem: Problem, mem: dict) -> bool:
    return all(mem.get(p, 0) <= b for p, b in problem.budgets.items())


def check_budgets(problem: Problem) -> None:
    """Clear errors before solving: a budget too small for any one unit, or no placement at all."""
    for p, budget in problem.budgets.items():
        layer_needs = [min((o.memory.get(p, 0) for o in opts if p in o.memory), default=None)
                       for u, opts in zip(problem.units, problem.options) if u.startswith("blk.")]
        layer_needs = [n for n in layer_needs if n]
        if layer_needs and 0 < budget < min(layer_needs):
            raise PlacementError(f"the memory budget for {p} ({_fmt(budget)}) is smaller than one layer "
                                 f"({_fmt(min(layer_needs))}): raise it, or give it 0 to leave {p} out")


def solve(problem: Problem) -> Solution:
    """The optimal choice under the budgets (exact MILP)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    check_budgets(problem)
    n_units = len(problem.units)
    xi: list[list[int]] = []
    n = 0
    for opts in problem.options:
        xi.append(list(range(n, n + len(opts))))
        n += len(opts)
    yi: list[dict] = [dict() for _ in range(n_units)]
    for u in range(1, n_units):
        for a in range(len(problem.options[u - 1])):
            for b in range(len(problem.options[u])):
                yi[u][a, b] = n
                n += 1
    w = problem.prefill_weight
    c = np.zeros(n)
    integrality = np.zeros(n)
    for u, opts in enumerate(problem.options):
        for k, o in enumerate(opts):
            c[xi[u][k]] = o.decode_s + w * o.prefill_s
            integrality[xi[u][k]] = 1
    for u in range(1, n_units):
        for (a, b), j in yi[u].items():
            td, tp = problem.transfer(problem.options[u - 1][a], problem.options[u][b])
            c[j] = td + w * tp
    rows, lo, hi = [], [], []

    def row(coefs: dict, l: float, h: float):
        r = np.zeros(n)
        for j, v in coefs.items():
            r[j] += v
        rows.append(r), lo.append(l), hi.append(h)

    for u in range(n_units):
        row({j: 1 for j in xi[u]}, 1, 1)  # one option per unit
    for u in range(1, n_units):
        for a in range(len(problem.options[u - 1])):
            row({**{yi[u][a, b]: 1 for b in range(len(problem.options[u]))}, xi[u - 1][a]: -1}, 0, 0)
        for b in range(len(problem.options[u])):
            row({**{yi[u][a, b]: 1 for a in range(len(problem.options[u - 1]))}, xi[u][b]: -1}, 0, 0)
    for p, budget in problem.budgets.items():
        coefs = {xi[u][k]: float(o.memory.get(p, 0)) for u, opts in enumerate(problem.options)
                 for k, o in enumerate(opts) if o.memory.get(p, 0)}
        if coefs:
            row(coefs, -np.inf, float(budget))
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options={"mip_rel_gap": 0})
    if res.status != 0 or res.x is None:
        need = min(sum(min(o.memory.get(p, 0) for o in opts) for opts in problem.options)
                   for p in problem.budgets) if problem.budgets else 0
        raise PlacementError("no placement fits the memory budgets "
                             f"({', '.join(f'{p} {_fmt(b)}' for p, b in problem.budgets.items())}); "
                             f"the model needs at least {_fmt(need)} on one of them")
    choice = [int(np.argmax([res.x[j] for j in xi[u]])) for u in range(n_units)]
    return evaluate(problem, choice)


def brute_force(problem: Problem) -> Solution | None:
    """Every choice of options, the best that fits (None when none fits). Exponential: tests only."""
    best = None
    for choice in itertools.product(*(range(len(o)) for o in problem.options)):
        s = evaluate(problem, list(choice))
        if _fits(problem, s.memory) and (best is None or s.objective < best.objective - 1e-15):
            best = s
    return best


def _fmt(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{int(b)} B"


def parse_bytes(text: str, what: str = "--gpu-memory") -> int:
    """'6GiB', '6G', '512MiB', '1.5GB', '123456' -> bytes (binary units for G/M/K)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise EdgeLLMError(f"{what}: expected a size such as 6GiB or 512MiB, got {text!r}")
    mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    if m.group(3) and m.group(3).upper() == "B" and m.group(2):
        mult = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2).upper()]
    return int(math.floor(float(m.group(1)) * mult))
