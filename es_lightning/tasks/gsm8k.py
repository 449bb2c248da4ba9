"""GSM8K grade-school math (Cobbe et al. 2021): a free-text solution ending in ``#### <number>``.

The answer is read strictly from the last ``#### <number>`` of the completion — the "strict-match" of lm-eval's
``gsm8k`` task and verl's GSM8K reward — with no fallback to "the last number in the text": a fallback would pay the
format reward (Ba et al. 2026 convention, :mod:`es_lightning.tasks.base`) to completions that ignored the instruction.
Numbers are compared exactly as fractions after removing thousands separators, ``$`` and a leading ``+``, so ``1,234``,
``$1234``, ``1234.0`` and ``1234.00`` are all ``1234``; nothing is ``eval``-ed.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from decimal import Decimal
from fractions import Fraction
from typing import Any, ClassVar

from es_lightning.tasks.base import Task

__all__ = ["GSM8KTask", "normalize_number"]

#: verl's GSM8K instruction (examples/data_preprocess/gsm8k.py): the answer goes after "####"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
#: a number right after "####": optional sign and "$" in either order, digits with thousands commas, optional decimals
#: ASCII digits only (``re.ASCII``), as verl's GSM8K reward reads them (``[0-9]``): ``#### ١٢٣٤`` is no answer, as in
#: Countdown and the arithmetic tasks
_AFTER_MARK = re.compile(r"\s*(?:\$\s*)?([-+]?)\s*(?:\$\s*)?(\d[\d,]*(?:\.\d+)?|\.\d+)", re.ASCII)
_MAX_NUMBER_CHARS = 40


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a number such as ``"$1,234.50"`` → ``"1234.5"``, or ``None`` if it is not one."""
    if not isinstance(text, str):
        return None
    match = _AFTER_MARK.match(text[: _MAX_NUMBER_CHARS + 8])
    if match is None:
        return None
    sign, digits = match.groups()
    digits = digits.replace(",", "")
    if len(digits) > _MAX_NUMBER_CHARS:
        return None
    value = Decimal(digits)  # an exact decimal: only digits and at most one "." reach here
    if sign == "-":
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


class GSM8KTask(Task):
    """GSM8K from the hub (``openai/gsm8k``, config ``main``: columns ``question`` and ``answer``).

    ``preprocess`` keeps ``answer`` (the reference solution) and adds ``gold``, its normalized final number. The prompt
    is the question plus verl's instruction to answer after ``####``; with ``use_chat_template`` the training module
    wraps it in the tokenizer's chat template.

    Args:
        **task_kwargs: rewards, ``use_chat_template``, ``max_completion_chars`` (default 65536 here; see :class:`Task`).
    """

    name: ClassVar[str] = "gsm8k"
    required_columns: ClassVar[tuple[str, ...]] = ("question", "answer")
    hub_dataset: ClassVar[str | None] = "openai/gsm8k"
    hub_config: ClassVar[str | None] = "main"

    def __init__(self, **task_kwargs: Any) -> None:
        task_kwargs.setdefault("max_completion_chars", 65536)  # chains of thought are long; extraction is one rfind
        super().__init__(**task_kwargs)

    def prompt(self, example: dict[str, Any]) -> str:
        return f"{example['question'].strip()}\n{INSTRUCTION}"

    @property
    def stop_strings(self) -> list[str]:
        # a base model that finished tends to start a new problem; instruct models end with EOS
        return ["\nQuestion:"]

    def extract_answer(self, completion: str) -> str | None:
        """The normalized number after the last ``####``; ``None`` when there is none."""
        mark = completion.rfind("####")
        if mark < 0:
            return None
        return normalize_number(completion[mark + 4 :])

    def vote_key(self, answer: str, example: dict[str, Any]) -> Hashable | None:
        """The final number as an exact fraction, the value :meth:`check_answer` compares: ``1,000``, ``$1000`` and
        ``1000.00`` vote together."""
        number = normalize_number(answer)
        return answer if number is None else Fraction(number)

    def check_answer(self, answer: str, example: dict[str, Any]) -> bool:
        gold = _gold_of(example["gold"] if example.get("gold") is not None else example["answer"])
        predicted = normalize_number(answer)
        return predicted is not None and gold is not None and Fraction(predicted) == Fraction(gold)

    def preprocess(self, example: dict[str, Any]) -> dict[str, Any]:
        gold = _gold_of(example["gold"] if example.get("gold") is not None else example["answer"])
        if gold is None:
            raise ValueError(
                "GSM8K record without a final '#### <number>' in its 'answer' column: "
                f"{str(example['answer'])[-80:]!r}. Map your dataset's columns to question/answer, or provide a 'gold' "
                "column with the final number"
            )
        return {**example, "gold": gold}


def _gold_of(reference: Any) -> str | None:
    reference = str(reference)
    mark = reference.rfind("####")
    return normalize_number(reference[mark + 4 :] if mark >= 0 else reference)
