"""The ``es-lightning`` command: LightningCLI with the project's modules, data and callbacks.

To run::

    es-lightning validate --config recipes/eval.yaml
    es-lightning fit --config recipes/grpo_es.yaml --trainer.max_steps 20   # any key can be overridden
    es-lightning fit --config configs/trainer/cpu.yaml --config recipes/es.yaml --print_config

``--config`` stacks (later files override earlier ones). A mistake (unknown key, wrong type or value, missing file)
prints one line naming the file:line or option and the fix, and exits with status 2 (:mod:`es_lightning.cli_errors`;
``--debug`` shows the traceback). Each fit writes ``lightning_logs/<recipe>/version_N/`` (config, metrics,
``checkpoints/last.ckpt``, report, export); ``--ckpt_path last`` resumes the newest run of the recipe
(:mod:`es_lightning.run_dirs`).

The analysis commands (:mod:`es_lightning.analysis`) are plain functions whose signatures and docstrings become the
options and ``--help`` (as litgpt's ``__main__``)::

    es-lightning eval --checkpoints builtin:countdown-tiny lightning_logs/es/version_0/checkpoints/last.ckpt --tasks countdown
    es-lightning analyze drift --tuned lightning_logs/es/version_0/checkpoints/last.ckpt
    es-lightning analyze ablation --tuned lightning_logs/es/version_0/checkpoints/last.ckpt --top_percent 50 10 1 --eval.num_samples 16
    es-lightning analyze forgetting --tuned lightning_logs/es/version_0/checkpoints/last.ckpt --tasks addition sort
    es-lightning analyze sweep --recipe recipes/es.yaml --populations 8 16 32 64 --steps 10
    es-lightning analyze compare --seeds 0 1          # base / GRPO / ES / GRPO→ES / ES→GRPO table (make compare)

The commands that evaluate (``eval``, ``ablation``, ``forgetting``, ``sweep``, ``compare``) share one set of evaluation
options, ``--eval.num_problems``, ``--eval.num_samples``, ``--eval.ks``, ``--eval.temperature``, … (the fields of
:class:`~es_lightning.analysis.settings.EvalSettings`), or ``--eval file.yaml`` for all of them. List options take
space-separated values (``--tasks addition sort``) or a YAML list (``--tasks [addition, sort]``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable
from functools import partial

from es_lightning.command import CommandMixin
from es_lightning.console import say
from es_lightning.lightning_cli import ESLightningCLI, check_config

__all__ = ["CommandCLI", "ESLightningCLI", "check_config", "cli_main"]  # the LightningCLI lives in lightning_cli (no cycle)


class CommandCLI(CommandMixin, ESLightningCLI):
    """The LightningCLI of the ``es-lightning`` command: one-line errors, run directories, ``--ckpt_path last``,
    progress display (:mod:`es_lightning.command`)."""


def analysis_commands() -> dict[str, Callable | dict[str, Callable]]:
    """``es-lightning <command>`` beyond Lightning's fit/validate/test: one function per (sub)command."""
    from es_lightning.analysis import (
        ablation_command,
        compare_command,
        drift_command,
        eval_command,
        forgetting_command,
        sweep_command,
    )

    return {
        "eval": eval_command,
        "analyze": {"drift": drift_command, "ablation": ablation_command, "forgetting": forgetting_command,
                    "sweep": sweep_command, "compare": compare_command},
    }


def _list_options(function: Callable, prefix: str = "") -> set[str]:
    """Names of a function's list-typed parameters (``list[int]``, ``list[str] | None``, ...), with those of dataclass
    parameters as ``eval.ks``."""
    names = set()
    for name, hint in typing.get_type_hints(function).items():
        if name == "return":
            continue
        if dataclasses.is_dataclass(hint):
            names |= _list_options(hint, f"{prefix}{name}.")
            continue
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if any(typing.get_origin(o) is list or o is list for o in options):
            names.add(prefix + name)
    return names


