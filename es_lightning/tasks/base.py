"""The one face every reasoning task shows: a prompt format, an answer extractor, a verifier and a reward.

A task is the unit that ties a dataset to a verifier (README "Design", "Tasks own their verifiers"). The data module asks a
task which columns it needs, how to turn a raw record into an example, and how to build the prompt; the training modules
ask it to score completions. Nothing else in the package knows what a task's records look like.

Reward convention (Ba et al. 2026, §2; the same as Qiu et al. 2025's "correctness + 0.1 × format"):
``correct_reward`` (1.0) for a correct answer, ``format_reward`` (0.1) for a completion whose answer could be extracted
but is wrong, 0 otherwise. Verifiers never ``eval`` model output, never raise on malformed text (it scores 0), and bound
the size of what they read (``max_completion_chars``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

from es_lightning.signatures import accepted_options

#: the checkpoint key of the training task's record (:func:`task_record`)
TASK_KEY = "es_lightning_task"


#: the fix named wherever a TRL-style reward function (``reward_funcs``, a bare function as the task) is handed in
REWARD_FUNCTION_FIX = ("a reward function is a task's method here: subclass a task (e.g. CountdownTask) and override "
                       "reward(self, completions, examples) -> list[float] (one float per completion, in order), then "
                       "pass task=MyTask() (README \"Pointing at a real model and dataset\")")


class VerdictError(TypeError):
    """A task's ``is_correct`` / ``check_answer`` (or an overridden ``grade``) returned a correctness verdict that is no
    bool: the scorer stops the run with it (:class:`es_lightning.scoring.RewardError`), as for a reward that is no
    number."""


def as_verdict(value: Any, method: str) -> bool:
    """``value``, returned by the task's ``method``, as a correctness verdict: a bool, or a number equal to 0 or 1
    (``numpy.bool_``, ``1.0``, ``torch.tensor(True)``); anything else raises :class:`VerdictError` naming it.

    Correctness is a bool — what Pass@K counts and the reward's ``correct_reward`` is paid for (TRL and verl read
    accuracy the same way) — and ``bool()`` would read a score of 0.3, a tensor of 0.3 or the text ``"no"`` as correct,
    and a forgotten ``return`` (None) as wrong, silently. A graded score belongs in :meth:`Task.reward`."""
    if isinstance(value, bool):
        return value
    number = None
    if not isinstance(value, (str, bytes)) and value is not None:
        try:
            number = float(value)
        except Exception:  # a list, a tensor of several values, ...
            number = None
    if number not in (0.0, 1.0):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise VerdictError(f"{method} returned {shown} ({type(value).__name__}), not a correctness verdict: return True "
                           "when the completion is correct, else False (a graded score in [0, 1] belongs in "
                           "reward(self, completions, examples), with is_correct saying which completions are right)")
    return number == 1.0


class Task(ABC):
    """Base class of all tasks. Subclasses set ``name``/``required_columns`` and implement three methods.

    Args:
        correct_reward: reward of a correct completion (Ba et al.: 1.0).
        format_reward: reward of a completion whose answer is extractable but wrong (Ba et al.: 0.1).
        use_chat_template: wrap the prompt in the tokenizer's chat template (instruct models); the built-in model has
            none.
        max_completion_chars: completions longer than this score 0 without being parsed (bounds verifier time).
            None (the default) is the task's own bound, resolved when the task is built: 8192 here, 65536 for the
            chain-of-thought tasks (GSM8K, MATH, Countdown's ``r1`` format). The signature's default is None, not a
            number: the command line (jsonargparse) passes the default explicitly, so a number there overrode the
            task's own bound.
        system_prompt: a system turn before every prompt, with the chat template (``use_chat_template: true``); None
            leaves the template's own default (Qwen2.5-Instruct's writes "You are Qwen, created by Alibaba Cloud. You
            are a helpful assistant."; Llama 3's writes none). TRL's conversational datasets carry it as the
            ``system`` message; here it belongs to the task, so a checkpoint records it and an evaluation of the
            checkpoint prompts with it.
    """

    #: short identifier used in logs and tables
    name: ClassVar[str] = "task"
    #: columns a raw record must have (after column mapping, before ``preprocess``); checked by the data module at setup
    required_columns: ClassVar[tuple[str, ...]] = ()
    #: the hub dataset used when the data source says ``hub`` without a name
    hub_dataset: ClassVar[str | None] = None
    #: hub dataset config name (e.g. ``"main"`` for openai/gsm8k)
    hub_config: ClassVar[str | None] = None
    #: the ``max_completion_chars`` that ``None`` stands for (short completions: the built-in model's formats)
    default_max_completion_chars: ClassVar[int] = 8192

    def __init__(
        self,
        correct_reward: float = 1.0,
        format_reward: float = 0.1,
        use_chat_template: bool = False,
        max_completion_chars: int | None = None,
        system_prompt: str | None = None,
    ) -> None:
        self.correct_reward = float(correct_reward)
        self.format_reward = float(format_reward)
        self.use_chat_template = bool(use_chat_template)
        if max_completion_chars is None:
            max_completion_chars = self.default_max_completion_chars
        self.max_completion_chars = int(max_completion_chars)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt must be a text, got {type(system_prompt).__name__} {system_prompt!r}")
        if system_prompt is not None and not self.use_chat_template:
            raise ValueError("system_prompt is a turn of the chat template: set use_chat_template: true with it (or "
                             "write the instruction into the prompt)")
        self.system_prompt = system_prompt

    # ----------------------------------------------------------------- what subclasses implement
    @abstractmethod
    def prompt(self, example: dict[str, Any]) -> str:
        """The text the model continues (before any chat template)."""

    @abstractmethod
    def extract_answer(self, completion: str) -> str | None:
        """The final answer in ``completion`` as a canonical string, or ``None`` when the format is wrong.

        Used for the format reward and, through :meth:`vote_key`, for majority voting (maj@k). Must not raise. A pure
        function of ``completion``: :meth:`grade` parses a completion repeated for the same example only once.
        """

    @abstractmethod
    def check_answer(self, answer: str, example: dict[str, Any]) -> bool:
        """Whether an extracted answer solves ``example``. Must not raise and must never ``eval`` the answer. A pure
        function of its arguments (graded once per distinct completion and example object in a :meth:`grade` call)."""

    # ----------------------------------------------------------------- optional hooks
    def pool_key(self, example: dict[str, Any]) -> str:
        """The problem's identity for the train / held-out split of procedural problems
        (:func:`es_lightning.data.in_heldout_pool`) and for telling problems apart: its prompt by default. A task whose
        prompt text changes with how it is presented (a prompt format, the chat template) returns one canonical text,
        so that a problem is held out, or not, whatever the presentation."""
        return self.prompt(example)

    def preprocess(self, example: dict[str, Any]) -> dict[str, Any]:
        """Turn a raw dataset record (after column mapping) into the example the task reads. Default: unchanged."""
        return example

    def procedural(self, num_examples: int, seed: int) -> list[dict[str, Any]]:
        """Generate ``num_examples`` examples deterministically from ``seed`` (only tasks with a generator)."""
        raise NotImplementedError(
            f"task {self.name!r} has no procedural generator; set data.source to a hub dataset name or a local "
            "jsonl/parquet/arrow path"
        )

    @property
    def stop_strings(self) -> list[str]:
        """Strings that end a completion early (besides the tokenizer's EOS)."""
        return []

    def vote_key(self, answer: str, example: dict[str, Any]) -> Hashable | None:
        """What maj@k votes on for the extracted ``answer``: samples whose keys are equal vote together.

        Self-consistency (Wang et al. 2023) votes on the final *answer*, marginalising over the ways of reaching it, so
        two completions that say the same thing differently must give equal keys. Default: ``answer`` itself (the
        canonical string of :meth:`extract_answer`). A task whose answers can be equal without being equal strings
        (Countdown: different expressions of the same value; MATH: ``\\frac12`` and ``0.5``) overrides this. Keys
        must only group answers the verifier judges alike: maj@k reads the verdict of the winning group's first
        sample. ``None`` abstains. May raise: :meth:`votes` turns a failure into a vote for the answer string.
        """
        return answer

    # ----------------------------------------------------------------- the public face
    def is_correct(self, completion: str, example: dict[str, Any]) -> bool:
        """True when ``completion`` answers ``example`` correctly. A verifier that raises costs the sample (a wrong
        answer), never the run; a :meth:`check_answer` verdict that is no bool raises :class:`VerdictError` (a bug)."""
        return self._verify(completion, example)[1]

    def reward(self, completions: Sequence[str], examples: Sequence[dict[str, Any]]) -> list[float]:
        """One float per completion: ``correct_reward`` when :meth:`is_correct` (a subclass's override included),
        else ``format_reward`` when an answer could be extracted, else 0 (Ba et al. convention)."""
        answers, correct, _ = self._grade(completions, examples)  # not grade(): a subclass's reward() may call this
        return self._rewards(answers, self._verdicts(completions, examples, correct))

    def grade(
        self, completions: Sequence[str], examples: Sequence[dict[str, Any]]
    ) -> tuple[list[str | None], list[bool], list[float]]:
        """``(answers, correct, rewards)`` per completion, each completion parsed and verified once.

        ``answers`` are the extracted answers (``None`` when the format is wrong; what maj@k votes on), ``correct``
        what :meth:`is_correct` says, ``rewards`` what :meth:`reward` says. Training and evaluation call this so that a
        completion is never parsed twice. Subclasses customise :meth:`reward` / :meth:`is_correct` and this follows.
        """
        answers, correct, rewards = self._grade(completions, examples)
        # a subclass that overrides reward() or is_correct() (a custom reward, e.g. length shaping) is obeyed; the
        # default reward follows an overridden is_correct(), so that what trains and what is measured agree
        correct = self._verdicts(completions, examples, correct)
        if type(self).reward is not Task.reward:  # as returned: the scorer checks it, naming a value that is no number
            rewards = self.reward(completions, examples)
            # a dict or a set is left as it is, for the scorer to refuse (list() of a dict is its keys)
            listable = isinstance(rewards, Iterable) and not isinstance(rewards, (str, bytes, Mapping, AbstractSet))
            rewards = list(rewards) if listable else rewards
        else:
            rewards = self._rewards(answers, correct)
        return answers, correct, rewards

    def _verdicts(self, completions: Sequence[str], examples: Sequence[dict[str, Any]], correct: list[bool]) -> list[bool]:
        """``correct`` (the base class's verdicts), or what an overridden :meth:`is_correct` says."""
        if type(self).is_correct is Task.is_correct:
            return correct
        return [as_verdict(self.is_correct(c, e), "is_correct") for c, e in zip(completions, examples)]

    def _rewards(self, answers: Sequence[str | None], correct: Sequence[bool]) -> list[float]:
        """The default reward of each completion from its extracted answer and verdict."""
        return [self.correct_reward if ok else self.format_reward if answer is not None else 0.0
                for answer, ok in zip(answers, correct)]

    def _grade(
        self, completions: Sequence[str], examples: Sequence[dict[str, Any]]
    ) -> tuple[list[str | None], list[bool], list[float]]:
        """The base class's answers, verdicts and rewards, ignoring subclass overrides of reward()/is_correct()."""
        if len(completions) != len(examples):
            raise ValueError(
                f"grade() got {len(completions)} completions but {len(examples)} examples; pass one example per "
                "completion (repeat each example n times for n samples)"
            )
        answers, correct, rewards = [], [], []
        # An ES population repeats itself: with small σ most members write the same completion for the same problem
        # (every member's rows share the example objects), so each distinct (example, completion) pair is parsed and
        # verified once per call — extract_answer/check_answer are pure functions of their arguments (the contract
        # above). Equal but distinct example objects are simply graded again; a non-string completion is its own key.
        seen: dict[tuple[int, Any], tuple[str | None, bool]] = {}
        for completion, example in zip(completions, examples):
            key = (id(example), completion if isinstance(completion, str) else id(completion))
            if key not in seen:
                seen[key] = self._verify(completion, example)
            answer, ok = seen[key]
            answers.append(answer)
            correct.append(ok)
            rewards.append(self.correct_reward if ok else self.format_reward if answer is not None else 0.0)
        return answers, correct, rewards

    def votes(self, answers: Sequence[str | None], example: dict[str, Any]) -> list[Hashable | None]:
        """The :meth:`vote_key` of each of one problem's ``answers`` (``None`` abstains). Never raises."""
        keys: list[Hashable | None] = []
        for answer in answers:
            if answer is None:
                keys.append(None)
                continue
            try:
                keys.append(self.vote_key(answer, example))
            except Exception:  # a key bug must not cost the run; the answer still votes, as its own string
                keys.append(answer)
        return keys

    def _verify(self, completion: str, example: dict[str, Any]) -> tuple[str | None, bool]:
        """``(extracted answer, correct)`` for one completion, the base class's way. A raising ``check_answer`` is a
        wrong answer; a verdict that is no bool raises :class:`VerdictError`."""
        answer = self._safe_extract(completion)
        if answer is None:
            return None, False
        try:
            verdict = self.check_answer(answer, example)
        except Exception as err:  # a verifier bug or hostile input must cost a sample, not a run
            self._report_raise("check_answer", err, "as a wrong answer")
            return answer, False
        return answer, as_verdict(verdict, "check_answer")  # a verdict that is no bool stops the scoring: a bug

    def _safe_extract(self, completion: str) -> str | None:
        if not isinstance(completion, str) or len(completion) > self.max_completion_chars:
            return None
        try:
            return self.extract_answer(completion)
        except Exception as err:
            self._report_raise("extract_answer", err, "0 (no answer)")
            return None

    def _report_raise(self, method: str, err: Exception, scored: str) -> None:
        """Warn, once per method and kind of exception, that the task's ``method`` raised: the sample is scored
        ``scored`` and the run goes on, but a verifier that raises on every completion (a ``KeyError`` on a column the
        data does not have) would otherwise train on rewards that say nothing, with no word of why."""
        reported = self.__dict__.setdefault("_raises_reported", set())
        if (method, type(err)) in reported:
            return
        reported.add((method, type(err)))
        import warnings

        text = str(err).splitlines()[0][:200] if str(err) else ""
        warnings.warn(f"{type(self).__name__}.{method} raised {type(err).__name__}{': ' + text if text else ''}; the "
                      f"completion is scored {scored} and the run goes on (reported once per kind of error). "
                      f"{method} must not raise: fix it, or return {'None' if method == 'extract_answer' else 'False'} "
                      "for what it cannot read", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_text(example: dict[str, Any], column: str, record: str) -> None:
    """Refuse (``ValueError``, one line naming the column) a ``record`` (``"GSM8K record"``) whose prompt text
    ``column`` is not a non-empty text: ``None`` crashed the prompt with ``AttributeError``, and an empty one prompted
    the instruction alone."""
    text = example[column]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{record} whose {column!r} column is {repr(text)[:80]}, no {column} to prompt with: drop the "
                         f"row or fill it, or map your dataset's {column} column with data.column_mapping")


def task_record(task: Task) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` rebuilding ``task`` as configured (``get_task(class_path, **init_args)``): the
    constructor's arguments that the task keeps as attributes of the same name with plain values (``prompt_format``,
    ``use_chat_template``, the rewards, ...). A checkpoint records it so that an evaluation prompts the model as it was
    trained (:func:`es_lightning.analysis.checkpoints.trained_with`)."""
    cls = type(task)
    values = {name: getattr(task, name, None) for name in accepted_options(cls)}
    args = {name: value for name, value in values.items() if isinstance(value, (bool, int, float, str))}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": args}


def task_disagreement(module_task: Task, data_task: Task) -> str | None:
    """How ``module_task`` (a training module's ``task=``, the one that prompts and grades) differs from ``data_task``
    (the data module's, whose problems it is handed), or ``None`` when the module may use it on them.

    They agree when the module's task is the data module's class or a subclass of it (a customisation of the same task:
    its own reward, say) and every option the data module's task records (:func:`task_record`: the prompt format, chat
    template and system prompt, rewards, verifier bounds, and the generator's ranges, which a checkpoint records for
    the evaluations of the run) has the same value in both. Anything else — another task, the data module's subclass
    under the module's plain task (its overrides ignored), another ``prompt_format`` — prompts or grades, or records, the
    problems otherwise than the data module says."""
    if module_task is data_task:
        return None
    if not isinstance(module_task, type(data_task)):
        return f"{module_task.name} ({type(module_task).__name__}) vs {data_task.name} ({type(data_task).__name__})"
    options = accepted_options(type(data_task))
    differ = [f"{name} {getattr(module_task, name, None)!r} vs {getattr(data_task, name, None)!r}" for name in options
              if getattr(module_task, name, None) != getattr(data_task, name, None)]
    return f"{data_task.name} with " + ", ".join(differ) if differ else None
