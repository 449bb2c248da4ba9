"""Integer arithmetic expressions for Countdown: a bounded safe parser, a normal form, and an exhaustive solver.

Countdown (TinyZero; Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning",
§4.1) asks for an expression that uses each given number exactly once with ``+ - * /`` and parentheses and equals a
target. The verifier here never calls ``eval``: text is filtered to ASCII ``0-9+-*/() ``, its size and parenthesis
depth are bounded *before* ``ast.parse`` (which can itself raise ``RecursionError``/``MemoryError`` on deep nesting),
only ``BinOp(Add|Sub|Mult|Div)`` over non-negative integer literals is accepted (no unary minus: negating is not a move
of the game and would let a model make numbers it was not given), and values are exact ``Fraction``\\ s whose size is
capped.

Normal form. Two expressions count as the *same solution* when they differ only by commutativity and associativity of
``+`` and ``*`` and by moving signs/reciprocals through brackets (``a-(b-c) = a-b+c``, ``a/(b/c) = a*c/b``).
Distributivity is *not* applied: ``(a+b)*c`` and ``a*c+b*c`` use different numbers anyway. A sum is flattened into
positive and negative terms, a product into numerator and denominator factors, each list sorted (numbers by value,
compound terms by text, numbers before compound terms), and printed with the fewest parentheses: ``12+8-3`` and
``8-(3-12)`` both become ``"8+12-3"``, ``(5+2)*3`` becomes ``"3*(2+5)"``, ``20/4*3`` becomes ``"3*20/4"``. Every
expression has a positive part (there is no unary minus), so the text never starts with ``-`` or ``/``.
"""

from __future__ import annotations

import ast
import functools
from fractions import Fraction
from typing import NamedTuple

#: characters an expression may contain at all (checked before parsing; rejects unicode digits such as '٣')
ALLOWED_CHARS = frozenset("0123456789+-*/() ")
#: default bounds: text length, parenthesis depth, digits per literal, bits of any intermediate numerator/denominator
MAX_EXPRESSION_CHARS = 256
MAX_PAREN_DEPTH = 32
MAX_LITERAL_DIGITS = 12
MAX_VALUE_BITS = 1024
#: the solver is exhaustive (Catalan × 4^(n-1) × n! trees); past 6 numbers it is too slow to be useful
MAX_SOLVER_NUMBERS = 6


class Expr(NamedTuple):
    """An expression in normal form. ``kind``: ``"n"`` number, ``"+"`` sum, ``"*"`` product.

    For a sum ``pos``/``neg`` are the added/subtracted terms (numbers or products); for a product they are numerator
    and denominator factors (numbers or sums); for a number ``pos == (int,)``.
    """

    text: str
    kind: str
    pos: tuple
    neg: tuple


def number(value: int) -> Expr:
    return Expr(str(value), "n", (value,), ())


def _sort_key(e: Expr) -> tuple:
    return (0, e.pos[0], "") if e.kind == "n" else (1, 0, e.text)


def _parts(e: Expr, kind: str) -> tuple[tuple, tuple]:
    return (e.pos, e.neg) if e.kind == kind else ((e,), ())


def combine(op: str, left: Expr, right: Expr) -> Expr:
    """The normal form of ``left op right`` for ``op`` in ``+ - * /``."""
    kind = "+" if op in "+-" else "*"
    lp, ln = _parts(left, kind)
    rp, rn = _parts(right, kind)
    if op in "-/":
        rp, rn = rn, rp
    pos = tuple(sorted(lp + rp, key=_sort_key))
    neg = tuple(sorted(ln + rn, key=_sort_key))
    if kind == "+":
        text = "+".join(t.text for t in pos) + "".join("-" + t.text for t in neg)
    else:

        def factor(f: Expr) -> str:
            return f"({f.text})" if f.kind == "+" else f.text

        text = "*".join(factor(f) for f in pos) + "".join("/" + factor(f) for f in neg)
    return Expr(text, kind, pos, neg)


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b else None  # division by zero: the expression is invalid


