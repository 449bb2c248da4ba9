"""Countdown: reach a target with each given number used once and ``+ - * /`` (TinyZero; Qiu et al. 2025, §4.1).

Two prompt formats:

* ``"compact"`` — for the built-in tiny character-level model, whose vocabulary is ``0-9 + - * / ( ) = > : .``, space
  and ``a-z``. Prompt ``"c:3 5 7>22="``, completion the bare expression ``"3*5+7"``, ended by the model's EOS token.
* ``"r1"`` — for instruct models, the TinyZero prompt (also used by Qiu et al. 2025): reasoning in ``<think>…</think>``,
  the equation in ``<answer>…</answer>``. Generation stops at ``</answer>`` (the stop string stays in the text).

Reward: ``correct_reward`` (1.0) for a correct equation, ``format_reward`` (0.1) for a well-formed but wrong one, 0
otherwise — Qiu et al.'s "correctness + 0.1 × format", with the correct case capped at 1.0 (Ba et al. 2026 convention,
see :mod:`es_lightning.tasks.base`). Examples follow the columns of the hub dataset ``Jiayi-Pan/Countdown-Tasks-3to4``:
``nums`` (list of int) and ``target`` (int); procedural examples add ``solutions`` and ``num_solutions``.
"""

from __future__ import annotations

import operator
import random
from collections import Counter
from collections.abc import Hashable
from fractions import Fraction
from typing import Any, ClassVar

from es_lightning.tasks.base import Task
from es_lightning.tasks.expressions import (
    MAX_EXPRESSION_CHARS,
    MAX_LITERAL_DIGITS,
    num_solutions,
    parse_expression,
    reachable_values,
    solutions_by_value,
    solve,
)

__all__ = ["CountdownTask", "solve", "num_solutions"]

PROMPT_FORMATS = ("compact", "r1")
#: default ``max_completion_chars`` for reasoning formats (~16k tokens); parsing only scans the tail, so it stays cheap
LONG_COMPLETION_CHARS = 65536
#: longest target text a record may hold: no value of at most ``MAX_VALUE_BITS`` (1024) bits has more than 309 digits
_MAX_TARGET_CHARS = 400

# TinyZero's Countdown prompt (examples/data_preprocess/countdown.py), base-model and instruct (chat) variants.
_R1_INSTRUCTION = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic operations "
    "(+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And return the "
    "final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
_R1_BASE_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer.\n"
    "User: {instruction}\nAssistant: Let me solve this step by step.\n<think>"
)


