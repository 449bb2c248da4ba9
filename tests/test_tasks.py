"""Tasks: the Countdown solver against an independent brute force; verifiers on real and hostile completions."""

from __future__ import annotations

import itertools
import json
import random
import re
import time
import warnings
from fractions import Fraction

import pytest

from es_lightning.tasks import (
    TASKS,
    AdditionTask,
    CountdownTask,
    GSM8KTask,
    MathTask,
    SortTask,
    Task,
    get_task,
)
from es_lightning.tasks.expressions import num_solutions, parse_expression, reachable_values, solve

COMPACT_VOCAB = set("0123456789+-*/()=>:. abcdefghijklmnopqrstuvwxyz")
OPS = "+-*/"


# ------------------------------------------------------------------------------------------ independent brute force
def _brute_force(nums: list[int]) -> dict[Fraction, list[str]]:
    """Every fully parenthesised expression over ``nums``, by value (24-game style: merge an ordered pair, recurse)."""
    out: dict[Fraction, list[str]] = {}

    def rec(items: list[tuple[Fraction, str]]) -> None:
        if len(items) == 1:
            out.setdefault(items[0][0], []).append(items[0][1])
            return
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, sa), (b, sb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            for op in OPS:
                if op == "/" and b == 0:
                    continue
                value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
                rec([*rest, (value, f"({sa}{op}{sb})")])

    rec([(Fraction(x), str(x)) for x in nums])
    return out


def _fraction_eval(expression: str) -> Fraction:
    """Test-only evaluator of trusted solver output (the package itself never evals)."""
    assert re.fullmatch(r"[0-9+\-*/()]+", expression), expression
    return eval(re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expression), {"Fraction": Fraction})


def test_solver_hand_cases():
    assert {"1+2+3", "1*2*3"} <= set(solve([1, 2, 3], 6))
    assert solve([1, 2, 3], 6) == ["1*2*3", "1+2+3", "2*3/1"]  # ×1 and ÷1 are different uses of the 1
    assert solve([3, 3, 8, 8], 24) == ["8/(3-8/3)"]  # the classic hard 24-game instance
    assert solve([2, 2, 3], 1) == ["2*2-3", "2+2-3"]  # duplicate numbers: no duplicate solutions
    assert solve([5, 7, 11], 1000) == [] and num_solutions([5, 7, 11], 1000) == 0
    assert num_solutions([1, 2, 3], 6) == 3


@pytest.mark.parametrize("seed", range(6))
def test_solver_matches_brute_force(seed):
    rng = random.Random(seed)
    nums = [rng.randint(0 if seed == 0 else 1, 12) for _ in range(3)]
    brute = _brute_force(nums)
    assert reachable_values(nums) == set(brute)
    for value, expressions in brute.items():
        solutions = solve(nums, value)
        # complete: every brute-force expression normalises to a listed solution
        assert {parse_expression(e).normal.text for e in expressions} == set(solutions)
        # sound: every listed solution is exact and uses each number once
        for s in solutions:
            assert _fraction_eval(s) == value
            assert sorted(map(int, re.findall(r"\d+", s))) == sorted(nums)


def test_solver_matches_brute_force_four_numbers():
    nums = [2, 3, 5, 7]
    brute = _brute_force(nums)
    assert reachable_values(nums) == set(brute)
    for target in (1, 24, 41, Fraction(7, 30)):
        expected = {parse_expression(e).normal.text for e in brute.get(Fraction(target), [])}
        assert set(solve(nums, target)) == expected and expected


# ------------------------------------------------------------------------------------------ Countdown task
def test_countdown_procedural_is_solvable_and_deterministic():
    task = CountdownTask()
    examples = task.procedural(300, seed=7)
    assert examples == task.procedural(300, seed=7)
    assert examples != task.procedural(300, seed=8)
    for ex in examples:
        assert len(ex["nums"]) == 3 and all(1 <= x <= 20 for x in ex["nums"])
        assert isinstance(ex["target"], int) and 1 <= ex["target"] <= 100
        assert ex["solutions"] == solve(ex["nums"], ex["target"]) and ex["num_solutions"] == len(ex["solutions"]) > 0
        assert set(task.prompt(ex)) <= COMPACT_VOCAB
        for s in ex["solutions"]:
            assert task.reward([s], [ex]) == [1.0]


def test_countdown_procedural_four_numbers():
    task = CountdownTask(num_numbers=4, max_target=50)
    for ex in task.procedural(5, seed=0):
        assert len(ex["nums"]) == 4 and ex["solutions"]
        assert all(task.is_correct(s, ex) for s in ex["solutions"])


def test_countdown_compact_extraction_and_rewards():
    task = CountdownTask()
    ex = {"nums": [3, 5, 7], "target": 22}
    assert task.prompt(ex) == "c:3 5 7>22="
    assert task.stop_strings == []
    assert task.extract_answer(" 7 + 3 * 5\n") == "7+3*5"  # normal form: numbers first, then products
    assert task.extract_answer("5*3+7") == task.extract_answer("(3*5)+7") == "7+3*5"
    assert task.extract_answer("3*5+7=22") is None
    assert task.reward(["3*5+7", "(5*3)+7 ", "3+5+7", "3*5+7+1", "", "hello"], [ex] * 6) == [1.0, 1.0, 0.1, 0.1, 0, 0]
    assert task.reward(["3*5+7"], [{"nums": [3, 5, 7, 7], "target": 22}]) == [0.1]  # every number must be used
    assert task.reward(["5/(3/0)"], [{"nums": [5, 3, 0], "target": 0}]) == [0.1]  # a division by zero is never right
    assert task.extract_answer("5/(3/0)") == "5/(3/0)"
    assert task.reward(["7*(5-3)/2"], [{"nums": [7, 5, 3, 2], "target": 7}]) == [1.0]  # exact fractions


