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

from ..errors import GraphError

# the functions sympy prints for the shape arithmetic the op rules use (integer division, clamps)
_NAMESPACE = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min, "Mod": lambda a, b: a % b}


class SymDim:
    """A symbolic dimension held as its expression text (sympy's printing of it, e.g. "2*seq"),
    for graphs read back from the program cache: running them needs only sizes, and sympy, which
    took 0.5-2.3 s to import, is then not imported at all. Anything that needs the expression
    itself gets it through sympy's protocol (sympy.sympify(dim) parses the text once)."""

    __slots__ = ("text", "names", "_expr")

    def __init__(self, text: str, names: tuple[str, ...]):
        self.text, self.names, self._expr = text, tuple(names), None

    def _sympy_(self):
        if self._expr is None:
            import sympy

            from .ir import symbol

            self._expr = sympy.sympify(self.text, locals={n: symbol(n) for n in self.names})
        return self._expr

    @property
    def free_symbols(self):
        return self._sympy_().free_symbols

    def __int__(self):
        raise TypeError(f"dimension {self.text} is symbolic; give sizes to get a number")

    def __eq__(self, other):
        if isinstance(other, SymDim):
            return self.text == other.text
        if isinstance(other, int):
            return False
        return self._sympy_() == other

    def __hash__(self):
        return hash(self.text)

    # arithmetic on a symbolic dimension (a cost model's flop count) is sympy's
    def __mul__(self, other):
        return self._sympy_() * other

    def __rmul__(self, other):
        return other * self._sympy_()

    def __add__(self, other):
        return self._sympy_() + other

    def __radd__(self, other):
        return other + self._sympy_()

    def __sub__(self, other):
        return self._sympy_() - other

    def __rsub__(self, other):
        return other - self._sympy_()

    def __str__(self):
        return self.text

    __repr__ = __str__


def dim_text(d) -> tuple[str, tuple[str, ...]]:
    """(Python expression text, symbol names) of one dimension: ("576", ()) or ("2*seq", ("seq",))."""
    if isinstance(d, int):
        return str(d), ()
    if isinstance(d, SymDim):
        return d.text, d.names
    import sympy  # a builder's or compiler's graph: sympy is imported already

    d = sympy.sympify(d)
    if d.is_Integer:
        return str(int(d)), ()
    # sympy prints integer arithmetic as Python arithmetic; x/2 becomes a float, checked below
    return sympy.sstr(d), tuple(sorted(s.name for s in d.free_symbols))


@lru_cache(maxsize=4096)
def shape_function(shape: tuple) -> Callable[[Mapping[str, int]], tuple[int, ...]]:
    """The function sizes -> concrete shape for a tuple of dimensions (ints, sympy expressions or
    SymDims), e.g. shape_function((seq, 576))({"seq": 7, "ctx": 512}) == (7, 576)."""
    rendered = [dim_text(d) for d in shape]
    dims = tuple(shape)
    if not any(names for _, names in rendered):
        const = tuple(int(t) for t, _ in rendered)
        return lambda sizes: const
    names = sorted({n for _, ns in rendered for n in ns})
    code = compile("(" + "".join(f"({t}), " for t, _ in rendered) + ")", f"<shape {dims}>", "eval")

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

