"""The ``__init__`` of a module bound to one algorithm, made from its settings dataclass — the settings written once.

``class ESModule(ReasoningModule, algorithm=ESAlgorithm)`` gets ``ESModule(model=..., population_size=..., sigma=...,
temperature=...)``: the :class:`ReasoningModule` arguments plus every field of ``ESAlgorithm.Settings``, with its type,
default and attribute docstring. The signature is a real :class:`inspect.Signature` (``__signature__``) and the class
docstring gains a generated ``Args:`` section, so Python (unknown keywords are a ``TypeError``), jsonargparse /
LightningCLI (types, defaults, ``--help`` text, a misspelt key refused) and Sphinx all read the same thing.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from es_lightning.algorithms import Algorithm, check_types, settings_docs, settings_hints

#: ReasoningModule arguments that may be passed positionally (the rest are keyword-only)
_POSITIONAL = ("model", "dtype", "trust_remote_code", "task")


def build_module_init(cls: type, base_cls: type, algorithm: type[Algorithm]) -> None:
    """Give ``cls`` an ``__init__`` taking ``base_cls``'s arguments plus ``algorithm.Settings``' fields."""
    base_sig = inspect.signature(base_cls.__init__)
    base_hints = typing.get_type_hints(base_cls.__init__, vars(inspect.getmodule(base_cls)))
    base_params = [p for p in base_sig.parameters.values() if p.name != "self"]
    base_names = [p.name for p in base_params]
    fields = dataclasses.fields(algorithm.Settings)
    setting_names = [f.name for f in fields]
    clash = sorted(set(base_names) & set(setting_names))
    if clash:
        raise TypeError(f"{algorithm.__name__}.Settings fields {clash} clash with {base_cls.__name__} arguments")
    sampling_defaults = algorithm.default_sampling()
    hints = settings_hints(algorithm.Settings)

    kw_only = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [p.replace(annotation=base_hints.get(p.name, p.annotation)) for p in base_params if p.name in _POSITIONAL]
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        params.append(inspect.Parameter(f.name, kw_only, default=default, annotation=hints[f.name]))
    for p in base_params:
        if p.name not in _POSITIONAL:
            params.append(p.replace(kind=kw_only, default=sampling_defaults.get(p.name, p.default),
                                    annotation=base_hints.get(p.name, p.annotation)))
    signature = inspect.Signature(params)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as err:  # an unknown or misspelt keyword
            accepted = [p.name for p in params[1:]]
            trl = [k for k in ("reward_funcs", "reward_weights") if k in kwargs]
            if trl:  # TRL's GRPOTrainer arguments: the reward is the task's here
                from es_lightning.tasks.base import REWARD_FUNCTION_FIX

                what = "is TRL's GRPOTrainer argument" if len(trl) == 1 else "are TRL's GRPOTrainer arguments"
                raise TypeError(f"{type(self).__name__}: {' and '.join(trl)} {what}, not ours; "
                                f"{REWARD_FUNCTION_FIX}") from None
            raise TypeError(f"{type(self).__name__}: {err}; accepted: {accepted}") from None
        bound.apply_defaults()
        values = {k: v for k, v in bound.arguments.items() if k != "self"}
        check_types(type(self).__name__, values, __init__.__annotations__)
        base_cls.__init__(self, **{k: values[k] for k in base_names})
        self.save_hyperparameters({k: v for k, v in values.items() if k != "task"})
        self.set_algorithm(algorithm({k: values[k] for k in setting_names}))

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    __init__.__annotations__ = {p.name: p.annotation for p in params[1:]}
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    __init__.__doc__ = f"See :class:`{cls.__name__}` (arguments of :class:`{base_cls.__name__}` and of " \
                       f"``{algorithm.Settings.__name__}``)."
    cls.__init__ = __init__
    cls.__doc__ = _docstring(cls.__doc__ or "", base_cls, algorithm, [p.name for p in params[1:]])


def _docstring(intro: str, base_cls: type, algorithm: type[Algorithm], order: list[str]) -> str:
    """``intro`` plus an ``Args:`` section: each argument's line from the base class docstring or the settings field."""
    from docstring_parser import parse

    docs = {p.arg_name: " ".join(p.description.split()) for p in parse(base_cls.__doc__ or "").params}
    docs.update(settings_docs(algorithm.Settings))
    lines = [f"    {name}: {docs.get(name, '')}" for name in order]
    return inspect.cleandoc(intro) + "\n\nArgs:\n" + "\n".join(lines) + "\n"