def test_countdown_r1_extraction_and_rewards():
    task = CountdownTask(prompt_format="r1")
    ex = {"nums": [3, 5, 7], "target": 22}
    prompt = task.prompt(ex)
    assert "[3, 5, 7]" in prompt and "equals 22" in prompt and prompt.endswith("<think>")
    assert not CountdownTask(prompt_format="r1", use_chat_template=True).prompt(ex).endswith("<think>")
    assert task.stop_strings == ["</answer>"]
    good = "3*5=15, 15+7=22</think>\n<answer> 3 * 5 + 7 </answer>"
    assert task.extract_answer(good) == "7+3*5"
    assert task.extract_answer("<think>ok</think><answer>5*3+7</answer>\n") == "7+3*5"
    assert task.extract_answer("try <answer>3+5</answer></think>\n<answer>3*5+7</answer>") == "7+3*5"  # the last
    assert task.extract_answer("<answer>3*5+7</answer>") is None  # no reasoning block
    assert task.extract_answer("x</think><answer>3*5+7</answer> and more") is None  # not ended by the answer
    assert task.extract_answer("x</think><answer>3*5+7") is None  # cut before </answer>
    assert task.extract_answer("x</think><answer>  </answer>") is None
    assert task.extract_answer("x</think><answer>3*5+7 = 22</answer>") == "3*5+7 = 22"  # layout right, not an equation
    completions = [good, "x</think>\n<answer>3+5+7</answer>", "x</think><answer>3*5+7 = 22</answer>", "3*5+7", None]
    assert task.reward(completions, [ex] * 5) == [1.0, 0.1, 0.1, 0.0, 0.0]


def test_countdown_preprocess_hub_record():
    task = CountdownTask()
    record = task.preprocess({"nums": "[44, 19, 35]", "target": "98"})
    assert record["nums"] == [44, 19, 35] and record["target"] == 98
    assert task.is_correct("44+19+35", record)


@pytest.mark.parametrize("record, column", [
    ({"nums": "abc", "target": 5}, "'nums' column is 'abc'"),
    ({"nums": [3, None, 7], "target": 5}, r"'nums' column is \[3, None, 7\]"),
    ({"nums": [-3, 5], "target": 2}, "'nums' column is"),  # no answer can use a negative number
    ({"nums": [10**12, 5], "target": 2}, "'nums' column is"),  # nor one longer than the verifier reads
    ({"nums": [3, 5, 7], "target": None}, "'target' column is None"),
    ({"nums": [3, 5, 7], "target": "abc"}, "'target' column is 'abc'"),
    ({"nums": [3, 5, 7], "target": "²²"}, "'target' column is '²²'"),  # digits to isdigit(), not to int()
])
def test_countdown_preprocess_refuses_a_malformed_record_in_one_line(record, column):
    from es_lightning.cli_errors import explain

    with pytest.raises(ValueError, match=f"Countdown record whose {column}.*fix the column.*data.column_mapping") as info:
        CountdownTask().preprocess(record)
    line = explain(info.value)  # the command prints it as one line, not a traceback
    assert line is not None and "\n" not in line and str(info.value) in line


def test_task_settings_the_constructors_accept_have_answers_the_verifiers_read():
    sort = SortTask(min_length=32, max_length=32, max_value=10**19 - 1)
    addition = AdditionTask(max_digits=18)
    countdown = CountdownTask(min_number=10**12 - 9, max_number=10**12 - 1, num_numbers=2, min_target=0,
                              max_target=10**25)
    largest = {"x": 10**18 - 1, "y": 10**18 - 1}  # a 19-digit sum
    assert addition.is_correct(str(2 * 10**18 - 2), largest) and not addition.is_correct(str(2 * 10**18 - 1), largest)
    for task in (sort, addition, countdown):
        examples = task.procedural(50, seed=0)
        assert all(task.is_correct(ex["solutions"][0], ex) for ex in examples), task
    assert max(len(ex["solutions"][0]) for ex in sort.procedural(50, seed=0)) > 256
    for make, bound in ((lambda: SortTask(max_value=10**19), r"max_value must be between 0 and 10\*\*19 - 1"),
                        (lambda: AdditionTask(max_digits=19), "max_digits must be between 1 and 18"),
                        (lambda: CountdownTask(max_number=10**12), r"max_number must be below 10\*\*12")):
        with pytest.raises(ValueError, match=bound):
            make()


