"""Concrete sizes of symbolic shapes, fast: a shape is compiled once into a Python expression.

A graph has a few dozen distinct shapes over a handful of symbols (seq, ctx, ...), and every load
and every program step asks for their sizes. sympy's `subs` (about 50 us a dimension) and
`lambdify` (about 1 ms a shape, mostly printing and module setup) made that a second of a model's
load; here each distinct shape is turned into one compiled Python expression the first time it is
seen, and evaluating it afterwards costs a function call.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Mapping

import sympy

from ..errors import GraphError

# the functions sympy prints for the shape arithmetic the op rules use (integer division, clamps)
_NAMESPACE = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min, "Mod": lambda a, b: a % b}


def _render(d: sympy.Expr) -> str:
    if d.is_Integer:
        return str(int(d))
    # sympy prints integer arithmetic as Python arithmetic; x/2 becomes a float, checked below
    return f"({sympy.sstr(d)})"


@lru_cache(maxsize=4096)
def shape_function(shape: tuple) -> Callable[[Mapping[str, int]], tuple[int, ...]]:
    """The function sizes -> concrete shape for a tuple of sympy dimensions, e.g.
    shape_function((seq, 576))({"seq": 7, "ctx": 512}) == (7, 576)."""
    dims = tuple(sympy.sympify(d) for d in shape)
    if all(d.is_Integer for d in dims):
        const = tuple(int(d) for d in dims)
        return lambda sizes: const
    names = sorted({s.name for d in dims for s in d.free_symbols})
    code = compile("(" + "".join(_render(d) + ", " for d in dims) + ")", f"<shape {dims}>", "eval")

    def evaluate(sizes: Mapping[str, int]) -> tuple[int, ...]:
        try:
            scope = {n: sizes[n] for n in names}
        except KeyError as e:
            raise GraphError(f"shape {dims}: no size given for symbol {e.args[0]!r} (sizes {dict(sizes)})") from None
        values = eval(code, _NAMESPACE, scope)  # noqa: S307 - our own compiled expression, no user text
        out = tuple(int(v) for v in values)
        if any(o != v or o < 0 for o, v in zip(out, values)):
            raise GraphError(f"shape {dims} is not a shape of non-negative integers for sizes {dict(sizes)}: {values}")
        return out

    return evaluate


def concrete(shape: tuple, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return shape_function(tuple(shape))(sizes)


def numel(shape: tuple, sizes: Mapping[str, int]) -> int:
    return math.prod(concrete(shape, sizes))
