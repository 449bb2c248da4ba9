"""What a class's constructor accepts: shared by the command line's error messages (:mod:`es_lightning.cli_errors`) and
a checkpoint's record of its task (:func:`es_lightning.tasks.base.task_record`)."""

from __future__ import annotations

import contextlib
import inspect


def accepted_options(cls) -> list[str]:
    """The keyword arguments a class accepts: its ``__init__``'s, and its parents' as far as ``**kwargs`` pass them on
    (a constructor without ``**kwargs`` ends the walk — what it passes to its parent is fixed, not an option)."""
    names: list[str] = []
    for klass in getattr(cls, "__mro__", [cls]):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = list(inspect.signature(init).parameters.values())
        except (TypeError, ValueError):
            break
        names += [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    with contextlib.suppress(TypeError, ValueError):
        names += [p.name for p in inspect.signature(cls).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names]
    return list(dict.fromkeys(n for n in names if not n.startswith("_")))