# ---------------------------------------------------------------------------------------------------- safe parsing
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ParsedExpression(NamedTuple):
    """A parsed expression: its normal form, the integer literals it uses, and its exact value.

    ``value`` is ``None`` when evaluation divides by zero or exceeds ``MAX_VALUE_BITS``; such an expression is never
    correct, and its ``normal`` form must not be trusted to be invalid too (``a/(b/0)`` normalises to ``a*0/b``).
    """

    normal: Expr
    literals: tuple[int, ...]
    value: Fraction | None


def parse_expression(text: object, max_chars: int = MAX_EXPRESSION_CHARS) -> ParsedExpression | None:
    """Parse ``text`` as an integer ``+ - * /`` expression, or return ``None``. Never raises; never evaluates code.

    Time is bounded by the checks that run before ``ast.parse``: type, length, allowed characters, balanced
    parentheses of depth at most ``MAX_PAREN_DEPTH``.
    """
    if not isinstance(text, str) or len(text) > max_chars:
        return None
    text = text.strip(" ")
    if not text or not ALLOWED_CHARS.issuperset(text):
        return None
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
            if depth > MAX_PAREN_DEPTH:
                return None
        elif char == ")":
            depth -= 1
            if depth < 0:
                return None
    if depth:
        return None
    return _parse_checked(text)


#: distinct texts whose parses are remembered: an ES population writes the same few completions for a problem again
#: and again (most members agree at small σ), and grading parses each answer twice (extraction, then the check of its
#: normal form); a hit costs a dict lookup instead of ``ast.parse`` and the conversion (~50 µs). At most
#: ``PARSE_CACHE_SIZE`` keys of at most ``max_chars`` characters each (``MAX_EXPRESSION_CHARS`` unless a caller passes
#: more), so the cache stays bounded.
PARSE_CACHE_SIZE = 4096


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse_checked(text: str) -> ParsedExpression | None:
    """The parse of a text that passed :func:`parse_expression`'s checks. Cached: the result is immutable (named tuples
    of ints, strings and ``Fraction`` s) and a pure function of ``text``."""
    try:
        tree = ast.parse(text, mode="eval")
        literals: list[int] = []
        normal, value = _convert(tree.body, literals)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Rejected):
        return None
    return ParsedExpression(normal, tuple(literals), value)


class _Rejected(Exception):
    """A node outside the accepted grammar."""


def _convert(node: ast.AST, literals: list[int]) -> tuple[Expr, Fraction | None]:
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) is not int or value < 0 or len(str(value)) > MAX_LITERAL_DIGITS:
            raise _Rejected
        literals.append(value)
        return number(value), Fraction(value)
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        op = _AST_OPS[type(node.op)]
        left, lv = _convert(node.left, literals)
        right, rv = _convert(node.right, literals)
        value = None if lv is None or rv is None else _apply(op, lv, rv)
        if value is not None and max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_VALUE_BITS:
            value = None
        return combine(op, left, right), value
    raise _Rejected  # names, calls, attributes, unary ops, Pow, FloorDiv, tuples, strings, floats, ...


# ---------------------------------------------------------------------------------------------------- solver
def _solve_table(nums: tuple[int, ...], target: Fraction | None) -> dict[Fraction, dict[str, Expr]]:
    """All normal forms over all of ``nums`` (each used once), grouped by value; only ``target``'s group if given.

    Dynamic programming over subsets (bitmasks): every expression over a set of numbers is ``A op B`` for a split of
    the set into two non-empty parts. ``+``/``*`` are tried once per unordered split, ``-``/``/`` in both orders;
    divisions by zero are skipped. Deduplication is by normal-form text within each subset.
    """
    n = len(nums)
    full = (1 << n) - 1
    table: list[dict[Fraction, dict[str, Expr]]] = [{} for _ in range(full + 1)]
    for i, x in enumerate(nums):
        table[1 << i] = {Fraction(x): {str(x): number(x)}}
    for mask in sorted(range(1, full + 1), key=lambda m: bin(m).count("1")):
        if mask & (mask - 1) == 0:
            continue
        want = target if mask == full else None
        out: dict[Fraction, dict[str, Expr]] = {}
        lowest = mask & -mask
        sub = (mask - 1) & mask
        while sub:
            if sub & lowest:  # each unordered split {A, B} once
                _combine_groups(table[sub], table[mask ^ sub], want, out)
            sub = (sub - 1) & mask
        table[mask] = out
    return table[full]


