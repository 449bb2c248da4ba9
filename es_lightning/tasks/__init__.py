"""Reasoning tasks: prompt format, answer extraction and verifier per task (README "Design", "Tasks own their verifiers").

Built in: ``countdown`` (procedural or ``Jiayi-Pan/Countdown-Tasks-3to4``), ``gsm8k``, ``math`` (MATH-500 /
DeepScaleR, needs ``es-lightning[math]``), and the procedural ``addition`` and ``sort`` used as forgetting probes and
pretraining data. A custom task is a :class:`Task` subclass, named in YAML by ``class_path`` (jsonargparse), e.g.::

    data:
      task:
        class_path: my_package.tasks.MyTask
        init_args: {correct_reward: 1.0}
"""

from __future__ import annotations

import importlib
from typing import Any

from es_lightning.tasks.arithmetic import AdditionTask, SortTask
from es_lightning.tasks.base import REWARD_FUNCTION_FIX, Task
from es_lightning.tasks.countdown import CountdownTask
from es_lightning.tasks.gsm8k import GSM8KTask
from es_lightning.tasks.math import MathTask

__all__ = ["Task", "CountdownTask", "GSM8KTask", "MathTask", "AdditionTask", "SortTask", "TASKS", "get_task"]

#: short names accepted wherever a task is configured by name
TASKS: dict[str, type[Task]] = {
    "countdown": CountdownTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    "addition": AdditionTask,
    "sort": SortTask,
}


def get_task(name_or_task: str | Task | type[Task], **kwargs: Any) -> Task:
    """A task from a registry name (``"countdown"``), a ``Task`` subclass or import path, or an instance (returned).

    ``kwargs`` go to the task's constructor (e.g. ``get_task("countdown", prompt_format="r1")``).
    """
    if isinstance(name_or_task, Task):
        if kwargs:
            raise ValueError(
                f"get_task got a ready {type(name_or_task).__name__} instance and also keyword arguments "
                f"{sorted(kwargs)}; pass either the instance or a name with its arguments"
            )
        return name_or_task
    if isinstance(name_or_task, type) and issubclass(name_or_task, Task):
        return name_or_task(**kwargs)
    if not isinstance(name_or_task, str):
        fix = f" {getattr(name_or_task, '__name__', '')}; {REWARD_FUNCTION_FIX}" if callable(name_or_task) else ""
        raise TypeError(f"get_task expects a task name, a Task subclass or instance, got "
                        f"{type(name_or_task).__name__}{fix}")
    key = name_or_task.strip().lower()
    if key in TASKS:
        return TASKS[key](**kwargs)
    if "." in name_or_task:
        return _import_task(name_or_task.strip())(**kwargs)
    raise ValueError(
        f"unknown task {name_or_task!r}; known tasks: {', '.join(sorted(TASKS))}. A custom task plugs in as a Task "
        "subclass named by its import path: in YAML `task: {class_path: my_package.MyTask, init_args: {...}}`"
    )


def _import_task(path: str) -> type[Task]:
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"cannot import task class {path!r} ({err}); known tasks: {', '.join(sorted(TASKS))}, or the import path "
            "of a Task subclass on PYTHONPATH"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"{path!r} is not a subclass of es_lightning.tasks.Task")
    return cls
