"""Competition math (MATH-500, DeepScaleR): the last ``\\boxed{...}`` checked for mathematical equivalence.

Equivalence (``\\frac12`` = ``0.5`` = ``\\frac{1}{2}``, sets, intervals, matrices, units) is delegated to Hugging Face's
``math-verify``, the grader used by open-r1 and TRL's ``accuracy_reward``. ``math-verify`` is an optional extra:
``pip install 'es-lightning[math]'``. Its parsing and comparison go through SymPy, which can be slow on hostile input,
so the boxed text is capped at ``max_answer_chars`` and both calls run under math-verify's own ``parsing_timeout`` /
``timeout_seconds`` (a SIGALRM, which Python allows only in the main thread: elsewhere the timeout is off and the size
cap is the bound). Any exception scores 0.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Hashable
from fractions import Fraction
from typing import Any, ClassVar

from es_lightning.tasks.base import Task, check_text

__all__ = ["MathTask", "last_boxed"]

#: the instruction of DeepSeek-R1 / Qwen2.5-Math evaluations
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_BOX = "\\boxed"


def last_boxed(text: str, max_chars: int = 1000) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or ``None``: missing, empty, unbalanced,
    or longer than ``max_chars``."""
    start = text.rfind(_BOX + "{")
    if start < 0:
        return None
    i = start + len(_BOX) + 1
    depth = 1
    end = min(len(text), i + max_chars + 1)
    for j in range(i, end):
        char = text[j]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                content = text[i:j].strip()
                return content or None
    return None


def _math_verify():
    try:
        import math_verify
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "MathTask checks answers with math-verify, which is not installed: pip install 'es-lightning[math]'"
        ) from err
    return math_verify


@functools.lru_cache(maxsize=4096)
def _parse_boxed(content: str, timeout: int | None) -> list:
    return _math_verify().parse("\\boxed{" + content + "}", parsing_timeout=timeout)


@functools.lru_cache(maxsize=4096)
def _verified(gold: str, answer: str, timeout: int | None) -> bool:
    """math-verify's verdict on one (gold, boxed answer) pair, once: a population or a group often repeats an answer,
    and a hostile one (a power tower, ``9^{9^{9}}``) costs the whole timeout every time it is compared. A verdict the
    timeout decided (False) is kept too: the same comparison would run out of time again."""
    gold_parsed = _parse_boxed(gold, timeout)
    predicted = _parse_boxed(answer, timeout)
    if not gold_parsed or not predicted:
        return False
    return bool(_math_verify().verify(gold_parsed, predicted, timeout_seconds=timeout))


class MathTask(Task):
    """Problems with a short final answer: ``HuggingFaceH4/MATH-500`` by default (columns ``problem``, ``answer``).

    ``agentica-org/DeepScaleR-Preview-Dataset`` has the same columns and works by setting the data source to it.
    The format reward goes to any completion with a non-empty ``\\boxed{}``; the correct reward to one whose boxed
    answer math-verify judges equal to ``answer``.

    Args:
        timeout_seconds: math-verify's parse and verify timeouts, each (whole seconds; main thread only).
        max_answer_chars: longest boxed answer that is parsed at all.
        **task_kwargs: rewards, ``use_chat_template``, ``max_completion_chars`` (default 65536 here; see :class:`Task`).
    """

    name: ClassVar[str] = "math"
    required_columns: ClassVar[tuple[str, ...]] = ("problem", "answer")
    hub_dataset: ClassVar[str | None] = "HuggingFaceH4/MATH-500"
    #: long chains of thought; extraction is one rfind
    default_max_completion_chars: ClassVar[int] = 65536

    def __init__(self, timeout_seconds: int = 5, max_answer_chars: int = 1000, **task_kwargs: Any) -> None:
        super().__init__(**task_kwargs)
        if int(timeout_seconds) < 1:
            raise ValueError(f"timeout_seconds must be a whole number of seconds >= 1, got {timeout_seconds}")
        self.timeout_seconds = int(timeout_seconds)
        self.max_answer_chars = int(max_answer_chars)
        _math_verify()  # fail at construction, with the install hint, rather than at the first reward

    def prompt(self, example: dict[str, Any]) -> str:
        return f"{example['problem'].strip()}\n{INSTRUCTION}"

    def extract_answer(self, completion: str) -> str | None:
        return last_boxed(completion, self.max_answer_chars)

    def vote_key(self, answer: str, example: dict[str, Any]) -> Hashable | None:
        """math-verify's own reading of the boxed answer, so that what it judges equal mostly votes together.

        The first element of ``math_verify.parse`` is a SymPy object whose printed form is already canonical for
        much of what the verifier equates (``\\frac12``/``\\dfrac{1}{2}``/``0.5``, ``1+x``/``x+1``, ``2,000``/``2000``,
        ``\\{2,1\\}``/``\\{1,2\\}``); numbers are keyed by their exact rational value, so the ``Float`` ``0.50``
        joins ``1/2``. Cheap: the parse is the cached one :meth:`check_answer` made while grading. What it misses
        (``\\frac{1}{\\sqrt{2}}`` vs ``\\sqrt{2}/2``, ``50\\%`` vs ``\\frac12``, which the verifier equates) votes
        apart: a weaker majority, not a wrong verdict.
        Unparseable answers vote as their text without spaces.
        """
        parsed = _parse_boxed(answer, self._timeout()) if len(answer) <= self.max_answer_chars else []
        if not parsed:
            return "".join(answer.split())
        value = parsed[0]
        if getattr(value, "is_Number", False) and value.is_finite:  # Integer, Rational, Float: the exact value
            import sympy

            rational = sympy.Rational(str(value))  # str: the Float's decimal digits, not its binary expansion
            return Fraction(int(rational.p), int(rational.q))
        return str(value)

    def preprocess(self, example: dict[str, Any]) -> dict[str, Any]:
        """The record unchanged; one without a reference answer (``None``, empty, or an empty ``\\boxed{}``) is refused
        in one line: it could never be answered correctly (``None`` read as the text ``"None"``); so is one without a
        problem text."""
        check_text(example, "problem", "MathTask record")
        answer = example["answer"]
        gold = "" if answer is None else str(answer).strip()
        if _BOX in gold:
            gold = last_boxed(gold, self.max_answer_chars) or ""
        if not gold:
            raise ValueError(
                f"MathTask record whose 'answer' column is {repr(answer)[:80]}, no reference answer: drop the row or fill it "
                "(e.g. \\frac{1}{2}), or map your dataset's answer column with data.column_mapping"
            )
        return example

    def check_answer(self, answer: str, example: dict[str, Any]) -> bool:
        gold = str(example["answer"]).strip()
        if _BOX in gold:  # a full reference solution rather than a final answer
            gold = last_boxed(gold, self.max_answer_chars) or ""
        if len(answer) > self.max_answer_chars or not gold:
            return False
        return _verified(gold, answer, self._timeout())

    def _timeout(self) -> int | None:
        """math-verify's timeouts use SIGALRM, which Python allows only in the main thread."""
        return self.timeout_seconds if threading.current_thread() is threading.main_thread() else None

    def __repr__(self) -> str:
        return f"MathTask(timeout_seconds={self.timeout_seconds}, max_answer_chars={self.max_answer_chars})"