def _yaml_scalar(value: str) -> str:
    try:
        float(value)
        return value
    except ValueError:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def join_list_values(args: list[str], list_options: set[str]) -> list[str]:
    """``--tasks addition sort`` → ``--tasks [\"addition\", \"sort\"]`` for list-typed options (jsonargparse wants one
    value per option); a value already written as a YAML list, or ``null``, is left as it is."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" not in arg and arg[2:] in list_options:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            values = args[i + 1 : j]
            if len(values) == 1 and (values[0].lstrip().startswith("[") or values[0] in ("null", "None")):
                out += [arg, values[0]]
            elif values:
                out += [arg, "[" + ", ".join(_yaml_scalar(v) for v in values) + "]"]
            else:
                out.append(arg)
            i = j
        else:
            out.append(arg)
            i += 1
    return out


def run_analysis(args: list[str]):
    """Run ``eval`` or ``analyze <name>`` with jsonargparse over the command's function signature."""
    from jsonargparse import CLI, set_parsing_settings
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per analysis, not one per model load
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # EvalSettings' field docstrings are its --help
    commands = analysis_commands()
    if args[0] == "analyze" and len(args) > 1 and not args[1].startswith("-") and args[1] not in commands["analyze"]:
        import difflib

        names = list(commands["analyze"])
        close = difflib.get_close_matches(args[1], names, n=1, cutoff=0.6)
        hint = (" — evaluation is its own command: es-lightning eval ..." if args[1] == "eval" else
                f"; did you mean 'analyze {close[0]}'?" if close else "")
        say(f"es-lightning analyze: error: unknown analysis {args[1]!r}{hint} (analyses: {', '.join(names)})")
        raise SystemExit(2)
    target = commands.get(args[0])
    if isinstance(target, dict) and len(args) > 1:
        target = target.get(args[1])
    if callable(target):
        args = join_list_values(args, _list_options(target))
    from es_lightning.analysis.runs import AnalysisStopped
    from es_lightning.cli_errors import ConfigError, OneLineAnalysisParser, describe_parse_error

    name = " ".join(a for a in args[:2] if not a.startswith("-"))
    run = partial(CLI, commands, args=args, as_positional=False, prog="es-lightning", parser_class=OneLineAnalysisParser)
    try:
        return run()
    except AnalysisStopped as stop:  # a SIGTERM or SLURM's requeue signal: what was cut, what is kept
        say(f"es-lightning {name}: {stop.line}")
        raise SystemExit(stop.code) from None
    except ConfigError as err:  # a misspelt option, a value of the wrong type: one line, not the usage block
        line = describe_parse_error(str(err), args, options=_command_options(run, args), command=f"es-lightning {name}")
        say(f"es-lightning {name}: error: {line}")
        raise SystemExit(2) from err
    except (FileNotFoundError, ValueError) as err:  # bad input (paths, tasks, k > n, τ < 0, ...): the message, no traceback
        say(f"es-lightning {name}: error: {err}")
        raise SystemExit(2) from err
    except Exception as err:  # the hub unreachable, a missing optional package, ...: the command's own line, if a mistake
        from es_lightning.cli_errors import debug_requested, explain

        line = None if debug_requested() else explain(err, name_owner=False)
        if line is None:  # a bug: its traceback
            raise
        say(f"es-lightning {name}: error: {line}")
        raise SystemExit(2) from err


def _command_options(run, args: list[str]) -> list[str]:
    """The ``--options`` the analysis command of ``args`` (``eval``, ``analyze <name>``) accepts, for suggestions."""
    from jsonargparse import capture_parser

    try:
        parser = capture_parser(run)
        for word in args[:2]:
            sub = parser._subcommands_action
            if sub is None or word not in sub.choices:
                break
            parser = sub.choices[word]
    except Exception:  # only for a suggestion: never hide the message itself
        return []
    return [o for action in parser._actions for o in action.option_strings
            if o.startswith("--") and not o.endswith("+") and o not in ("--help", "--config", "--print_config")]


def _help_preamble() -> str:
    """What `es-lightning --help` says before Lightning's usage: the analysis commands, where outputs go, the switches."""
    analyses = ",".join(analysis_commands()["analyze"])
    return (
        f"es-lightning fit | validate | test (below);  es-lightning eval | analyze {{{analyses}}} (each has --help)\n\n"
        "Outputs: each fit writes one run directory, <save_dir>/<name>/version_N/ (recipes: lightning_logs/<recipe>/...):\n"
        "  config.yaml, metrics.csv, checkpoints/last.ckpt (every K steps and at the end), report.json/.png, export/.\n"
        "Resume the newest run of a recipe: the same command with --ckpt_path last.\n"
        "Switches: --debug (or ES_LIGHTNING_DEBUG=1) full tracebacks;  ES_LIGHTNING_NUM_THREADS=N torch CPU threads\n"
        "  (default 1 per process);  ES_LIGHTNING_PROGRESS_SECONDS=S seconds between progress lines in a log.\n"
    )


def cli_main(args: list[str] | None = None) -> None:
    """Entry point of the ``es-lightning`` console script."""
    from es_lightning import cli_errors, console

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = cli_errors.pop_debug_flag(sys.argv[1:] if args is None else list(args))
    cli_errors.remember(argv)
    console.quiet_libraries()
    from es_lightning.distributed import end_distributed_process

    try:
        with cli_errors.one_line_errors():
            console.configure_threads()
            import es_lightning  # noqa: F401  (registers the package's classes for short class_path names)

            if argv and argv[0] in ("eval", "analyze"):
                run_analysis(argv)
                return
            if argv and argv[0] in ("-h", "--help"):
                print(_help_preamble())
            CommandCLI(args=argv)
    except SystemExit as stop:  # a mistake's one line (status 2) ends a distributed process the same way
        end_distributed_process(stop.code)
        raise
    except BaseException as error:  # a bug: its traceback and status 1, as an uncaught exception ends any process
        end_distributed_process(1, error=error)
        raise
    finally:
        cli_errors.forget()  # the command's context ends with it (a script calling cli_main goes on in Python)
    end_distributed_process(0)  # a distributed fit ends here, past the interpreter's teardown; other runs return


if __name__ == "__main__":
    cli_main()