def _combine_groups(
    left: dict[Fraction, dict[str, Expr]],
    right: dict[Fraction, dict[str, Expr]],
    want: Fraction | None,
    out: dict[Fraction, dict[str, Expr]],
) -> None:
    for a, a_exprs in left.items():
        for b, b_exprs in right.items():
            candidates = (
                ("+", a + b, False),
                ("*", a * b, False),
                ("-", a - b, False),
                ("-", b - a, True),
                ("/", a / b if b else None, False),
                ("/", b / a if a else None, True),
            )
            for op, value, swap in candidates:
                if value is None or (want is not None and value != want):
                    continue
                group = out.setdefault(value, {})
                for ea in a_exprs.values():
                    for eb in b_exprs.values():
                        e = combine(op, eb, ea) if swap else combine(op, ea, eb)
                        group.setdefault(e.text, e)


def _check_nums(nums) -> tuple[int, ...]:
    nums = tuple(int(x) for x in nums)
    if not 1 <= len(nums) <= MAX_SOLVER_NUMBERS:
        raise ValueError(
            f"the Countdown solver takes 1 to {MAX_SOLVER_NUMBERS} numbers (it is exhaustive), got {len(nums)}"
        )
    if any(x < 0 for x in nums):
        raise ValueError(f"Countdown numbers must be non-negative integers, got {list(nums)}")
    return nums


def solve(nums, target) -> list[str]:
    """All distinct solutions (normal-form strings, sorted) that use every number of ``nums`` once and equal ``target``.

    Multiplying and dividing by 1 are different uses of the 1, so both count:

    >>> solve([1, 2, 3], 6)
    ['1*2*3', '1+2+3', '2*3/1']
    """
    nums = _check_nums(nums)
    target = Fraction(str(target)) if not isinstance(target, int) else Fraction(target)
    return sorted(_solve_table(nums, target).get(target, {}))


def num_solutions(nums, target) -> int:
    """How many distinct solutions (in the sense of :func:`solve`) the instance has; 0 when unsolvable."""
    return len(solve(nums, target))


def solutions_by_value(nums) -> dict[Fraction, list[str]]:
    """Every reachable value of ``nums`` (all numbers used) mapped to its sorted solutions: one pass for all targets."""
    table = _solve_table(_check_nums(nums), None)
    return {value: sorted(group) for value, group in table.items()}


def reachable_values(nums) -> set[Fraction]:
    """Every value an expression over all of ``nums`` can take: the solver's recursion without building any text."""
    nums = _check_nums(nums)
    full = (1 << len(nums)) - 1
    values: list[set[Fraction]] = [set() for _ in range(full + 1)]
    for i, x in enumerate(nums):
        values[1 << i] = {Fraction(x)}
    for mask in sorted(range(1, full + 1), key=lambda m: bin(m).count("1")):
        if mask & (mask - 1) == 0:
            continue
        out = values[mask]
        lowest = mask & -mask
        sub = (mask - 1) & mask
        while sub:
            if sub & lowest:
                for a in values[sub]:
                    for b in values[mask ^ sub]:
                        out.update((a + b, a * b, a - b, b - a))
                        if b:
                            out.add(a / b)
                        if a:
                            out.add(b / a)
            sub = (sub - 1) & mask
    return values[full]
