"""GSM8K grade-school math (Cobbe et al. 2021): a free-text solution ending in ``#### <number>``.

The answer is read strictly from the last ``#### <number>`` of the completion, as verl's GSM8K reward reads it
(lm-eval's ``gsm8k`` "strict-match" reads the same mark but takes the first one: a completion that revises its answer
is graded on the revision here) — with no fallback to "the last number in the text": a fallback would pay the
format reward (Ba et al. 2026 convention, :mod:`es_lightning.tasks.base`) to completions that ignored the instruction.
Numbers are compared exactly as fractions after removing thousands separators, ``$`` and a leading ``+``, so ``1,234``,
``1 234``, ``$1234``, ``1234.0`` and ``1234.00`` are all ``1234``, ``3/4`` is ``0.75`` (never ``3``), the mixed number
``1 1/2`` and ``1½`` are ``1.5`` (never ``1``); a comma that groups no thousands (``12,34``, a decimal comma) makes no
number, and a space that groups no thousands ends one (``12 3456`` is 12, never 123456) unless the number's thousands
are already grouped by spaces (``1 000 0000``: a broken grouping, no number, never 1000), and a number grouped by
spaces before a hyphen is no number (``5 200-liter tanks`` is five tanks, ``1 000-page book`` a thousand pages: never 5
nor 5200); a power (``10³``, ``1e3``) is no GSM8K answer form and makes no number (never 10), as a superscript
fraction ``1¹/₂`` does (never 1), the gold answer's and the completion's alike. Nothing is ``eval``-ed.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from decimal import Decimal
from fractions import Fraction
from typing import Any, ClassVar

from es_lightning.tasks.base import Task, check_text

__all__ = ["GSM8KTask", "normalize_number"]

#: verl's GSM8K instruction (examples/data_preprocess/gsm8k.py): the answer goes after "####"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
#: what groups thousands by spaces: a space, a no-break space, a thin space or a narrow no-break space (SI's ``1 234``)
_SPACE = "[ \u00a0\u2009\u202f]"
#: a group of exactly three digits after a space (``1 000``; ``1 00`` and ``12 3456`` group nothing)
_SPACE_GROUP = _SPACE + r"\d{3}(?!\d)"
#: the whole part of a number: thousands grouped by commas (1,234,567, or India's 12,34,567), by spaces (1 234 567,
#: as math-verify reads them) or plain digits, never followed by another group of digits: ``12,34`` (a decimal comma),
#: ``1,2345`` and ``1234,567`` are no number, not 1234. A space is also a word's end, so a space before anything but a
#: group of three digits ends a number of plain digits (``12 3456`` and ``3 4`` are 12 and 3, ``5 2-liter bottles``
#: is 5: no grouping begun), and plain digits followed by a group (``1234 567``, or ``1 000,5`` once the grouped reading
#: is refused) are no number, never a prefix of it; a number grouped by spaces followed by more digits after a space
#: (``1 000 0000``) is no number either (:data:`_NOT_AFTER_SPACE_GROUPS`)
_WHOLE = (r"(?:\d{1,3}(?:,\d{3})+|\d{1,2}(?:,\d{2})+,\d{3}|\d{1,3}(?:" + _SPACE_GROUP + r")+|\d+(?!" + _SPACE_GROUP
          + r"))(?!,?\d)")
#: the unicode vulgar fractions and their values: ``1½`` is 1.5, ``2 ¾`` 2.75 and ``½`` 0.5
_VULGAR = {"\u00bc": Fraction(1, 4), "\u00bd": Fraction(1, 2), "\u00be": Fraction(3, 4), "\u2150": Fraction(1, 7),
           "\u2151": Fraction(1, 9), "\u2152": Fraction(1, 10), "\u2153": Fraction(1, 3), "\u2154": Fraction(2, 3),
           "\u2155": Fraction(1, 5), "\u2156": Fraction(2, 5), "\u2157": Fraction(3, 5), "\u2158": Fraction(4, 5),
           "\u2159": Fraction(1, 6), "\u215a": Fraction(5, 6), "\u215b": Fraction(1, 8), "\u215c": Fraction(3, 8),
           "\u215d": Fraction(5, 8), "\u215e": Fraction(7, 8)}
_VULGAR_CLASS = "[" + "".join(_VULGAR) + "]"
#: a number right after "####": optional sign and "$" in either order, the whole part, optional decimals
#: ASCII digits only (``re.ASCII``), as verl's GSM8K reward reads them (``[0-9]``): ``#### ١٢٣٤`` is no answer, as in
#: Countdown and the arithmetic tasks
#: a fraction ``3/4`` is read whole (as 0.75), never as its numerator, also at the end of a sentence (``3/4.``, as
#: ``18.`` is 18), and so is a mixed number ``1 1/2`` or ``1½`` (1.5, never 1) and a vulgar fraction alone (``½``);
#: an exponent (``1e3``) is no GSM8K number
_AFTER_MARK = re.compile(
    r"\s*(?:\$\s*)?([-+]?)\s*(?:\$\s*)?(?:(" + _WHOLE + r"(?:\.\d+)?|\.\d+)"
    r"(?:[ \t]+(\d+)[ \t]*/[ \t]*(\d+)(?!\d|\.\d)|\s*/\s*(\d+)(?!\d|\.\d)|[ \t]*(" + _VULGAR_CLASS + r"))?"
    r"|(" + _VULGAR_CLASS + r"))", re.ASCII)
#: what may not follow a number: an exponent, a slash that does not make a fraction (``3/4.5``, ``10/10/2020``), more
#: digits after a comma or a point (``1.234,56``, ``1.2.3``), digits — of any script: ``1٢٣`` and ``12１`` are not 1
#: and 12 — or another vulgar fraction after a vulgar fraction (``1½3``, ``1½½``), a fraction written with a fraction
#: or division slash (``1⁄2``, ``1⅟2``), which is not 1, or a superscript or subscript (a power ``10³`` or ``2ⁿ``, a
#: fraction ``1¹/₂``: not 10, 2 or 1; ``5 m²`` is 5)
_NOT_AFTER = re.compile(r"[eE][-+]?\d|\s*/\s*[\d.]|[,.]?(?u:\d)"
                        r"|[ \t]*[\u00bc-\u00be\u2150-\u215f\u2189\u2044\u2215\u00b2\u00b3\u00b9\u2070-\u209c]", re.ASCII)
#: what may not follow a number whose thousands are grouped by spaces: more digits after a space. Once a space has
#: grouped three digits the spaces group thousands, so digits after the next one are one more group of other than three
#: digits, a broken grouping — ``1 000 0000``, ``1 000 00``: no number, as ``1234 567`` (a first part of four digits)
#: is, never 1000 — where a space after plain digits (``12 3456``, ``3 4``) began no grouping and ends the number
#: as a word's end; a mixed number's fraction (``1 000 1/2``) is part of the number.
#: Nor a hyphen: the last group is then the first word of a compound (``5 200-liter tanks``: five tanks of 200 litres,
#: ``1 000-page book``: one book of a thousand pages), and the same spelling means the first number or the whole one,
#: which no reader tells apart: no number, as ``1 100/200`` is, never 5200 nor 1 (either reading pays a wrong answer
#: for one of them). GSM8K's own answers are plain integers; ``5,200-liter`` and ``5 2-liter`` are 5200 and 5
_NOT_AFTER_SPACE_GROUPS = re.compile(r"[ \t\u00a0\u2009\u202f]+\d|[-\u2010\u2011]")
_MAX_NUMBER_CHARS = 40


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a number such as ``"$1,234.50"`` → ``"1234.5"``, or ``None`` if it is not one.

    A fraction is its exact value: ``"3/4"`` → ``"0.75"``, ``"1/3"`` → ``"1/3"`` (reading ``3/4`` as ``3`` paid a
    completion that wrote ``3/4`` for a gold of 3, and turned a reference answer ``3/4`` into a gold of 3), and so is a
    mixed number: ``"1 1/2"`` → ``"1.5"``, ``"1½"`` → ``"1.5"``. Thousands grouped by spaces are one number:
    ``"12 345 678"`` → ``"12345678"``, but a space before anything other than three digits ends it: ``"12 3456"`` →
    ``"12"``, and digits after a space that follows a group (``"1 000 0000"``) are a broken grouping: ``None``, as
    for ``"1234 567"``. A number grouped by spaces right before a hyphen is ``None``: ``"5 200-liter tanks"`` (five
    200-litre tanks) and ``"1 000-page book"`` (a thousand pages) are one spelling, and reading either as the first
    number or the whole one would pay a wrong answer for the other. A number written with an exponent (``1e3``), with
    commas that group no thousands (``12,34``), with a fraction slash (``1⁄2``) or followed by a superscript or
    subscript (a power ``10³``, a fraction ``1¹/₂``) is not one (``None``), nor is ``1 100/200`` (1100/200 or
    1 + 100/200)."""
    if not isinstance(text, str):
        return None
    head = text[: 4 * _MAX_NUMBER_CHARS + 16]  # room for a mixed number's three parts, with thousands commas
    match = _AFTER_MARK.match(head)
    if match is None or match.end() > len(head) - 8 and len(text) > len(head) or _NOT_AFTER.match(head, match.end()):
        return None  # no number, one that may run on past the head (a cut denominator), or one followed by more
    sign, digits, numerator, denominator, divisor, vulgar, alone = match.groups()
    if alone is not None:  # a vulgar fraction alone: ½
        digits, vulgar = "0", alone
    grouped_by_spaces = re.search(_SPACE, digits) is not None
    if grouped_by_spaces and _NOT_AFTER_SPACE_GROUPS.match(head, match.end()):
        return None  # 1 000 0000: a broken grouping; 5 200-liter: five 200-litre tanks, or 5200 litres?
    digits = re.sub("[," + _SPACE[1:], "", digits)
    if max(len(digits), len(numerator or ""), len(denominator or ""), len(divisor or "")) > _MAX_NUMBER_CHARS:
        return None
    value = Decimal(digits)  # an exact decimal: only digits and at most one "." reach here
    exact = None
    if numerator is not None:  # a mixed number: a whole number and a proper fraction (1 1/2), else no number
        if "." in digits or not 0 < int(numerator) < int(denominator):
            return None
        exact = Fraction(value) + Fraction(int(numerator), int(denominator))
    elif vulgar is not None:  # a mixed number with a vulgar fraction (1½); 1.5½ is none
        if "." in digits:
            return None
        exact = Fraction(value) + _VULGAR[vulgar]
    elif divisor is not None:
        if int(divisor) == 0 or grouped_by_spaces:  # 1 100/200: 1100/200 or 1 + 100/200? no number
            return None
        exact = Fraction(value) / int(divisor)
    if exact is not None:
        if sign == "-":
            exact = -exact
        q = exact.denominator
        while q % 2 == 0:
            q //= 2
        while q % 5 == 0:
            q //= 5
        if q != 1:  # no finite decimal: the fraction itself, in lowest terms
            return f"{exact.numerator}/{exact.denominator}"
        value = Decimal(exact.numerator) / Decimal(exact.denominator)  # exact: the denominator is 2^a 5^b
    elif sign == "-":
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