ADVERSARIAL = {
    "huge power": "2**99999999",
    "tower": "9**9**9",
    "deep nesting": "(" * 10000 + "1" + ")" * 10000,
    "unbalanced nesting": "(" * 100000,
    "100 kB": "1+" * 50000 + "1",
    "unicode digits": "٣+٣+٣",
    "fullwidth digits": "１+２+３",
    "import": "__import__('os').system('true')",
    "dunder": "().__class__.__bases__[0].__subclasses__()",
    "lambda": "(lambda: 1)()",
    "float": "1e308*1e308",
    "long product": "*".join(["9"] * 20000),
    "long product under the cap": "*".join(["9"] * 120),
    "floor division": "6//2+1",
    "unary minus": "-3+5+7+13",
    "null byte": "1+2\x00+3",
    "string": "'1+2+3'",
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_countdown_adversarial_completions_score_zero_fast(case):
    text = ADVERSARIAL[case]
    ex = {"nums": [1, 2, 3], "target": 6}
    for task in (CountdownTask(max_completion_chars=10**6), CountdownTask()):
        start = time.perf_counter()
        if case == "long product under the cap":  # well-formed, so it earns the format reward, never correctness
            assert task.reward([text], [ex]) == [0.1]
        else:
            assert task.reward([text], [ex]) == [0.0]
        assert task.check_answer(text, ex) is False
        assert task.is_correct(text, ex) is False
        assert time.perf_counter() - start < 0.5, case
    r1 = CountdownTask(prompt_format="r1", max_completion_chars=10**6)
    start = time.perf_counter()
    assert r1.is_correct(f"x</think><answer>{text}</answer>", ex) is False
    assert r1.reward([f"x</think><answer>{text}</answer>"], [ex])[0] in (0.0, 0.1)  # layout alone: format credit
    assert time.perf_counter() - start < 0.5, case


def test_reward_never_raises_on_non_strings():
    ex = {"nums": [1, 2, 3], "target": 6}
    for task in (CountdownTask(), CountdownTask(prompt_format="r1"), GSM8KTask(), AdditionTask(), SortTask()):
        assert task.reward([None, 123, b"1+2+3", ["1+2+3"]], [ex] * 4) == [0.0] * 4
    with pytest.raises(ValueError, match="one example per completion"):
        CountdownTask().reward(["1+2+3"], [ex, ex])


# ------------------------------------------------------------------------------------------ GSM8K
def test_gsm8k_number_tolerance():
    task = GSM8KTask()
    ex = task.preprocess({"question": "How many?", "answer": "Some steps.\n#### 1,234"})
    assert ex["gold"] == "1234" and ex["answer"].endswith("1,234")
    assert task.prompt(ex).startswith("How many?\n") and "####" in task.prompt(ex)
    for same in ("1,234", "$1234", "1234.0", "1234.00", "+1234", "$ 1,234.", "1234 dollars"):
        assert task.reward([f"so... #### {same}"], [ex]) == [1.0], same
    for other in ("1234.5", "-1234", "123", "12345"):
        assert task.reward([f"#### {other}"], [ex]) == [0.1], other
    assert task.reward(["the answer is 1234", "#### many", "#### 1 then #### 1234"], [ex] * 3) == [0.0, 0.0, 1.0]
    assert task.extract_answer("#### -$5.50") == "-5.5"
    # digits of other scripts are no answer (verl reads [0-9]; Countdown and the arithmetic tasks refuse them too)
    assert task.reward(["#### \u0661\u0662\u0663\u0664", "#### \U0001d7cf\U0001d7d0\U0001d7d1\U0001d7d2"], [ex] * 2) == [0.0, 0.0]
    with pytest.raises(ValueError, match="gold"):
        task.preprocess({"question": "q", "answer": "no final number"})



def test_gsm8k_reads_a_fraction_whole_never_as_its_numerator():
    """``3/4`` was read as 3: a user's reference answer ``3/4`` became a gold of 3 (and ``1e3`` one of 1), and a
    completion writing ``#### 3/4`` was paid as correct for a gold of 3."""
    task = GSM8KTask()
    assert task.preprocess({"question": "q", "answer": "3/4"})["gold"] == "0.75"
    assert task.preprocess({"question": "q", "answer": "work\n#### 1/3"})["gold"] == "1/3"
    with pytest.raises(ValueError, match="gold"):
        task.preprocess({"question": "q", "answer": "1e3"})
    three, quarter = task.preprocess({"question": "q", "answer": "#### 3"}), task.preprocess({"question": "q", "answer": "3/4"})
    assert task.reward(["#### 3/4", "#### 3", "#### 3/4.5", "#### 3e2"], [three] * 4) == [0.1, 1.0, 0.0, 0.0]
    assert task.reward(["#### 3/4", "#### 0.75", "#### 6/8 cups", "#### 3"], [quarter] * 4) == [1.0, 1.0, 1.0, 0.1]
    assert task.votes(["3/4", "0.75", "1/3"], quarter)[:2] == [Fraction(3, 4)] * 2


def test_gsm8k_reads_a_fraction_that_ends_a_sentence():
    """``#### 3/4.`` was no answer at all (the period after the denominator voided the fraction) while ``#### 18.``
    is 18: a reference answer written so was refused, and such a completion lost its format reward."""
    from es_lightning.tasks.gsm8k import normalize_number

    task = GSM8KTask()
    assert normalize_number("3/4.") == "0.75" and normalize_number("3/4. Done") == "0.75"
    assert normalize_number("3/4.5") is None and normalize_number("10/10/2020") is None
    assert task.preprocess({"question": "q", "answer": "work\n#### 3/4."})["gold"] == "0.75"
    assert task.reward(["so #### 3/4."], [task.preprocess({"question": "q", "answer": "#### 3"})]) == [0.1]


#: (text after "####", the number it is, hand-computed; None: no number)
GSM8K_FORMS = [
    ("1,234", "1234"), ("$1,234.50", "1234.5"), ("12.0", "12"), ("12.00", "12"), ("-$5.50", "-5.5"),
    ("10,000,000", "10000000"), ("12,34,567", "1234567"), ("18, which is", "18"), ("1234 dollars", "1234"),
    ("1 1/2", "1.5"), ("-1 1/2", "-1.5"), ("$2 1/4 per cup", "2.25"), ("1,000 1/2", "1000.5"), ("0 3/4", "0.75"),
    ("1 1/3", "4/3"), ("5 2-liter bottles", "5"), ("1 1/2.", "1.5"),
    ("1 3/2", None), ("1 0/2", None), ("1.5 1/2", None), ("1 1/2/3", None),  # not a mixed number
    ("12,34", None), ("1,2345", None), ("1234,567", None), ("1.234,56", None), ("1.2.3", None),
    ("1\u00bd", "1.5"), ("3 \u00be", "3.75"),
]


def _check_number_forms(task, table):
    """Each ``(text, expected)`` of ``table`` read alike by normalize_number, a completion's ``#### text`` and a
    reference's: no number refuses the reference, a number is its gold and pays both spellings in full."""
    from es_lightning.tasks.gsm8k import normalize_number

    for text, expected in table:
        assert normalize_number(text) == expected, text
        assert task.extract_answer(f"work\n#### {text}") == expected, text
        if expected is None:
            for answer in (f"#### {text}", f"steps\n#### {text}"):
                with pytest.raises(ValueError, match="gold"):
                    task.preprocess({"question": "q", "answer": answer})
            continue
        gold = task.preprocess({"question": "q", "answer": f"steps\n#### {text}"})
        assert gold["gold"] == expected, text
        assert task.reward([f"#### {text}", f"#### {expected}"], [gold] * 2) == [1.0, 1.0], text


def test_gsm8k_number_forms_table():
    """A mixed number ``1 1/2`` was read as 1 (a completion answering 1 1/2 paid for a gold of 1, a reference answer
    1 1/2 became a gold of 1); a comma that groups no thousands (``12,34``: a decimal comma) was dropped (1234), as
    was ``1½``'s fraction. Each form is now its value or no number, the same for gold answers and completions."""
    task = GSM8KTask()
    _check_number_forms(task, GSM8K_FORMS)
    one = task.preprocess({"question": "q", "answer": "#### 1"})
    assert task.reward(["#### 1 1/2", "#### 1\u00bd", "#### 1"], [one] * 3) == [0.1, 0.1, 1.0]
    assert task.votes(["1 1/2", "1.5", "3/2"], one) == [Fraction(3, 2)] * 3


#: (text after "####", the number it is, hand-computed; None: no number) — thousands grouped by spaces and vulgar
#: fractions glued to a whole number
GSM8K_SPACED_AND_VULGAR = [
    ("1 000", "1000"), ("12 345 678", "12345678"), ("$1 234.50", "1234.5"), ("-2 000", "-2000"), ("1 000.25", "1000.25"),
    ("1\u00a0000", "1000"), ("1\u2009000\u2009000", "1000000"), ("2 000 steps", "2000"), ("1 000 1/2", "1000.5"),
    ("1 00", "1"), ("12 3456", "12"), ("3 4", "3"), ("1 0001", "1"),  # a space before no group of three ends the number
    ("1234 567", None), ("1 000,5", None), ("1 100/200", None),  # a bad group, a decimal comma, 1100/200 or 1 + 100/200
    ("1 000 0000", None), ("1 000 00", None), ("12 345 6789", None), ("1\u00a0000\u00a00000", None),  # a bad last group
    ("1 000 1", None), ("1 000 1/2 3", None), ("2 000 1/2", "2000.5"), ("2 000 \u00bd", "2000.5"),  # ... not a fraction
    ("5 200-liter tanks", None), ("1 000-page book", None), ("5 200\u2011liter", None), ("1 000 000-ton", None),
    ("5 200.5-liter", None), ("5 200 1/2-inch", None), ("5 200\u00bd-inch", None), ("1 000-2 000", None),  # 5 or 5200?
    ("5,200-liter tanks", "5200"), ("5200-liter tanks", "5200"), ("5 20-liter tanks", "5"), ("5 200 liters", "5200"),
    ("1\u00bd", "1.5"), ("2\u00be", "2.75"), ("-1\u00bd", "-1.5"), ("1,000\u00bd", "1000.5"), ("1 000\u00bd", "1000.5"),
    ("1\u2153", "4/3"), ("\u00bd", "0.5"), ("\u2154 of them", "2/3"), ("1\u00bd.", "1.5"),
    ("1.5\u00bd", None), ("1\u00bd3", None), ("1\u00bd\u00bd", None), ("1\u00bd/2", None),
    ("1\u20442", None), ("1\u215f2", None),  # a fraction slash: 1/2 or 12, never 1
]


def test_gsm8k_reads_thousands_grouped_by_spaces_and_vulgar_fractions():
    """``1 000`` was read as 1 and ``12 345 678`` as 12 (a gold of 1000 written so became 1, a completion answering
    1 000 was paid for a gold of 1); ``1½`` was no number (a reference answer ``#### 1½`` refused the dataset, a
    completion writing it lost its format reward). Both are now their values, in gold answers and completions alike;
    a space before anything but three digits still ends a number, unless it follows a group: ``1 000 0000`` was read
    as 1000 (paid for a gold of 1000) and is no number, as ``1234 567`` is; ``5 200-liter tanks`` (five tanks) was
    5200, and is no number, as ``1 000-page book`` (a thousand pages, the same spelling) is."""
    task = GSM8KTask()
    _check_number_forms(task, GSM8K_SPACED_AND_VULGAR)
    for text, expected in GSM8K_SPACED_AND_VULGAR:  # a reference without "####" is read from its start
        if expected is not None:
            assert task.preprocess({"question": "q", "answer": text})["gold"] == expected, text
    thousand = task.preprocess({"question": "q", "answer": "In 1 000 steps.\n#### 1 000"})
    assert task.reward(["#### 1000", "#### 1,000", "#### 1 000", "#### 1", "#### 1 00"], [thousand] * 5) == [1.0] * 3 + [0.1] * 2
    assert task.votes(["1 000", "1,000", "1000.0"], thousand) == [Fraction(1000)] * 3
    assert task.reward(["#### 1 000 0000", "#### 1 000 00", "#### 1 000 0000 1/2"], [thousand] * 3) == [0.0] * 3
    five, fifty_two_hundred = (task.preprocess({"question": "q", "answer": f"#### {n}"}) for n in ("5", "5200"))
    for gold in (five, fifty_two_hundred):  # five tanks of 200 litres, or 5200: neither gold pays it
        assert task.reward(["#### 5 200-liter tanks", "#### 5", "#### 5200"], [gold] * 3) in ([0.0, 1.0, 0.1], [0.0, 0.1, 1.0])
    # a reference without "####" is read from its start: a sentence is no number, however it ends
    with pytest.raises(ValueError, match="gold"):
        task.preprocess({"question": "q", "answer": "between 1 and 2 000"})


#: (text after "####", the number it is, hand-computed; None: no number) — superscripts, subscripts and digits of
#: another script after a number
GSM8K_POWERS = [
    ("1\u00b2", None), ("10\u00b3", None), ("2\u207f", None), ("10\u207b\u00b9", None), ("1.5\u00b2", None),
    ("3/4\u00b2", None), ("1 000\u00b2", None), ("1,000\u00b3", None), ("1\u00bd\u00b2", None),  # powers, not 1, 10, 2 …
    ("1\u00b9/\u2082", None), ("1 \u00b9/\u2082", None), ("12\u2083", None),  # a fraction 1¹/₂ is not 1
    ("1\u0662\u0663", None), ("12\uff11", None), ("1.\u0662", None),  # digits of another script, not 1 or 12
    ("5 m\u00b2", "5"), ("25 m\u00b2 of wall", "25"), ("1\u00bd", "1.5"), ("3/4.", "0.75"),  # a unit's power stays
]


def test_gsm8k_reads_no_number_from_a_power_or_a_superscript_fraction():
    """``10³`` was read as 10, ``1²`` as 1 and the fraction ``1¹/₂`` as 1: a completion answering a power was paid as
    correct for its base, and a reference answer written so became a wrong gold. A power is no GSM8K answer form (as
    ``1e3`` is not): no number, in gold answers (refused) and completions (no format reward) alike."""
    task = GSM8KTask()
    _check_number_forms(task, GSM8K_POWERS)
    for text, expected in GSM8K_POWERS:  # a reference without "####" too
        if expected is None:
            with pytest.raises(ValueError, match="gold"):
                task.preprocess({"question": "q", "answer": text})
    ten, thousand = (task.preprocess({"question": "q", "answer": f"#### {n}"}) for n in ("10", "1000"))
    assert task.reward(["#### 10\u00b3", "#### 10", "#### 1000"], [ten] * 3) == [0.0, 1.0, 0.1]
    assert task.reward(["#### 10\u00b3", "#### 1000"], [thousand] * 2) == [0.0, 1.0]
    assert task.votes(["10\u00b3", "10"], ten) == ["10\u00b3", Fraction(10)]


@pytest.mark.parametrize("text", ["1 " * 50_000, "1 000" * 20_000, "\u00bd" * 100_000, "1" + " 000" * 25_000,
                                  "9" * 100_000, "1,000 " * 16_000, "1\u00bd " * 33_000, "$ -" * 33_000 + "1",
                                  "1 000" + " 0000" * 20_000, "1 000-" * 16_000, "1 000" + " " * 100_000 + "1"])
def test_gsm8k_adversarial_numbers_return(text):
    """Long runs of what a number is made of (space groups, vulgar fractions, digits): extraction reads a bounded head,
    so these return (as no number or the number at the start) without scanning the 100 kB."""
    from es_lightning.tasks.gsm8k import normalize_number

    task = GSM8KTask(max_completion_chars=200_000)
    ex = task.preprocess({"question": "q", "answer": "#### 1"})
    assert normalize_number(text) in (None, "1", "1000", "0.5", "1.5")
    assert task.reward([f"#### {text}"], [ex])[0] in (0.0, 0.1, 1.0)
    assert _gold_or_none(task, text) in (None, "1", "1000", "0.5", "1.5")


def _gold_or_none(task, text):
    try:
        return task.preprocess({"question": "q", "answer": text})["gold"]
    except ValueError:
        return None

# ------------------------------------------------------------------------------------------ MATH
def test_math_verify_rewards():
    pytest.importorskip("math_verify")
    task = MathTask()
    half = {"problem": "What is 1/2?", "answer": "0.5"}
    assert task.prompt(half).endswith("\\boxed{}.")
    assert task.extract_answer("so \\boxed{\\frac{1}{2}} and \\boxed{ \\frac{3}{4} }") == "\\frac{3}{4}"
    assert task.extract_answer("\\boxed{\\frac{1}{2}") is None  # unbalanced
    completions = ["thus \\boxed{\\frac{1}{2}}", "\\boxed{\\frac12}", "\\boxed{3}", "1/2", "\\boxed{}"]
    assert task.reward(completions, [half] * 5) == [1.0, 1.0, 0.1, 0.0, 0.0]
    assert task.reward(["\\boxed{0.5}"], [{"problem": "p", "answer": "\\frac12"}]) == [1.0]
    start = time.perf_counter()
    assert task.reward(["\\boxed{" + "9" * 5000 + "}", "\\boxed{" + "{" * 3000 + "}"], [half] * 2) == [0.0, 0.0]
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("task_name, column", [("gsm8k", "question"), ("math", "problem")])
def test_a_record_without_a_prompt_text_is_refused_in_one_line(task_name, column, tmp_path):
    """A row whose question (GSM8K) / problem (MATH) is null crashed setup with "'NoneType' object has no attribute
    'strip'" (no row, no column, no fix), and an empty one prompted the instruction alone; both are refused as a
    missing answer is, so data.drop_invalid_rows drops them."""
    if task_name == "math":
        pytest.importorskip("math_verify")
    from es_lightning.data import ReasoningDataModule

    task = get_task(task_name)
    for text in (None, "", "  ", ["a", "list"]):
        with pytest.raises(ValueError, match=rf"record whose '{column}' column is .*, no {column} to prompt with: drop "
                                             rf"the row or fill it, or map your dataset's {column} column"):
            task.preprocess({column: text, "answer": "#### 3"})
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({column: None if i == 4 else f"p{i}", "answer": f"#### {i}"}) + "\n" for i in range(12)))
    with pytest.raises(ValueError, match=rf"the first \(row 4, counting from 0\) as: .*'{column}' column is None"):
        ReasoningDataModule(task, source=str(tmp_path), train_size=None, val_size=2, test_size=2).setup()
    with pytest.warns(UserWarning, match="dropped 1 of the 12 rows"):
        dm = ReasoningDataModule(task, source=str(tmp_path), train_size=None, val_size=2, test_size=2,
                                 drop_invalid_rows=True)
        dm.setup()
    assert len(dm.splits["train"]) == 7


