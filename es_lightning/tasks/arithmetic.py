"""Two procedural tasks for the built-in character model that are *not* Countdown: addition and sorting.

They share Countdown's compact vocabulary (digits, ``+ = : >``, space, ``a-z``) but exercise different skills (carrying;
comparison and copying), which makes them (1) a forgetting probe — does ES or GRPO on Countdown erase them? — in the
spirit of Qiu et al. 2025's observation that ES fine-tuning drifts less from the base model, and (2) part of the
pretraining mixture that gives the tiny model something to forget. Each example carries ``solutions`` (the single
correct string), the same field Countdown's generator fills, so a pretraining recipe reads targets uniformly.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from es_lightning.tasks.base import Task

__all__ = ["AdditionTask", "SortTask"]

#: bounds of what the verifiers read, sized so that every setting the constructors accept has answers that fit: a
#: number has at most 19 digits (the sum of two 18-digit addends; ``SortTask.max_value`` < 10**19), an answer at most
#: 1024 characters (32 sorted numbers of 19 digits and their spaces are 639)
_MAX_DIGITS = 19
_MAX_ANSWER_CHARS = 1024


def _parse_naturals(text: str, max_count: int) -> list[int] | None:
    """Space-separated non-negative ASCII integers (at most ``max_count``), or ``None``."""
    text = text.strip()
    if not text or len(text) > _MAX_ANSWER_CHARS:
        return None
    tokens = text.split()
    if len(tokens) > max_count or not all(tok.isascii() and tok.isdigit() and len(tok) <= _MAX_DIGITS for tok in tokens):
        return None
    return [int(tok) for tok in tokens]


class AdditionTask(Task):
    """``a:{x}+{y}=`` → the decimal sum, e.g. ``"a:57+8="`` → ``"65"``.

    Args:
        max_digits: operands have 1..``max_digits`` digits (at most 18: a sum has one digit more). The digit count is
            drawn uniformly first, then the value, so short operands are as common as long ones (uniform values would
            make almost all of them long).
        **task_kwargs: see :class:`Task`.
    """

    name: ClassVar[str] = "addition"
    required_columns: ClassVar[tuple[str, ...]] = ("x", "y")

    def __init__(self, max_digits: int = 3, **task_kwargs: Any) -> None:
        super().__init__(**task_kwargs)
        if not 1 <= max_digits <= _MAX_DIGITS - 1:  # the sum has one digit more, and answers are read up to _MAX_DIGITS
            raise ValueError(f"max_digits must be between 1 and {_MAX_DIGITS - 1}, got {max_digits}")
        self.max_digits = int(max_digits)

    def prompt(self, example: dict[str, Any]) -> str:
        return f"a:{int(example['x'])}+{int(example['y'])}="

    def extract_answer(self, completion: str) -> str | None:
        numbers = _parse_naturals(completion, max_count=1)
        return None if numbers is None else str(numbers[0])

    def check_answer(self, answer: str, example: dict[str, Any]) -> bool:
        numbers = _parse_naturals(answer, max_count=1)
        return numbers is not None and numbers[0] == int(example["x"]) + int(example["y"])

    def procedural(self, num_examples: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)

        def operand() -> int:
            digits = rng.randint(1, self.max_digits)
            return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

        examples = []
        for _ in range(num_examples):
            x, y = operand(), operand()
            examples.append({"x": x, "y": y, "solutions": [str(x + y)], "num_solutions": 1})
        return examples

    def __repr__(self) -> str:
        return f"AdditionTask(max_digits={self.max_digits})"


class SortTask(Task):
    """``s:{d1} {d2} ...=`` → the numbers in ascending order, space separated: ``"s:42 7 19 7="`` → ``"7 7 19 42"``.

    Args:
        min_length, max_length: how many numbers (drawn uniformly; default 4–6).
        max_value: numbers are drawn uniformly from ``0..max_value`` with repetition (default 99: two digits; at most
            10**19 - 1, the 19 digits an answer's numbers are read up to).
        **task_kwargs: see :class:`Task`.
    """

    name: ClassVar[str] = "sort"
    required_columns: ClassVar[tuple[str, ...]] = ("nums",)

    def __init__(self, min_length: int = 4, max_length: int = 6, max_value: int = 99, **task_kwargs: Any) -> None:
        super().__init__(**task_kwargs)
        if not 1 <= min_length <= max_length <= 32:
            raise ValueError(f"need 1 <= min_length <= max_length <= 32, got {min_length}..{max_length}")
        if not 0 <= max_value < 10**_MAX_DIGITS:
            raise ValueError(f"max_value must be between 0 and 10**{_MAX_DIGITS} - 1 (answers are read as numbers of at "
                             f"most {_MAX_DIGITS} digits), got {max_value}")
        self.min_length, self.max_length, self.max_value = int(min_length), int(max_length), int(max_value)

    def prompt(self, example: dict[str, Any]) -> str:
        return f"s:{' '.join(str(int(x)) for x in example['nums'])}="

    def extract_answer(self, completion: str) -> str | None:
        numbers = _parse_naturals(completion, max_count=64)
        return None if numbers is None else " ".join(map(str, numbers))

    def check_answer(self, answer: str, example: dict[str, Any]) -> bool:
        numbers = _parse_naturals(answer, max_count=64)
        return numbers is not None and numbers == sorted(int(x) for x in example["nums"])

    def procedural(self, num_examples: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        examples = []
        for _ in range(num_examples):
            nums = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_length, self.max_length))]
            examples.append({"nums": nums, "solutions": [" ".join(map(str, sorted(nums)))], "num_solutions": 1})
        return examples

    def __repr__(self) -> str:
        return f"SortTask(length={self.min_length}..{self.max_length}, max_value={self.max_value})"