class CountdownTask(Task):
    """Countdown with an exact, ``eval``-free verifier and a procedural generator of solvable instances.

    Args:
        prompt_format: ``"compact"`` (built-in char model) or ``"r1"`` (TinyZero ``<think>/<answer>`` prompt).
        num_numbers: how many numbers a procedural instance has (2–5; 3 is the tiny-model default, the hub set has 3–4).
        min_number, max_number: range of the procedural numbers (default 1..20: two digits keep the prompt short
            for a character-level model while leaving ~40–70 reachable targets per instance); ``max_number`` below
            10**12, the longest number (``MAX_LITERAL_DIGITS``) the verifier reads in an answer.
        min_target, max_target: procedural targets are integers in this range (default 1..100). The target is drawn
            uniformly among the *reachable* integers in range, like TinyZero's generator, which redraws unsolvable
            instances; so every instance is solvable.
        **task_kwargs: rewards, ``use_chat_template``, ``max_completion_chars`` (see :class:`Task`; 65536 by default
            for ``"r1"``).

    Solution normal form: answers equal up to commutativity/associativity of ``+``/``*`` and moving signs and
    reciprocals through brackets are one solution (``3+2+1`` = ``1+(2+3)``), so ``extract_answer`` of a correct
    completion is one of the example's ``solutions`` (``distinct_correct`` of the analyses counts these).

    Maj@k votes on the value reached and the numbers used (:meth:`vote_key`), not on one expression: for ``nums``
    ``[1, 2, 3]`` and target 6 the different solutions ``1+2+3`` and ``1*2*3`` vote together.
    """

    name: ClassVar[str] = "countdown"
    required_columns: ClassVar[tuple[str, ...]] = ("nums", "target")
    hub_dataset: ClassVar[str | None] = "Jiayi-Pan/Countdown-Tasks-3to4"

    def __init__(
        self,
        prompt_format: str = "compact",
        num_numbers: int = 3,
        min_number: int = 1,
        max_number: int = 20,
        min_target: int = 1,
        max_target: int = 100,
        **task_kwargs: Any,
    ) -> None:
        if prompt_format == "r1" and task_kwargs.get("max_completion_chars") is None:  # None: the format's own bound
            task_kwargs["max_completion_chars"] = LONG_COMPLETION_CHARS  # long reasoning, not the compact model's bound
        super().__init__(**task_kwargs)
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        if not 2 <= num_numbers <= 5:
            raise ValueError(f"num_numbers must be between 2 and 5 (the solver is exhaustive), got {num_numbers}")
        if not 0 <= min_number <= max_number:
            raise ValueError(f"need 0 <= min_number <= max_number, got {min_number}..{max_number}")
        if max_number >= 10**MAX_LITERAL_DIGITS:  # the verifier reads numbers of at most MAX_LITERAL_DIGITS digits
            raise ValueError(f"max_number must be below 10**{MAX_LITERAL_DIGITS} (answers are read with numbers of at "
                             f"most {MAX_LITERAL_DIGITS} digits), got {max_number}")
        if not min_target <= max_target:
            raise ValueError(f"need min_target <= max_target, got {min_target}..{max_target}")
        self.prompt_format = prompt_format
        self.num_numbers = int(num_numbers)
        self.min_number, self.max_number = int(min_number), int(max_number)
        self.min_target, self.max_target = int(min_target), int(max_target)

    # ----------------------------------------------------------------- prompt and stop
    def prompt(self, example: dict[str, Any]) -> str:
        if self.prompt_format == "compact":
            return _compact_prompt(example)
        nums = [int(x) for x in example["nums"]]
        instruction = _R1_INSTRUCTION.format(nums=nums, target=example["target"])
        # with a chat template the module wraps the user turn itself; the completion then opens with <think>
        return instruction if self.use_chat_template else _R1_BASE_TEMPLATE.format(instruction=instruction)

    def pool_key(self, example: dict[str, Any]) -> str:
        """The compact prompt (``c:3 5 7>22=``), whatever the format and template: the built-in model's pretraining
        and every format share one train / held-out split of the problems."""
        return _compact_prompt(example)

    @property
    def stop_strings(self) -> list[str]:
        return ["</answer>"] if self.prompt_format == "r1" else []

    # ----------------------------------------------------------------- answer and verifier
    def extract_answer(self, completion: str) -> str | None:
        """Compact: the whole completion must be an expression. r1: the last ``<answer>`` after ``</think>``.

        Returns the solution normal form when the expression is well-formed and evaluable, the expression with
        spaces removed when it divides by zero, and for r1 the raw (stripped) answer text when it is not an
        expression at all (the think/answer layout alone earns the format reward, as in Qiu et al.). ``None``: no
        answer in the expected layout.
        """
        if self.prompt_format == "compact":
            parsed = parse_expression(completion.strip())
            if parsed is None:
                return None
            return _canonical(parsed, completion)
        content = _r1_answer(completion)
        if content is None:
            return None
        parsed = parse_expression(content)
        return content if parsed is None else _canonical(parsed, content)

    def check_answer(self, answer: str, example: dict[str, Any]) -> bool:
        """Exact check: the literals are exactly the multiset ``nums`` and the value is exactly ``target``."""
        parsed = parse_expression(answer)
        if parsed is None or parsed.value is None:
            return False
        if Counter(parsed.literals) != Counter(int(x) for x in example["nums"]):
            return False
        target = example["target"]
        target = Fraction(target) if isinstance(target, int) else Fraction(str(target))
        return parsed.value == target

    def vote_key(self, answer: str, example: dict[str, Any]) -> Hashable | None:
        """``(value, sorted numbers used)`` of an evaluable expression; other answer text votes as itself.

        The question a Countdown completion answers is "which value do these numbers make", so two different
        expressions that reach the same value with the same multiset of numbers are one answer (self-consistency,
        Wang et al. 2023, votes on answers, not on reasoning paths): every correct solution of an instance votes for
        ``(target, nums)``, a wrong expression with the others that reach its value with its numbers. The key fixes
        the verdict (:meth:`check_answer` reads exactly the value and the numbers), as maj@k requires. Nothing is
        ``eval``-ed: the value comes from the same bounded parser as the verifier.
        """
        parsed = parse_expression(answer)
        if parsed is None or parsed.value is None:  # not an expression, or it divides by zero: never correct
            return answer
        return parsed.value, tuple(sorted(parsed.literals))

    # ----------------------------------------------------------------- data
    def preprocess(self, example: dict[str, Any]) -> dict[str, Any]:
        """``nums`` as a list of ints (a text such as ``"[3, 5, 7]"`` is read too) and an integer text or integral
        float ``target`` as an int. A record whose numbers are not non-negative integers of at most ``MAX_LITERAL_DIGITS`` digits, or whose
        target is not a number, is refused (ValueError naming the column): it could never be answered correctly."""
        nums = _record_numbers(example["nums"])
        if nums is None:
            raise ValueError(
                f"Countdown record whose 'nums' column is {_shown(example['nums'])}, not a list of non-negative integers "
                f"(of at most {MAX_LITERAL_DIGITS} digits): fix the column (e.g. [3, 5, 7]), or map your dataset's "
                "columns to nums/target with data.column_mapping"
            )
        target = example["target"]
        if isinstance(target, str) and len(target) <= _MAX_TARGET_CHARS and target.strip().lstrip("-").isdecimal():
            target = int(target)  # other non-integers (e.g. "27.4") stay as they are; check_answer reads them exactly
        elif isinstance(target, float) and target.is_integer():
            target = int(target)  # a csv column with an empty cell reads as floats: 74.0 is the problem "…>74="
        if not _is_number(target):
            raise ValueError(
                f"Countdown record whose 'target' column is {_shown(example['target'])}, not a number: fix the column "
                "(e.g. 22), or map your dataset's columns to nums/target with data.column_mapping"
            )
        return {**example, "nums": nums, "target": target}

    def procedural(self, num_examples: int, seed: int) -> list[dict[str, Any]]:
        """``num_examples`` solvable instances, a pure function of ``seed`` (``random.Random(seed)``).

        Numbers are drawn i.i.d. uniform in ``[min_number, max_number]``, the target uniformly among the reachable
        integers in ``[min_target, max_target]`` (numbers with none are redrawn). Each example lists all its
        ``solutions``. Solutions are cached per multiset of numbers, so 20k three-number instances take seconds.
        """
        rng = random.Random(seed)
        cache: dict[tuple[int, ...], dict[int, list[str]] | list[int]] = {}
        examples: list[dict[str, Any]] = []
        attempts = 0
        while len(examples) < num_examples:
            attempts += 1
            if attempts > 100 * num_examples + 1000:
                raise ValueError(
                    f"could not generate solvable Countdown instances with numbers {self.min_number}..{self.max_number}"
                    f" and targets {self.min_target}..{self.max_target}; widen the target range"
                )
            nums = [rng.randint(self.min_number, self.max_number) for _ in range(self.num_numbers)]
            key = tuple(sorted(nums))
            if key not in cache:
                cache[key] = self._targets(key)
            entry = cache[key]
            if not entry:
                continue
            targets = sorted(entry)
            target = targets[rng.randrange(len(targets))]
            solutions = entry[target] if isinstance(entry, dict) else solve(key, target)
            examples.append(
                {"nums": nums, "target": target, "solutions": list(solutions), "num_solutions": len(solutions)}
            )
        return examples

    def _targets(self, key: tuple[int, ...]) -> dict[int, list[str]] | list[int]:
        """In-range integer targets of a multiset: with their solutions (≤ 3 numbers, cheap), else targets only."""

        def in_range(v: Fraction) -> bool:
            return v.denominator == 1 and self.min_target <= v <= self.max_target

        if len(key) <= 3:
            return {int(v): s for v, s in solutions_by_value(key).items() if in_range(v)}
        return [int(v) for v in reachable_values(key) if in_range(v)]

    def __repr__(self) -> str:
        return (
            f"CountdownTask(prompt_format={self.prompt_format!r}, num_numbers={self.num_numbers}, "
            f"numbers={self.min_number}..{self.max_number}, targets={self.min_target}..{self.max_target})"
        )


