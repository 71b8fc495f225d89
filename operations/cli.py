"""Command lines: flags from dataclass fields, model specs (NAME,key=value), output paths, and the
one line a user's mistake becomes (one_line_errors), for every tool of the project.

Run: python -c "from operations import cli; print(cli.config_from_spec('cifar-tiny,depth=3'))"
"""
import argparse
import gc
import inspect
import os
import re
import sys
import types
from contextlib import contextmanager, suppress
from dataclasses import fields

import torch

from bamboo import Config


RUN_FILES = ("ckpt.pt", "best.pt", "log.jsonl", "eval_correct.npy")  # what train.py writes


class TrainingError(ValueError):
    """The run cannot go on; the message is one line and says what to do."""


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose mistakes are one line naming --help, not the usage's thirty lines above."""

    def error(self, message):
        self.exit(2, f"error: {message} (python {self.prog} --help lists every flag)\n")


def parser_of(groups, choices, epilog=""):
    """Every field of each (dataclass, title) as a flag. Flags not given stay unset, so that a
    preset, a pretrained trunk or a resumed checkpoint can fill them."""
    parser = OneLineErrors(description="Train bamboo models.", allow_abbrev=False,
                           formatter_class=argparse.RawTextHelpFormatter, epilog=epilog)
    for cls, title in groups:  # each flag's help: the comment after its field in cls
        group = parser.add_argument_group(title)
        comments = dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
        for f in fields(cls):
            kwargs = dict(help=f"{comments.get(f.name, '')} (default: {f.default!r})",
                          default=argparse.SUPPRESS)
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.update(type=type(f.default), choices=choices.get(f.name))
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def flags_given(args, cls):
    """The flags of dataclass cls that the command line set."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def split_spec(spec, known=None):
    """'NAME,key=value,...' -> (NAME, {key: value text}): the one way every command line names a
    model (bench.py's and probe.py's specs, timm and Hugging Face ones); each key once, and one of
    `known` if given."""
    name, *pairs = spec.split(",")
    settings = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not key or not value or (known is not None and key not in known):
            field = " with a Config field as key" if known is not None else ""
            raise ValueError(f"bad setting {pair!r} in {spec!r}; write key=value{field}")
        if key in settings:
            raise ValueError(f"{key} is given twice in {spec!r}; give it once")
        settings[key] = value
    return name, settings


BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def typed(key, text, kind=None):
    """A spec's value text as `kind` (int, float, bool, str), or where kind is None the first of a
    bool word, an integer, a number, text that it reads as. A bool is one of BOOLEANS in any case,
    never a text that reads as True."""
    if kind is None:
        if text.lower() in BOOLEANS and not text.isdigit():
            return BOOLEANS[text.lower()]
        for kind in (int, float):
            with suppress(ValueError):
                return kind(text)
        return text
    try:
        return BOOLEANS[text.lower()] if kind is bool else kind(text)
    except (KeyError, ValueError):
        raise ValueError(f"bad value in {key + '=' + text!r}: {key} takes {KINDS[kind]}") from None


def config_from_spec(spec, **defaults):
    """'PRESET[,key=value,...]', for command lines: 'bamboo-b,neutreno=0.6,objective=mae'."""
    kinds = {f.name: f.type for f in fields(Config)}
    name, given = split_spec(spec, known=kinds)
    settings = {key: typed(key, text, kinds[key]) for key, text in given.items()}
    return Config.from_preset(name, **{**defaults, **settings})


def check_output_path(flag, path):
    """Raise ValueError where path, given with flag, cannot be written as a file: call it first."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it or "
                         "write elsewhere")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give the path of a file to write")
    if os.path.basename(path) in RUN_FILES or (path.endswith(".pt") and os.path.exists(path)):
        raise ValueError(f"{flag} {path} is a training run's own file; write the output elsewhere")


def peer_lost(e):
    """Whether e is a DDP collective that failed because another rank went away."""
    words = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "nccl communicator was aborted", "timed out")
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 and any(w in str(e).lower() for w in words)


def resume_command(out_dir, world=None):
    """The command that continues the run in out_dir, started as this one was: python, or torchrun
    with its processes (a resume needs as many as the run had; world: WORLD_SIZE unless given)."""
    world = world or int(os.environ.get("WORLD_SIZE", 1))
    launcher = "python train.py"
    if world > 1:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = f" --nnodes={world // per_node}" if per_node != world else ""
        launcher = f"torchrun{nodes} --nproc_per_node={per_node} train.py"
    return f"{launcher} --resume --out_dir {out_dir}"


@contextmanager
def one_line_errors(out_dir=None):
    """with one_line_errors(out_dir) as outcome: every failure a user can fix becomes one line on
    stderr and outcome.code 2 (130 for Ctrl-C), naming out_dir's checkpoint if a run has one.
    Anything else is a bug, and raises."""
    outcome = types.SimpleNamespace(code=0)

    def left():  # what the failure left to resume from, as it is now
        if not out_dir:
            return ""
        if os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
            return f"; the last checkpoint is as it was; continue with: {resume_command(out_dir)}"
        return "; no checkpoint was written, so there is nothing to resume"

    try:
        yield outcome
        return
    except ValueError as e:  # TrainingError, DataError, CheckpointError: one line each
        message = str(e)
    except ImportError as e:
        if out_dir:  # in training a missing module is a broken install or a bug, not a choice
            raise
        message = f"this needs {e.name}; pip install it (timm, transformers: in a scratch venv)"
    except OSError as e:  # a full disk, a folder that vanished while writing
        message = (f"input/output failed on {e.filename or 'the log'} ({e.strerror or e})"
                   f"{left()}, once space is free or the path is back" if out_dir else
                   f"could not write {e.filename or 'the outputs'} ({e.strerror}); write elsewhere")
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            advice = ("--batch_size (with --grad_accum to keep the batch) or --eval_samples"
                      if out_dir else "--batch_size or the model's size")
            message = f"out of memory ({str(e).splitlines()[0][:120]}); lower {advice}{left()}"
        elif out_dir and peer_lost(e):
            message = (f"another rank of this DDP run stopped ({str(e).splitlines()[0][:100]})"
                       f"{left()}, with every rank")
        elif out_dir and "DataLoader worker" in str(e):  # torch raises it wherever the loop is
            message = (f"a streaming worker died ({str(e).splitlines()[0][:100]}; killed, or out "
                       f"of memory: fewer --workers use less){left()}")
        else:
            raise
    except KeyboardInterrupt:  # training: a second Ctrl-C, which stops without saving this step
        print(f"error: interrupted; stopped at once{left()}", file=sys.stderr)
        outcome.code = 130
        return
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr)
    outcome.code = 2


def exit_process(code):
    """Exit with code. A finished DDP rank leaves without the interpreter's shutdown, where gloo's
    threads can still touch Python objects and now and then abort a rank after a good run."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    gc.freeze()  # the interpreter's exit then skips collecting torch's objects (0.5 s on a CPU)
    sys.exit(code)