def test_math_refuses_a_record_without_a_reference_answer(tmp_path):
    """A row whose answer is null/empty was kept: its gold read as the text "None" (a completion boxing "None" was
    paid as correct) or as nothing, a problem no completion could solve, deflating Pass@k without a word."""
    pytest.importorskip("math_verify")
    task = MathTask()
    for answer in (None, "", "  ", "see \\boxed{}"):
        with pytest.raises(ValueError, match=r"MathTask record whose 'answer' column is .*no reference answer"):
            task.preprocess({"problem": "p", "answer": answer})
    assert task.preprocess({"problem": "p", "answer": 5}) == {"problem": "p", "answer": 5}
    from es_lightning.data import ReasoningDataModule

    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"problem": f"p{i}", "answer": None if i == 7 else str(i)}) + "\n" for i in range(12)))
    with pytest.raises(ValueError, match="column is None, no reference answer"):
        ReasoningDataModule(task, source=str(tmp_path), train_size=None, val_size=2, test_size=2).setup()


def test_math_rows_without_an_answer_are_counted_and_dropped_on_request(tmp_path):
    """One row without an answer refused the whole dataset naming neither the row nor how many there were. The run
    is refused in one line with the count, the first row (its number in the source split) and the option that drops
    them; ``drop_invalid_rows: true`` trains and evaluates on the others, with one warning naming the count."""
    pytest.importorskip("math_verify")
    import datasets

    from es_lightning.data import ReasoningDataModule

    bad = {7: None, 12: "", 15: "\\boxed{}"}
    train = datasets.Dataset.from_dict({"problem": [f"p{i}" for i in range(20)],
                                        "answer": [bad.get(i, str(i)) for i in range(20)]})
    test = datasets.Dataset.from_dict({"problem": ["q0", "q1"], "answer": ["1", "2"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "math"))
    source = str(tmp_path / "math")
    with pytest.raises(ValueError) as refused:
        ReasoningDataModule(MathTask(), source=source, train_size=None, val_size=2, test_size=None).setup()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"3 of the 20 rows of the 'train' split of data.source {source!r} are refused by "
                              "task 'math', the first (row 7, counting from 0) as: MathTask record whose 'answer' column "
                              "is None, no reference answer")
    assert message.endswith("or set data.drop_invalid_rows: true to train and evaluate without them")

    dm = ReasoningDataModule(MathTask(), source=source, train_size=None, val_size=2, test_size=None,
                             drop_invalid_rows=True)
    with pytest.warns(UserWarning) as record:
        dm.setup()
    said = [str(w.message) for w in record if "drop_invalid_rows" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("data.drop_invalid_rows: dropped 3 of the 20 rows"), said
    kept = dm.splits["train"] + dm.splits["val"]
    assert sorted(int(e["problem"][1:]) for e in kept) == [i for i in range(20) if i not in bad]
    assert [e["answer"] for e in dm.splits["test"]] == ["1", "2"]
    from es_lightning.analysis.evaluate import heldout_problems

    datasets.DatasetDict({"train": train, "validation": test}).save_to_disk(str(tmp_path / "no-test"))
    with pytest.raises(ValueError, match=r"^3 of the 20 rows .* — fix those rows in the file .*an evaluation has no "
                                         r"drop_invalid_rows: it scores every row it draws$"):  # no option to drop there
        heldout_problems(MathTask(), 2, source=str(tmp_path / "no-test"))


def test_math_verifies_each_answer_once(monkeypatch):
    """A population repeats answers; a hostile one (a power tower) cost math-verify's whole timeout at every
    comparison. Each (gold, answer) pair is now verified once, and its verdict stays the verifier's."""
    math_verify = pytest.importorskip("math_verify")
    calls = []
    real = math_verify.verify

    def counting(gold, predicted, **kwargs):
        calls.append(str(predicted))
        return real(gold, predicted, **kwargs)

    monkeypatch.setattr(math_verify, "verify", counting)
    from es_lightning.tasks.math import _verified

    _verified.cache_clear()  # a verdict another test cached is not this test's call
    task = MathTask()
    example = {"problem": "p", "answer": "\\frac{7}{9}"}
    # members and steps write different texts around the same answers (a call already grades a repeated text once)
    for step in range(2):
        completions = [f"{prefix} step {step}: \\boxed{{{answer}}}" for prefix in ("so", "thus", "hence")
                       for answer in ("\\frac{7}{9}", "7/9", "0.5")]
        assert task.reward(completions, [example] * 9) == [1.0, 1.0, 0.1] * 3
    assert len(calls) == 3


# ------------------------------------------------------------------------------------------ addition and sorting
def test_addition_task():
    task = AdditionTask()
    examples = task.procedural(200, seed=3)
    assert examples == task.procedural(200, seed=3) and examples != task.procedural(200, seed=4)
    assert {len(str(ex["x"])) for ex in examples} == {1, 2, 3}
    ex = examples[0]
    assert task.prompt(ex) == f"a:{ex['x']}+{ex['y']}=" and set(task.prompt(ex)) <= COMPACT_VOCAB
    assert all(task.reward(e["solutions"], [e]) == [1.0] for e in examples)
    wrong = str(ex["x"] + ex["y"] + 1)
    assert task.reward([wrong, "12a", "", "1 2"], [ex] * 4) == [0.1, 0.0, 0.0, 0.0]


def test_sort_task():
    task = SortTask()
    examples = task.procedural(200, seed=5)
    assert examples == task.procedural(200, seed=5)
    assert {len(ex["nums"]) for ex in examples} == {4, 5, 6}
    ex = {"nums": [42, 7, 19, 7]}
    assert task.prompt(ex) == "s:42 7 19 7=" and set(task.prompt(ex)) <= COMPACT_VOCAB
    completions = ["7 7 19 42", " 07  7 19 42", "7 19 42", "42 19 7 7", "7,7,19,42"]
    assert task.reward(completions, [ex] * 5) == [1.0, 1.0, 0.1, 0.1, 0.0]
    assert all(task.reward(e["solutions"], [e]) == [1.0] for e in examples)


# ------------------------------------------------------------------------------------------ registry
def test_get_task():
    assert set(TASKS) == {"countdown", "gsm8k", "math", "addition", "sort"}
    task = get_task("countdown", prompt_format="r1")
    assert isinstance(task, CountdownTask) and task.prompt_format == "r1"
    assert get_task(task) is task
    assert isinstance(get_task(SortTask), SortTask)
    assert isinstance(get_task("es_lightning.tasks.AdditionTask", max_digits=2), AdditionTask)
    assert all(issubclass(cls, Task) for cls in TASKS.values())
    with pytest.raises(ValueError, match=r"known tasks: addition, countdown.*class_path"):
        get_task("chess")
    with pytest.raises(ValueError, match="instance"):
        get_task(task, prompt_format="compact")
    with pytest.raises(ValueError, match="cannot import"):
        get_task("no_such_module.Task")
    with pytest.raises(ValueError, match="not a subclass"):
        get_task("collections.OrderedDict")
    with pytest.raises(ValueError, match="prompt_format"):
        CountdownTask(prompt_format="latex")


def test_grade_parses_once_and_agrees_with_reward_and_is_correct():
    task = CountdownTask()
    example = {"nums": [3, 5, 7], "target": 22}
    texts = ["3*5+7", "3+5+7", "junk((", "7+5*3", ""]
    answers, correct, rewards = task.grade(texts, [example] * len(texts))
    assert correct == [True, False, False, True, False]
    assert rewards == [1.0, 0.1, 0.0, 1.0, 0.0]
    assert answers[2] is None and answers[0] == answers[3]  # one normal form for equal solutions (maj@k)
    assert correct == [task.is_correct(t, example) for t in texts]
    with pytest.raises(ValueError, match="one example per completion"):
        task.grade(texts, [example])

    class LengthShaped(CountdownTask):  # a user's custom reward is what training sees
        def reward(self, completions, examples):
            return [len(c) / 10 for c in completions]

    assert LengthShaped().grade(texts, [example] * len(texts))[2] == [0.5, 0.5, 0.6, 0.5, 0.0]


def test_grade_verifies_each_distinct_completion_once_per_example():
    """An ES population repeats completions; grade() parses and verifies each (example, completion) pair once, and the
    answers, verdicts and rewards are those of grading every row on its own."""
    calls = []

    class Counting(CountdownTask):
        def extract_answer(self, completion):
            calls.append(completion)
            return super().extract_answer(completion)

    task, plain = Counting(), CountdownTask()
    a, b = {"nums": [3, 5, 7], "target": 22}, {"nums": [3, 5, 7], "target": 15}
    texts = ["3*5+7", "3+5+7", "3*5+7", "junk((", "3+5+7", "3*5+7"]
    examples = [a, a, a, b, b, b]  # "3*5+7" is right for a, wrong for b: the pair is the key, not the text
    got = task.grade(texts, examples)
    one_by_one = [plain.grade([t], [e]) for t, e in zip(texts, examples)]
    assert got == tuple([row[i][0] for row in one_by_one] for i in range(3))
    assert got[1] == [True, False, True, False, True, False] and got[2] == [1.0, 0.1, 1.0, 0.0, 1.0, 0.1]
    assert sorted(calls) == sorted(["3*5+7", "3+5+7", "junk((", "3+5+7", "3*5+7"])  # 5 distinct pairs, not 6 rows


def test_parse_cache_returns_what_a_fresh_parse_does_and_stays_bounded():
    """parse_expression remembers the parses of recent texts (an ES population and the check of a normal form parse the
    same texts again): a hit returns exactly what a fresh parse gives, and the cache never holds more than its size."""
    from es_lightning.tasks import expressions

    texts = ["3*5+7", "(3+5)*7", "7/(5-5)", "3+", "  12 - 4/2 ", "((1))", "1_0+2", "2**3"]
    expressions._parse_checked.cache_clear()
    first = [parse_expression(t) for t in texts]
    info = expressions._parse_checked.cache_info()
    expressions._parse_checked.cache_clear()
    again = [parse_expression(t) for t in texts] + [parse_expression(t) for t in texts]
    assert again == first + first  # the cached answers are the fresh ones
    assert expressions._parse_checked.cache_info().hits >= info.misses  # the second pass hit the cache
    assert first[0].value == 22 and first[1].value == 56 and first[2].value is None
    assert first[3] is None and first[4].value == 10 and first[5].value == 1 and first[6] is None and first[7] is None
    for i in range(expressions.PARSE_CACHE_SIZE + 10):
        parse_expression(f"{i}+1")
    assert expressions._parse_checked.cache_info().currsize == expressions.PARSE_CACHE_SIZE


def test_default_reward_follows_an_overridden_is_correct():
    """A task that overrides only is_correct() (a lenient verifier) is rewarded by it: a completion it accepts earns
    correct_reward in reward() and grade(), not the format reward, so what trains and what is measured agree."""

    class Lenient(AdditionTask):  # accepts an answer off by one
        def is_correct(self, completion, example):
            answer = self.extract_answer(completion)
            return answer is not None and abs(int(answer) - int(example["x"]) - int(example["y"])) <= 1

    task, example, texts = Lenient(), {"x": 2, "y": 3}, ["5", "6", "9", "x"]
    answers, correct, rewards = task.grade(texts, [example] * 4)
    assert correct == [True, True, False, False]
    assert rewards == [1.0, 1.0, 0.1, 0.0] == task.reward(texts, [example] * 4)


def test_a_verifier_that_raises_is_reported_once_and_costs_only_the_sample():
    """A custom check_answer that raised (here a KeyError on a column the records lack) scored every completion as
    wrong in silence: the run trained on format rewards alone with no word of why. It is now reported, once per
    method and kind of error, and still costs only the sample."""

    class WrongColumn(AdditionTask):
        def check_answer(self, answer, example):
            return int(answer) == example["sum"]

    class BadExtract(AdditionTask):
        def extract_answer(self, completion):
            raise ValueError("cannot read " + completion)

    task, example = WrongColumn(), {"x": 2, "y": 3}
    with pytest.warns(RuntimeWarning, match=r"WrongColumn.check_answer raised KeyError: 'sum'; the completion is scored "
                                            r"as a wrong answer.*must not raise"):
        assert task.reward(["5", "6"], [example] * 2) == [0.1, 0.1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same kind of error again: not reported twice
        assert task.reward(["5"], [example]) == [0.1]
    with pytest.warns(RuntimeWarning, match=r"BadExtract.extract_answer raised ValueError: cannot read 5; .*scored 0"):
        assert BadExtract().reward(["5"], [example]) == [0.0]


@pytest.mark.parametrize("task, bound", [("gsm8k", 65536), ("countdown", 8192)])
def test_the_command_builds_each_task_with_its_own_completion_bound(task, bound, qwen_like_small_dir, tmp_path,
                                                                   monkeypatch, capsys):
    """`es-lightning fit` (jsonargparse) passed the base signature's default, max_completion_chars=8192, explicitly,
    overriding GSM8K's 65536: through the command (and the shipped Qwen GSM8K recipes) a chain of thought longer than
    8192 characters scored 0. The default is None, the task's own bound, resolved when the task is built: GSM8K gets
    65536 (recorded in the run's checkpoint, which an evaluation rebuilds the task from), compact Countdown 8192, and
    --print_config shows null."""
    from pathlib import Path

    import torch

    from es_lightning.cli import cli_main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "es.yaml"
    data = []
    if task == "gsm8k":
        (tmp_path / "gsm8k").mkdir()
        with open(tmp_path / "gsm8k" / "train.jsonl", "w") as f:
            for a in range(2, 10):
                f.write(json.dumps({"question": f"What is {a} + 1?", "answer": f"{a} + 1 = {a + 1}\n#### {a + 1}"}) + "\n")
        data = ["--data.init_args.task", "es_lightning.GSM8KTask", "--data.init_args.source", str(tmp_path / "gsm8k")]
    monkeypatch.chdir(tmp_path)
    cli_main(["fit", "--config", str(recipe), "--model.init_args.model", qwen_like_small_dir, *data,
              "--model.init_args.population_size", "2", "--model.init_args.members_per_batch", "2",
              "--model.init_args.max_new_tokens", "2", "--data.init_args.train_size", "4", "--data.init_args.val_size",
              "2", "--data.init_args.test_size", "2", "--data.init_args.batch_size", "2", "--trainer.max_steps", "1",
              "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
              "--trainer.callbacks", "es_lightning.RunCheckpoint", "--trainer.logger.init_args.save_dir", str(tmp_path)])
    ckpt = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False)
    assert ckpt["ReasoningDataModule"]["stream"]["task"]["init_args"]["max_completion_chars"] == bound
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(recipe), "--print_config"])
    assert "max_completion_chars: null" in capsys.readouterr().out