def _canonical(parsed, original: str) -> str:
    if parsed.value is None:  # keep the original: its normal form could hide a division by zero
        return "".join(original.split())
    return parsed.normal.text


def _r1_answer(completion: str) -> str | None:
    """The last ``<answer>…</answer>`` when it closes the completion and follows the ``</think>`` that ends the
    reasoning; ``None`` otherwise. The completion may start inside ``<think>`` (the base prompt ends with it).
    Any whitespace may separate ``</think>`` and ``<answer>`` (Qiu et al. require exactly one newline)."""
    text = completion.rstrip()
    if not text.endswith("</answer>"):
        return None
    start = text.rfind("<answer>")
    if start < 0:
        return None
    head = text[:start].rstrip()
    if not head.endswith("</think>") or head.count("</think>") != 1:
        return None
    if head.count("<think>") > 1:
        return None
    content = text[start + len("<answer>") : -len("</answer>")].strip()
    if not content or len(content) > MAX_EXPRESSION_CHARS or "</answer>" in content:
        return None
    return content


def _compact_prompt(example: dict[str, Any]) -> str:
    """``c:3 5 7>22=``: the built-in model's prompt, and every format's problem identity (:meth:`CountdownTask.pool_key`)."""
    return f"c:{' '.join(str(int(x)) for x in example['nums'])}>{example['target']}="


