"""Training algorithms as objects: the update rule a :class:`~es_lightning.modules.base.ReasoningModule` runs.

The module owns everything ES and GRPO share — the policy, the generator, rollouts, scoring, the shared metrics and the
stage record (README "Design", "Algorithms are objects, not classes to swap"). An :class:`Algorithm` supplies only what
differs: its settings (one dataclass, each field documented once), ``configure_optimizers`` and ``training_step``.
:class:`~es_lightning.SequentialStrategy` switches a running fit by giving the module another algorithm object.

Algorithms are registered by name, as verl registers its advantage estimators (``@register_adv_est``), so a stage can
be named in a YAML recipe and restored from a checkpoint by that name.

How to add an algorithm (one new file, nothing else edited)::

    @dataclass
    class MySettings:
        lr: float = 1e-5
        \"\"\"Step size (the paper, section, and why this default).\"\"\"

    @register_algorithm
    class MyAlgorithm(Algorithm):
        name = "mine"
        Settings = MySettings
        def configure_optimizers(self, module): return torch.optim.SGD(module.model.parameters(), lr=self.settings.lr)
        def training_step(self, module, batch, batch_idx): ...  # rollouts: module.rollout; metrics: module.log_step
    class MyModule(ReasoningModule, algorithm=MyAlgorithm): \"\"\"Docstring.\"\"\"   # YAML keys = module's + MySettings'

``MyModule`` then takes every ``MySettings`` field as a keyword (with its type, default and help in
``es-lightning fit --help``), and ``SequentialStrategy(switch_step=..., algorithm="mine", settings={...})`` switches to it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from lightning import LightningModule

from es_lightning.generation import SamplingParams

__all__ = ["Algorithm", "algorithm_names", "check_types", "get_algorithm", "register_algorithm", "settings_docs",
           "settings_hints"]

_REGISTRY: dict[str, type[Algorithm]] = {}

#: the module's rollout settings a stage may set besides its algorithm's own (``SequentialStrategy(es={...})``)
SAMPLING_KEYS = ("temperature", "top_p", "max_new_tokens")


class Algorithm(ABC):
    """One training algorithm: its settings, its optimizer and its training step, acting on a module.

    Subclasses set :attr:`name` and :attr:`Settings` and implement :meth:`configure_optimizers` and
    :meth:`training_step`; the other methods are optional hooks. ``module`` is always the
    :class:`~es_lightning.modules.base.ReasoningModule` (annotated by its Lightning base class: ``modules.base`` imports
    this file, so this file imports nothing of ``modules``). An algorithm holds no policy weights (the module
    does); it may hold per-fit helpers (ES: its population evaluator; GRPO: the frozen reference policy).

    Args:
        settings: an instance of :attr:`Settings`, or a mapping of its fields (validated by the dataclass).
    """

    #: registry name, e.g. ``"es"``; also the stage name a checkpoint records
    name: ClassVar[str]
    #: the dataclass of the algorithm's settings (fields with attribute docstrings, validated in ``__post_init__``)
    Settings: ClassVar[type]
    #: whether every data-parallel rank trains on the same batch of prompts (ES: the population shares it) rather than
    #: on its own (GRPO). A fit's data layout is fixed by its first stage.
    shares_batch_across_ranks: ClassVar[bool] = False

    def __init__(self, settings: Any = None) -> None:
        if settings is None:
            settings = self.Settings()
        elif isinstance(settings, Mapping):
            settings = make_settings(self.Settings, settings, owner=f"{type(self).__name__}")
        elif not isinstance(settings, self.Settings):
            raise TypeError(f"{type(self).__name__} takes a {self.Settings.__name__}, got {type(settings).__name__}")
        self.settings = settings

    # ------------------------------------------------------------------ what every algorithm supplies
    @abstractmethod
    def configure_optimizers(self, module: LightningModule) -> Any:
        """What :meth:`LightningModule.configure_optimizers` returns for this algorithm (optimizer, schedulers)."""

    @abstractmethod
    def training_step(self, module: LightningModule, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """One training step on ``batch`` (manual optimization: call ``module.optimizers().step()``)."""

    # ------------------------------------------------------------------ optional hooks
    @classmethod
    def default_sampling(cls) -> dict[str, Any]:
        """Rollout settings this algorithm defaults to (module keys ``temperature``, ``top_p``, ``max_new_tokens``)."""
        return {}

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        """Refuse rollout settings the algorithm cannot train with (raise ``ValueError`` naming the fix)."""
        return None

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps (``trainer.global_step`` increments) per training batch."""
        return 1

    def configure_model(self, module: LightningModule) -> None:
        """Called whenever the module (re)configures its policy, and when a switch makes this algorithm active."""
        return None

    def on_fit_start(self, module: LightningModule) -> None:
        """Called at fit start, and at a switch, once the policy is placed (sharded, on its device)."""
        return None

    def apply_settings(self, optimizers: Sequence[Any], schedulers: Sequence[Any], changed: Collection[str]) -> None:
        """Write the settings in ``changed`` that an optimizer carries (its ``param_groups``: ``lr`` …) and its LR
        schedulers' base values into the fit's ``optimizers`` and ``schedulers``. Called at train start of a resume
        whose configured settings differ from the checkpoint's (``changed``, the names the module warns about): the
        optimizer and scheduler state come from the checkpoint, param groups included, and would otherwise keep the
        checkpoint's ``lr``. Settings that did not change are left as restored (an LR schedule of the user's own keeps
        its state)."""
        return None

    def check_batch(self, batch_size: int) -> None:
        """Refuse (``ValueError`` naming the fix) a training batch of ``batch_size`` prompts per rank that this
        algorithm cannot split. Called at fit setup, for a :class:`~es_lightning.SequentialStrategy`'s second stage too."""
        return None

    def check_rollouts(self, sampling: SamplingParams) -> None:
        """Refuse (``ValueError`` naming the fix) rollout settings that do not go with this algorithm's settings (ES:
        several samples per member at temperature 0, which are identical). Called with the module's rollout settings
        when the algorithm is set, and for a :class:`~es_lightning.SequentialStrategy`'s second stage when the callback
        is built."""
        return None

    def check_generation(self, backend: str, options: Mapping[str, Any]) -> None:
        """Refuse (``ValueError`` naming the fix) settings the generation backend cannot run (ES: several full-rank
        members per call on vLLM). Called when the module is built and before a stage switch."""
        return None

    def check_stage(self, module: LightningModule) -> None:
        """Refuse (``ValueError`` naming the fix) what this algorithm would refuse once it runs on ``module``'s loaded
        policy (ES: a noise rank beyond a matrix, parameters LoRA members cannot perturb on vLLM). Called at fit
        start for a :class:`~es_lightning.SequentialStrategy`'s second stage, so that nothing is refused at the switch,
        after the first stage has trained."""
        return None

    def warn_once(self, key: str, message: str) -> None:
        """``rank_zero_warn(message)`` the first time ``key`` comes up in this algorithm object's life (a fit, or a
        stage of one): a condition worth a word, not one per step."""
        said = self.__dict__.setdefault("_warned", set())
        if key not in said:
            said.add(key)
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings!r})"


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` available by ``cls.name`` (recipes, :class:`SequentialStrategy`, checkpoints)."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register_algorithm takes an Algorithm subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty string")
    if not dataclasses.is_dataclass(getattr(cls, "Settings", None)):
        raise TypeError(f"{cls.__name__}.Settings must be a dataclass (one documented field per setting)")
    existing = _REGISTRY.get(name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"algorithm name {name!r} is taken by {existing.__module__}.{existing.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered as ``name`` (ES and GRPO register when ``es_lightning`` is imported)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; registered: {algorithm_names()}") from None


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------- settings dataclasses
def make_settings(settings_cls: type, values: Mapping[str, Any], owner: str) -> Any:
    """``settings_cls(**values)`` with unknown names refused by a message that lists the accepted ones, and values of
    the wrong type by one naming the setting (:func:`check_types`)."""
    known = [f.name for f in dataclasses.fields(settings_cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{owner}: unknown key(s) {unknown}; accepted: {known}")
    check_types(owner, values, settings_hints(settings_cls))
    return settings_cls(**values)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` as far as a setting goes (ints for ``float``; numpy scalars; lists for
    tuples); hints it cannot read (``Any``, classes of generics it does not know) accept anything."""
    import numbers

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is bool:
        return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))
    if isinstance(value, bool):  # a bool is an int to Python, never a count or a scale to a setting
        return False
    if hint is int:
        return isinstance(value, numbers.Integral)
    if hint is float:
        return isinstance(value, numbers.Real)
    if hint is str:  # a dtype setting also takes a torch.dtype (dtype, master_dtype: resolve_dtype reads both)
        import torch

        return isinstance(value, (str, torch.dtype))
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    if origin in (list, Sequence):
        return isinstance(value, (list, tuple))
    if isinstance(hint, type) and origin is None:
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None and isinstance(hint, type) else \
        str(hint).replace("typing.", "")


def check_types(owner: str, values: Mapping[str, Any], hints: Mapping[str, Any]) -> None:
    """Refuse, in one line naming the setting, a value of another type than its annotation (``population_size=8.0``
    would otherwise fail mid-fit, ``temperature="1"`` in a comparison that names nothing); YAML and the command line
    are typed by jsonargparse before they get here, a Python script is not."""
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None or _matches(value, hint):
            continue
        expected = _type_name(hint)
        fix = ""
        if hint is int and isinstance(value, float) and value.is_integer():
            fix = f"; use {name}={int(value)}"
        elif isinstance(value, str):
            fix = "; pass a number, not a string" if hint in (int, float) else ""
        elif hint is str and isinstance(value, os.PathLike):
            fix = f"; pass {name}=str(path)"
        elif name == "task" and callable(value) and not isinstance(value, type):  # a TRL reward function
            from es_lightning.tasks.base import REWARD_FUNCTION_FIX

            fix = f"; {REWARD_FUNCTION_FIX}"
        raise TypeError(f"{owner}: {name} must be {expected}, got {value!r} ({type(value).__name__}){fix}")


def settings_hints(settings_cls: type) -> dict[str, Any]:
    """Field name → its evaluated type (dataclass annotations are strings under ``from __future__ import annotations``)."""
    module = inspect.getmodule(settings_cls)
    return typing.get_type_hints(settings_cls, vars(module) if module else None)


def settings_docs(settings_cls: type) -> dict[str, str]:
    """Field name → its attribute docstring (the string literal after the field), one line (litgpt's ``args.py``)."""
    docs: dict[str, str] = {}
    for cls in reversed(settings_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):  # defined without source (e.g. in a REPL)
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def validate_choice(name: str, value: Any, choices: tuple, hint: str = "") -> None:
    """``ValueError`` naming the setting, the value, the accepted values and (optionally) a hint."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}" + (f"; {hint}" if hint else ""))