class GSM8KTask(Task):
    """GSM8K from the hub (``openai/gsm8k``, config ``main``: columns ``question`` and ``answer``).

    ``preprocess`` keeps ``answer`` (the reference solution) and adds ``gold``, its normalized final number. The prompt
    is the question plus verl's instruction to answer after ``####``; with ``use_chat_template`` the training module
    wraps it in the tokenizer's chat template.

    Options: :class:`Task`'s (rewards, ``use_chat_template``, ``max_completion_chars``: 65536 here by default).
    """

    name: ClassVar[str] = "gsm8k"
    required_columns: ClassVar[tuple[str, ...]] = ("question", "answer")
    hub_dataset: ClassVar[str | None] = "openai/gsm8k"
    hub_config: ClassVar[str | None] = "main"
    #: chains of thought are long; extraction is one rfind
    default_max_completion_chars: ClassVar[int] = 65536

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
        check_text(example, "question", "GSM8K record")
        gold = _gold_of(example["gold"] if example.get("gold") is not None else example["answer"])
        if gold is None:
            raise ValueError(
                "GSM8K record without a final '#### <number>' (or a plain number: 12, -3.5, 3/4) in its 'answer' "
                f"column: {str(example['answer'])[-80:]!r}. Map your dataset's columns to question/answer, or provide "
                "a 'gold' column with the final number"
            )
        return {**example, "gold": gold}


def _gold_of(reference: Any) -> str | None:
    reference = str(reference)
    mark = reference.rfind("####")
    return normalize_number(reference[mark + 4 :] if mark >= 0 else reference)