def _record_numbers(value: Any) -> list[int] | None:
    """A record's ``nums`` as non-negative ints of at most ``MAX_LITERAL_DIGITS`` digits, or ``None``: a list (or
    tuple) of integers, integral floats or digit texts, or a text that lists them (``"[3, 5, 7]"``, ``"3 5 7"``)."""
    if isinstance(value, str):  # a jsonl/csv that stored the list as text
        tokens = value.strip("[]() ").replace(",", " ").split()
        if not all(_digits(tok) for tok in tokens):
            return None
        value = [int(tok) for tok in tokens]
    if not isinstance(value, (list, tuple)) or not value:
        return None
    nums = []
    for x in value:
        if isinstance(x, str) and _digits(x.strip()):
            x = int(x)
        elif isinstance(x, float) and x.is_integer():
            x = int(x)
        if isinstance(x, bool) or not hasattr(x, "__index__"):  # an int, a numpy integer; not a text, None, 2.5
            return None
        x = operator.index(x)
        if not 0 <= x < 10**MAX_LITERAL_DIGITS:
            return None
        nums.append(x)
    return nums


def _digits(text: str) -> bool:
    """Whether ``text`` is a natural number in ASCII digits short enough to read (``int`` of a long text is slow)."""
    return text.isascii() and text.isdigit() and len(text.lstrip("0")) <= MAX_LITERAL_DIGITS


def _is_number(value: Any) -> bool:
    """Whether ``check_answer`` can read ``value`` as an exact number (an int, a finite float or a decimal text)."""
    if isinstance(value, bool):
        return False
    if hasattr(value, "__index__"):  # an int, a numpy integer
        return True
    if not isinstance(value, (float, str)) or len(str(value)) > _MAX_TARGET_CHARS:
        return False
    try:
        Fraction(str(value))
    except (ValueError, OverflowError):  # "abc", "nan", "inf"
        return False
    return True


def _shown(value: Any) -> str:
    """``value`` as a message shows it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
