"""The operations around a training run, kept out of train.py's way.

Flags from dataclass fields, model specs (PRESET,key=value), settings checks, resuming safely,
the out_dir and its lock, signals and the time limit, stopping on a non-finite loss, log repair
after a kill, progress lines, the summary, and main's one-line errors. train.py calls each by
what it does; none is a step verb.
"""
import argparse
import errno
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from contextlib import contextmanager, suppress
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

from operations import checkpoint
from operations import fast
from bamboo import TRUNK, Config
from data import IMAGE_DATASETS, TEXT_DATASETS, DataError
from operations.datasets import ImageStream

PROGRESS_EVERY_S = 30  # in a log file, a progress line at most this often
# what train.py writes into an out_dir
RUN_FILES = ("ckpt.pt", "best.pt", "log.jsonl", "eval_correct.npy")


class TrainingError(Exception):
    """The run cannot go on; the message is one line and says what to do."""


# ----------------------------------------------------------------------------- settings

def parser_of(groups, choices, epilog=""):
    """Every field of each (dataclass, title) as a flag. Flags not given stay unset, so that a
    preset, a pretrained trunk or a resumed checkpoint can fill them."""
    parser = argparse.ArgumentParser(description="Train bamboo models.", allow_abbrev=False,
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
                kwargs["type"] = type(f.default)
                if choices.get(f.name):
                    kwargs["choices"] = choices[f.name]
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


def config_from_spec(spec, **defaults):
    """'PRESET[,key=value,...]', for command lines: 'bamboo-b,neutreno=0.6,objective=mae'."""
    types = {f.name: f.type for f in fields(Config)}
    name, given = split_spec(spec, known=types)
    settings = dict(defaults)
    for key, value in given.items():
        pair = f"{key}={value}"
        try:  # a bool: one of BOOLEANS in any case, never a silent False
            settings[key] = BOOLEANS[value.lower()] if types[key] is bool else types[key](value)
        except (KeyError, ValueError):
            kinds = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
            kind = kinds[types[key]]
            raise ValueError(f"bad value in {pair!r}: {key} takes {kind}") from None
    return Config.from_preset(name, **settings)


def settings_block(values, sources, width=100):
    """The settings a run uses, grouped by where each came from (flags, a resumed run, a preset or
    its recipe, the --init_from trunk, derived); the defaults are left to --help."""
    groups = {}
    for name, source in sources.items():
        if name in values:
            groups.setdefault(source, []).append(f"{name}={values[name]}")
    lines = []
    for source, items in groups.items():
        line = f"from {source}:"
        for item in items:
            if len(line) + 1 + len(item) > width:
                lines.append(line)
                line = "   "
            line += " " + item
        lines.append(line)
    return lines + ["every other setting: its default (python train.py --help)"]


def check_invocation(args):
    """What no setting can fix: torch too old, or --resume with --overwrite."""
    if not hasattr(torch.compiler, "set_stance"):  # evaluate() needs it; check before any work
        raise TrainingError(f"torch {torch.__version__} is older than 2.6, the oldest release "
                            "this code runs on; pip install -r requirements.txt")
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        raise TrainingError("--resume continues the run in --out_dir and --overwrite "
                            "replaces it; choose one")
    if getattr(args, "eval_only", False) and getattr(args, "overwrite", False):
        raise TrainingError("--eval_only saves nothing, so it replaces nothing; drop --overwrite")


def check_settings(cfg):
    """Every training setting (after schedule_defaults): one line naming the flag and the fix."""
    checks = [
        ("batch_size", cfg.batch_size >= 1, "must be at least 1"),
        ("grad_accum", cfg.grad_accum >= 1, "must be at least 1"),
        ("max_iters", cfg.max_iters >= 1, "must be at least 1"),
        ("base_lr", cfg.base_lr >= 0 and math.isfinite(cfg.base_lr),
         "must be a finite number >= 0"),
        ("lr", cfg.lr >= 0 and math.isfinite(cfg.lr),
         "must be a finite number >= 0, or -1 (base_lr x batch / 256)"),
        ("min_lr", 0 <= cfg.min_lr <= max(cfg.lr, 0),
         f"must be in [0, --lr {cfg.lr}]; lower --min_lr"),
        ("warmup", cfg.warmup >= 0, "must be >= 0, or -1 (max(100, 10 x depth))"),
        ("weight_decay", cfg.weight_decay >= 0, "must be >= 0"),
        ("beta2", 0 < cfg.beta2 < 1, "must be in (0, 1)"),
        ("grad_clip", cfg.grad_clip >= 0, "must be >= 0 (0 turns clipping off)"),
        ("layer_decay", 0 < cfg.layer_decay <= 1, "must be in (0, 1] (1 turns layer decay off)"),
        ("eval_interval", cfg.eval_interval >= 1, "must be at least 1"),
        ("eval_samples", cfg.eval_samples >= 0, "must be >= 0 (0 means the whole held-out split)"),
        ("train_samples", cfg.train_samples >= 0,
         "must be >= 0 (0 means the whole training split)"),
        ("log_interval", cfg.log_interval >= 1, "must be at least 1"),
        ("threads", cfg.threads >= 0, "must be >= 0 (0: torch's default)"),
        ("probe_samples", cfg.probe_samples >= 0, "must be >= 0 (0 turns the per-layer metrics "
         "off)"),
        ("time_limit", 0 <= cfg.time_limit < math.inf, "must be a number of seconds >= 0 (0 "
         "means no limit)"),
        ("out_dir", cfg.out_dir.strip() != "", "must name a folder"),
        ("seed", -2 ** 63 <= cfg.seed < 2 ** 63 - 1024, "must fit in 64 bits (at most 18 digits)"),
        ("memory_gb", cfg.memory_gb >= 0, "must be >= 0 (0 streams every image folder)"),
        ("workers", cfg.workers >= -1, "must be >= 0, or -1 (the CPUs per rank but one, at most "
         "8)"),
        ("crop_scale", 0 < cfg.crop_scale <= 1 or cfg.crop_scale == -1, "must be in (0, 1], or -1 "
         "(MAE's for the objective)"),
        ("stream", cfg.stream != "on" or cfg.dataset in IMAGE_DATASETS or cfg.resume,
         f"reads image files; --dataset {cfg.dataset} is text, tokenized once "
         "(drop --stream)"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise TrainingError(f"--{name} {getattr(cfg, name)!r} {why}")
    if cfg.wandb_project:
        try:
            import wandb  # noqa: F401 (there before any work, or one line)
        except ImportError:
            raise TrainingError("--wandb_project needs the wandb package: pip install wandb "
                                "(WANDB_MODE=offline logs without network), or drop the flag") \
                from None


def check_dataset_fits(objective, dataset, image_objectives):
    """An image objective needs an image dataset, a text objective a text one."""
    image = objective in image_objectives
    if image != (dataset in IMAGE_DATASETS):
        wanted = IMAGE_DATASETS if image else TEXT_DATASETS
        raise TrainingError(f"--objective {objective} needs "
                            f"{'an image' if image else 'a text'} dataset "
                            f"({', '.join(wanted)}), not --dataset {dataset}")


def check_vocab_size(asked, tokenizer_ids):
    """--vocab_size, if given, must be the tokenizer's number of ids."""
    if asked is not None and asked != tokenizer_ids:
        raise TrainingError(f"--vocab_size {asked} differs from the tokenizer's {tokenizer_ids} "
                            "ids; drop --vocab_size (--tokenizer sets it)")


def check_recipe_fits(preset, dataset, text_preset):
    """A laptop preset carries a recipe for one modality: a text preset's on images, or the other
    way round, would train with the wrong recipe."""
    if text_preset == (dataset in IMAGE_DATASETS):
        kind = "a text" if text_preset else "an image"
        raise TrainingError(f"--preset {preset} is {kind} preset (its recipe is for "
                            f"{'text' if text_preset else 'images'}), not for --dataset {dataset};"
                            " choose a preset of the dataset's kind or set the model flags")


def resumed_settings(args, train_config, model_config, resumable, per_invocation):
    """(the saved run's train_config with the `resumable` flags given now, the checkpoint); any
    other flag given must agree with the saved run."""
    path = os.path.join(getattr(args, "out_dir", train_config.out_dir), "ckpt.pt")
    ckpt = checkpoint.load(path)
    saved = ckpt.get("train")
    if not isinstance(saved, dict) or set(saved) - {f.name for f in fields(train_config)}:
        raise checkpoint.CheckpointError(f"{path} has no training state this version can resume; "
                                         "fine-tune from it with --init_from instead")
    now = flags_given(args, train_config)
    if now.get("init_from", saved.get("init_from")) != saved.get("init_from"):
        raise TrainingError(f"--resume continues from {path}; --init_from counts only when a run "
                            f"starts (this one started from {saved.get('init_from') or 'scratch'})"
                            "; drop --init_from")
    for name, value in {**now, **flags_given(args, model_config)}.items():
        before = saved.get(name, ckpt["config"].get(name))
        if name not in resumable + per_invocation and value != before:
            hint = " or fine-tune from it with --init_from" if name == "objective" else ""
            may = " ".join("--" + n for n in resumable)
            raise TrainingError(f"--resume: the run in {os.path.dirname(path)} has "
                                f"{name}={before!r}, not {value!r}; "
                                f"--resume may change only {may}; drop --{name}{hint}")
    # fields added since: defaults
    settings = {f.name: saved.get(f.name, f.default) for f in fields(train_config)}
    for f in fields(train_config):
        kinds = (int, float) if f.type is float else f.type
        value = settings[f.name]
        if not isinstance(value, kinds) or (f.type is not bool and isinstance(value, bool)):
            raise checkpoint.CheckpointError(f"{path}: its training setting {f.name}={value!r} is "
                                             "damaged; train again")
    settings.update({name: getattr(train_config, name) for name in per_invocation})
    settings.update({k: v for k, v in now.items() if k in resumable + per_invocation})
    return train_config(**settings), ckpt  # every field, of its type: checked above


def check_same_data(resumed, data, data_dir, eval_samples, master=True):
    """A resumed image run must see the class folders it was trained on, in the same order (labels
    are class indices: renamed or reordered folders would train on permuted labels), and a folder
    the same files (added or removed ones would change the data order silently). Other data in the
    same files (edited, or decoded by another PIL), or another --eval_samples, is said."""
    saved, now = resumed.get("classes"), getattr(data, "classes", None)
    if saved is not None and now is not None and list(saved) != list(now):
        raise TrainingError(f"--resume: the run was trained on the classes {saved[:6]}, but "
                            f"{data_dir} holds {now[:6]}; point --data_dir at the same "
                            "class folders (same names, so the same order)")
    saved, now = resumed.get("listing"), getattr(data, "listing", None)
    if saved is not None and now is not None and saved != now:
        raise TrainingError(f"--resume: the training images in {data_dir} are not the ones the run "
                            "was trained on (files added, removed or renamed since); put the "
                            "folder back as it was, or start a new run on it")
    saved = resumed.get("checksum")  # read on rank 0 only: a stream's walks the whole folder
    now = getattr(data, "checksum", None) if master and saved is not None else None
    if now is not None and saved != now:
        print(f"note: --resume: the data in {data_dir} differ from the run's (edited since, copied "
              "without their times, or decoded by another PIL version): training goes on with "
              "them as they are now, and 'best' compares evaluations on both", flush=True)
    before = resumed["train"].get("eval_samples", eval_samples)
    if master and before != eval_samples:
        print(f"note: --eval_samples {eval_samples} (the run evaluated {before} before): 'best' "
              "now compares evaluations on different held-out sets", flush=True)


def check_scored_as_trained(path, ckpt, settings):
    """--eval_only --init_from scores a checkpoint as it was trained: flags that reshape the model
    or change its objective would score another model, a head that was never trained."""
    changed = sorted(k for k, v in settings.items() if ckpt["config"].get(k, v) != v)
    if changed:
        raise TrainingError(f"--eval_only --init_from {path} scores that checkpoint as it was "
                            f"trained; drop --{' --'.join(changed)} (to score another head, "
                            "fine-tune it first: drop --eval_only)")


def load_whole(model, state, path):
    """Every weight of a checkpoint into model, or one line: data other than the checkpoint's
    (another class count, image size or vocabulary) gives the model other shapes."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line),
                     str(e).splitlines()[0])
        raise TrainingError(f"--init_from {path} does not fit this data ({first[:160]}); score it "
                            "on the data it was trained on (drop --dataset and --data_dir)") \
            from None


def check_trunk_loaded(model, path, loaded, skipped):
    """Fine-tuning must start from the pretrained trunk: every block tensor and the stem must come
    from the checkpoint, or a text trunk for an image model, or a flag that reshapes the trunk,
    would silently train from scratch. Fewer blocks than the checkpoint is allowed. Returns the
    line that says what was loaded."""
    missing = [name for name in model.state_dict() if name.startswith(TRUNK) and name not in loaded]
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise TrainingError(f"--init_from {path} does not hold this model's trunk: {len(missing)} "
                            f"tensors are absent or shaped differently ({names}); fine-tune from "
                            "a checkpoint of the same modality and tokenizer, without flags that "
                            "reshape its trunk (--width, --mlp_ratio, --patch_size, --vo_param)")
    return (f"init_from {path}: loaded {len(loaded)} tensors, skipped {len(skipped)} "
            f"({', '.join(sorted({s.split('.')[0] for s in skipped})) or 'none'})")


# ----------------------------------------------------------------------------- the out_dir

@contextmanager
def out_dir_claimed(out, resume, overwrite, writes=True):
    """with out_dir_claimed(...): the run. Before any data is decoded, out_dir must be a writable
    folder that no other train.py is using (a lock held for the whole run), with no other run's
    files unless --resume or --overwrite. Temporary files of a write that a kill cut short are
    removed (the lock says none is ours). On the way out the lock goes, and the folder too if this
    run made it and left it empty. A process that writes nothing (other DDP ranks, --eval_only)
    touches nothing."""
    if not writes:
        yield
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out_dir {out} is a file, not a folder; choose another --out_dir")
    created = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise TrainingError(f"cannot create --out_dir {out} ({e.strerror}); "
                            f"choose another --out_dir") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainingError(f"--out_dir {out} is not writable; choose another --out_dir or "
                            f"fix its permissions")
    lock = lock_out_dir(out)
    try:
        linked = [n for n in RUN_FILES if os.path.islink(os.path.join(out, n))]
        if linked:  # never read, appended to or removed through a link out of out_dir
            raise TrainingError(f"{os.path.join(out, linked[0])} is a link; a run writes only its "
                                "own files in --out_dir; remove the link")
        names = "|".join(re.escape(f".{f}.") for f in RUN_FILES)
        ours = re.compile(f"(?:{names})[a-z0-9_]{{8}}\\.tmp")
        for name in os.listdir(out):  # atomic_write's temporary names (mkstemp's), only
            if ours.fullmatch(name):
                os.remove(os.path.join(out, name))
        taken = [n for n in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(out, n))]
        if taken and not resume and not overwrite:
            raise TrainingError(f"--out_dir {out} holds another run ({', '.join(taken)}); "
                                "continue it with --resume, choose another --out_dir, or pass "
                                "--overwrite to replace it")
        yield
    finally:
        release_out_dir(out, lock, created)


def remove_old_run(out):
    """--overwrite, once the new run has passed every check: the old run's files go, said."""
    old = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
    for name in old:
        os.remove(os.path.join(out, name))
    if old:
        print(f"--overwrite: removed the old run's {' '.join(old)} from {out}", flush=True)


def lock_out_dir(out):
    """A POSIX lock on out_dir/.lock for this process's lifetime (forked DataLoader workers do not
    inherit it): a second run into the same folder stops at once. None where there is no fcntl."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return None
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:  # O_NOFOLLOW, O_NONBLOCK: a link or a pipe planted as .lock fails here, never hangs
        fd = os.open(os.path.join(out, ".lock"), flags, 0o644)
    except OSError as e:
        raise TrainingError(f"cannot open {os.path.join(out, '.lock')} ({e.strerror}); remove "
                            "it") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise TrainingError(f"another train.py is running in --out_dir {out}; wait for it to "
                                "finish or choose another --out_dir") from None
        raise TrainingError(f"cannot lock --out_dir {out} ({e.strerror}); its file system may not "
                            "support locks: choose a local --out_dir") from None
    return fd


def release_out_dir(out, lock, created):
    """Remove .lock if empty (a run's: one with something in it is not ours) and out_dir if this
    run made it and left it empty; then let go of the lock."""
    with suppress(OSError):  # a folder made read-only: the error that stopped the run is the one
        if lock is not None and os.path.getsize(os.path.join(out, ".lock")) == 0:  # to report
            os.remove(os.path.join(out, ".lock"))
        if created and not os.listdir(out):
            os.rmdir(out)
    if lock is not None:
        os.close(lock)


@contextmanager
def process_group_left(ddp):
    """A DDP rank leaves its group on the way out, however the run ended."""
    try:
        yield
    finally:
        if ddp:
            dist.destroy_process_group()


def read_log(path):
    """The records of a log.jsonl, in order: for a resume and for look.py. A last line that a kill
    cut short (no newline) is left out; any other line that is not a record train.py writes is
    damage, one line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a log train.py wrote (not UTF-8 text)") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines) and not line.endswith("\n"):  # a kill mid-write
                continue
            record = None
        if not is_record(record):
            raise ValueError(f"{path} line {n} is not a record train.py writes "
                             f"({line.strip()[:60]}); the log is damaged: remove that line")
        records.append(record)
    return records


def is_record(record):
    """A log record as train.py writes it: an invocation's first record, or an integer step with
    numbers (NaN included), hashes, and per-layer metrics as lists of numbers or nulls."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(record, dict) or "run" in record:
        return isinstance(record, dict)
    layers = record.get("layers", {}) or {}
    return (isinstance(record.get("step"), int) and isinstance(layers, dict)
            and all(isinstance(v, list) and all(x is None or number(x) for x in v)
                    for v in layers.values())
            and all(number(v) or k == "eval" or (k.endswith("sha256") and isinstance(v, str))
                    for k, v in record.items() if k not in ("step", "layers")))


def forget_unsaved_steps(log_path, step):
    """log.jsonl without the records after the checkpoint's step: the run repeats those steps, and a
    killed run's log would otherwise hold them twice."""
    if os.path.exists(log_path):
        kept = [r for r in read_log(log_path) if r.get("step", 0) <= step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        checkpoint.atomic_write(log_path, lambda f: f.write(text.encode()))


def code_and_machine(device):
    """What made a run: the commit (and whether the tree had uncommitted changes), the command
    line, torch and the device. Outside a git checkout the commit is None."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True,
                              timeout=10)
        return done.stdout.strip() if done.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        changes = git("status", "--porcelain", "--untracked-files=no")  # to tracked files
    except (OSError, subprocess.SubprocessError):  # no git on this machine
        commit, changes = None, None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"commit": commit, "uncommitted_changes": bool(changes) if commit else None,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "torch": str(torch.__version__), "device": name}


# ----------------------------------------------------------------------------- stopping

def any_rank(flag, device):
    """Under DDP, True on every rank if it is True on any (so all ranks stop together)."""
    value = torch.tensor([float(flag)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@contextmanager
def stop_signals(ddp=False, master=True):
    """with stop_signals() as stop: Ctrl-C and SIGTERM (what schedulers send) set stop.reason; the
    loop finishes the step (under DDP, the steps up to the next one that logs the loss), saves and
    exits; a second Ctrl-C stops at once. The handlers before are put back on the way out."""
    stop = types.SimpleNamespace(reason=None)

    def handler(signum, frame):
        if stop.reason == "interrupted" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.reason = "interrupted"
        when = "the next step that logs the loss" if ddp else "this step"
        if master:
            print(f"\nstop requested: finishing {when}, then saving a checkpoint (Ctrl-C again "
                  "stops at once, without saving)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


class Clock:
    """The run's timing: the steps so far, the last evaluation and save; from them, where
    --time_limit stops the run, the progress lines and the summary's speed."""

    def __init__(self, t_begin, cfg, held_out_batches):
        self.t_begin, self.cfg, self.held_out_batches = t_begin, cfg, held_out_batches
        self.step_times = []  # seconds per step, evaluations left out
        self.eval_s = self.save_s = None  # seconds the last evaluation and checkpoint took
        self.said = 0.0  # wall clock of the last progress line in a log file

    def step_s(self, last=None):
        """The mean time of the steps so far (of the last ones, if given), the first step left out
        as warm-up unless it is the only one; None before any step."""
        timed = (self.step_times[1:] or self.step_times)[-last if last else 0:]
        return sum(timed) / len(timed) if timed else None

    def timed_step_s(self):
        """Seconds per step once a step after the first (compilation, capture) is timed; or 0."""
        return self.step_s() if len(self.step_times) > 1 else 0.0

    def limit_left(self):
        """Seconds of --time_limit left for training steps: the limit counts from the invocation's
        start and keeps back what the final evaluation and checkpoint take (as last measured;
        before the first evaluation, a third of a step per held-out batch), so a stop ends with
        both."""
        evaluation = self.eval_s
        if evaluation is None:
            evaluation = self.held_out_batches * self.timed_step_s() / 3
        return (self.cfg.time_limit - (time.time() - self.t_begin) - evaluation
                - (self.save_s or 0.0))

    def out_of_time(self, step):
        """Whether --time_limit leaves no room for another step before the final evaluation."""
        cfg = self.cfg
        return bool(cfg.time_limit) and step < cfg.max_iters and (
            self.limit_left() < self.timed_step_s())

    def show_progress(self, bar, step, train_loss, lr, master=True):
        """The loss on the progress bar, whose end is where --time_limit will stop the run if it
        comes first; in a log file (no bar), a progress line at most every 30 s with the time left,
        which counts the evaluations once one is timed, and says where a time limit will stop."""
        bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}")
        step_s = self.step_s(last=50)
        if step_s is None:
            return
        cfg = self.cfg
        steps = cfg.max_iters - step
        evals = math.ceil(steps / cfg.eval_interval)  # the last step evaluates too
        whole = steps * step_s + evals * (self.eval_s or 0.0)
        left, where = whole, ""
        if cfg.time_limit:
            fit = max(0.0, self.limit_left()) / step_s  # may be huge: --time_limit 1e308
            steps = max(0, int(min(steps, fit)))
            bar.total = step + steps
            bar.refresh()
            if step + steps < cfg.max_iters:
                left = max(0.0, cfg.time_limit - (time.time() - self.t_begin))
                where = (f": --time_limit stops the run at about step {step + steps} "
                         f"(all {cfg.max_iters} steps would take about {whole / 60:.1f} min)")
        if bar.disable and master and time.time() - self.said >= PROGRESS_EVERY_S:
            self.said = time.time()
            print(f"step {step}/{cfg.max_iters}: loss {train_loss:.4f}, lr {lr:.2e}, "
                  f"{step_s * 1000:.0f} ms/step, about {left / 60:.1f} min left{where}",
                  flush=True)

    def summary(self, model, metrics, best, stopped, device):
        """The last evaluation, the best, and the speed: ms per step, samples or tokens/s, MFU."""
        c, cfg = model.config, self.cfg
        name, _ = selection_metric(c.objective)
        unit, per_sample = ("img", 1) if c.is_image else ("tok", c.seq_len)
        step_s = self.step_s()
        result = "not evaluated"
        if metrics is not None:
            result = f"{name} {metrics[name]:.4g} (best {best:.4g})"
        line = (f"{'stopped' if stopped else 'done'}: {result}, {step_s * 1000:.1f} ms/step, "
                f"{cfg.batch_size * per_sample / step_s:.0f} {unit}/s")
        peak = fast.gpu_peak_tflops(device) if device.type == "cuda" else None
        if peak:
            flops = model.flops_per_sample() * cfg.batch_size / step_s
            line += f", MFU {flops / (peak * 1e12) * 100:.1f}%"
        line += f"; first step {self.step_times[0]:.1f} s (compilation, capture)"
        if self.eval_s is not None:
            line += f", last evaluation {self.eval_s:.1f} s"
        return line


def divergence_advice(cfg):
    """What to change after a non-finite loss: the rate and the warmup first, then clipping."""
    clip = ", or clip with --grad_clip 1.0" if cfg.grad_clip == 0 else ""
    return f"lower the rate (--lr, now {cfg.lr:.3g}) or lengthen --warmup (now {cfg.warmup}){clip}"


def diverged(what, cfg, saved_step):
    """The error for a run gone non-finite: what, that nothing was saved, where the last good
    state is, and what to change."""
    if saved_step is None:
        where = (f"no checkpoint was written yet (the first comes at step {cfg.eval_interval}), "
                 "so this run is lost")
    else:
        where = (f"{os.path.join(cfg.out_dir, 'ckpt.pt')} still holds step {saved_step}, the last "
                 "good state; resume from it with --resume")
    return TrainingError(f"{what}; nothing was saved; {where}; {divergence_advice(cfg)}")


def read_loss(total, step, cfg, saved_step):
    """The training loss as a number (a host sync), refusing a non-finite one before any save."""
    train_loss = total.item()
    if not math.isfinite(train_loss):
        raise diverged(f"loss is {train_loss} at step {step} (read every --log_interval steps)",
                       cfg, saved_step)
    return train_loss


# ----------------------------------------------------------------------------- logging

def selection_metric(objective):
    """The metric that decides the best checkpoint, and whether larger is better."""
    return {"cls": ("top1", True), "mlm": ("mlm_acc", True), "next": ("ppl", False),
            "mae": ("val_loss", False)}[objective]


@contextmanager
def log_file(path, cfg, master, made_by, from_step):
    """log.jsonl, line-buffered (`tail -f` follows the run; a killed run keeps what it logged); a
    fresh run (--overwrite included) starts its own. Each invocation's first record says what
    made it (never through a link: out_dir_claimed refused those). With --wandb_project the records
    also go to Weights & Biases. None on other ranks."""
    if not master:
        yield None
        return
    run = start_wandb(cfg) if cfg.wandb_project else None  # before the log: a failure leaves none
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_APPEND if cfg.resume else os.O_TRUNC
    with os.fdopen(os.open(path, flags, 0o644), "a" if cfg.resume else "w", buffering=1) as log:
        log.write(json.dumps({"run": made_by, "from_step": from_step}) + "\n")
        yield LogAlsoToWandb(log, run) if run else log
        if run:
            run.finish()


def start_wandb(cfg):
    """A Weights & Biases run for --wandb_project; one line where wandb cannot start one."""
    import wandb

    try:
        return wandb.init(project=cfg.wandb_project, config=vars(cfg),
                          name=os.path.basename(os.path.abspath(cfg.out_dir)))
    except Exception as e:  # not logged in, offline, a bad project name: wandb's own errors
        raise TrainingError(f"--wandb_project: wandb.init failed ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120] if str(e) else ''}); run `wandb "
                            "login`, set WANDB_MODE=offline, or drop the flag") from None


def progress_bar(total, initial, master=True):
    """A progress bar on a terminal; none in a log file (a scheduler's stdout), where
    Clock.show_progress prints a line instead. As a context manager (tqdm's own), closed on the
    way out, before any error line."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not (master and sys.stderr.isatty()),
                dynamic_ncols=True, mininterval=1.0)


class LogAlsoToWandb:
    """log.jsonl whose step and evaluation records also go to Weights & Biases, as nanoGPT's
    wandb_log does: the numbers only (per-layer metrics stay in the file)."""

    def __init__(self, log, run):
        self.log, self.wandb = log, run

    def write(self, line):
        self.log.write(line)
        record = json.loads(line)
        numbers = {k: v for k, v in record.items() if k != "step"
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "step" in record and numbers:
            self.wandb.log(numbers, step=record["step"])


def record_evaluation(log, bar, record, model, init_hash):
    """Log and print the evaluation record with the trunk's hashes."""
    hashes = {"init_trunk_sha256": init_hash["trunk"],  # the seed's initial trunk
              "trunk_sha256": checkpoint.weights_hash(model, trunk_only=True)["trunk"]}
    if "loaded_trunk" in init_hash:  # --init_from: the pretrained trunk training started from
        hashes["loaded_trunk_sha256"] = init_hash["loaded_trunk"]
    log.write(json.dumps({"eval": True, **record, **hashes}) + "\n")
    bar.write(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items() if not isinstance(v, dict)))


def save_correct(correct, out_dir):
    """A classifier's per-image correctness at the evaluation ckpt.pt holds: eval_correct.npy."""
    if correct:
        flags = torch.cat(correct).cpu().numpy().astype("uint8")  # 1: right, per held-out image
        path = os.path.join(out_dir, "eval_correct.npy")
        checkpoint.atomic_write(path, lambda f: np.save(f, flags))


# Flags that only some objectives read: given to another, they would do nothing unsaid
APPLIES_TO = {**dict.fromkeys(("mask_ratio", "decoder_depth", "decoder_width", "decoder_heads",
                               "norm_pix_loss"), ("mae",)),
              "mlm_prob": ("mlm",), "pool": ("cls",), "label_smoothing": ("cls",),
              **dict.fromkeys(("image_size", "patch_size", "train_samples"), ("mae", "cls")),
              **dict.fromkeys(("seq_len", "tokenizer", "train_file", "val_file"), ("mlm", "next"))}


def settings_lines(cfg, config, data, sources):
    """What streaming does, then every setting by where it came from; a note for each flag given
    that does nothing here."""
    lines = []
    ignored = [f"--{k}" for k, objectives in APPLIES_TO.items()
               if sources.get(k) == "flags" and config.objective not in objectives]
    if ignored:
        lines.append(f"note: {' '.join(ignored)} do nothing for --objective {config.objective}; "
                     "this run ignores them")
    if cfg.eval_only and not cfg.resume and not cfg.init_from:
        lines.append("note: --eval_only without --resume or --init_from scores freshly "
                     f"initialised weights; add --resume to score the run in {cfg.out_dir}")
    if config.is_image and cfg.train_samples > data.num_train():
        lines.append(f"note: --train_samples {cfg.train_samples} is more than the "
                     f"{data.num_train()} training images; the run takes those")
    if isinstance(data, ImageStream):
        workers = data.workers
        lines.append(f"streaming {data.num_train():,} training images from disk, {workers} "
                     f"decoding process{'es' * (workers != 1)} per rank: MAE's crops (area "
                     f"{cfg.crop_scale:g} to 1) and flips, ImageNet's mean and std")
    elif config.is_image:  # crops and decoding processes are the stream's: say what applies
        if sources.get("crop_scale") != "flags":
            sources.pop("crop_scale", None)
        unused = [f"--{k}" for k in ("crop_scale", "workers") if sources.get(k) == "flags"]
        if unused:
            lines.append(f"note: {' and '.join(unused)} apply to a streamed folder only; this run "
                         "decodes its images into memory (--stream on to stream them)")
    if cfg.probe_samples > data.num_held_out():
        lines.append(f"note: --probe_samples {cfg.probe_samples} is more than the "
                     f"{data.num_held_out()} held-out samples; the probe takes those")
    dictated = ("channels", "num_classes") if config.is_image else ("vocab_size",)
    overruled = [f"--{k} is the data's {getattr(config, k)}" for k in dictated
                 if sources.get(k) == "flags"]
    if overruled:
        lines.append(f"note: {', '.join(overruled)} here: the data sets it")
    sources.update(dict.fromkeys(dictated, "the data"))
    lines += settings_block({**vars(cfg), **config.to_dict()}, sources)
    if cfg.warmup >= cfg.max_iters:
        lines.append(f"note: --warmup {cfg.warmup} is not shorter than --max_iters "
                     f"{cfg.max_iters}: the rate never reaches its peak and never decays")
    return lines


def held_out_batches(data, eval_samples, batch_size):
    """How many batches an evaluation takes: --eval_samples of the held-out split (0: all)."""
    return math.ceil(min(eval_samples or math.inf, data.num_held_out()) / batch_size)


def evaluation_progress(batches, total):
    """The evaluation's batches as they go: a bar on a terminal, or in a log file a line at most
    every 30 s with the time left, so that a long evaluation (a stop's, --eval_only's) is never
    silent."""
    from tqdm import tqdm

    if int(os.environ.get("RANK", 0)) != 0:  # rank 0 speaks for the run
        yield from batches
        return
    bar = tqdm(batches, total=total, desc="evaluating", leave=False, dynamic_ncols=True,
               disable=not sys.stderr.isatty(), mininterval=1.0)
    start = said = time.time()
    for done, batch in enumerate(bar, 1):
        yield batch
        now = time.time()
        if bar.disable and now - said >= PROGRESS_EVERY_S and done < total:
            said = now
            left = (now - start) / done * (total - done)
            print(f"evaluating: {done}/{total} batches, about {left:.0f} s left", flush=True)


def how_to_resume(reason, step, world, out_dir):
    """After an early stop: why, where the checkpoint is, and the command that continues."""
    return (f"{reason or 'stopped by another rank'} at step {step}; checkpoint saved to "
            f"{os.path.join(out_dir, 'ckpt.pt')}; continue with: {launcher(world)} --resume "
            f"--out_dir {out_dir}")


def launcher(world):
    """How this run was started, for the commands it prints: python, or torchrun with its processes
    (a resume needs as many as the run had)."""
    if world == 1:
        return "python train.py"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = f" --nnodes={world // per_node}" if per_node != world else ""
    return f"torchrun{nodes} --nproc_per_node={per_node} train.py"


# ----------------------------------------------------------------------------- one-line errors

def out_of_memory(e):
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def peer_lost(e):
    """Whether e is a DDP collective that failed because another rank went away."""
    words = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "nccl communicator was aborted", "timed out")
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 and any(w in str(e).lower() for w in words)


@contextmanager
def one_line_errors(out_dir=None):
    """with one_line_errors(out_dir) as outcome: ... Every failure a user can fix (a mistake, a
    missing package, a full disk, running out of memory, a lost DDP peer, a second Ctrl-C) becomes
    one line on stderr and outcome.code 2 (130 for Ctrl-C); out_dir: a training run's, whose
    checkpoint the line speaks of. Anything else is a bug, and raises."""
    outcome = types.SimpleNamespace(code=0)

    def left():  # what the failure left to resume from, as it is now
        if not out_dir:
            return ""
        if os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
            return "; the last checkpoint is as it was; continue with --resume"
        return "; no checkpoint was written, so there is nothing to resume"

    try:
        yield outcome
        return
    except (checkpoint.CheckpointError, DataError, TrainingError, ValueError) as e:
        message = str(e)
    except ImportError as e:
        if out_dir:  # in training a missing module is a broken install or a bug, not a choice
            raise
        message = f"this needs {e.name}; pip install it (timm, transformers: in a scratch venv)"
    except OSError as e:  # a full disk, a folder that vanished while writing
        message = checkpoint.unwritable(e) if not out_dir else (
            f"input/output failed on {e.filename or 'the log'} ({e.strerror or e}){left()}, once "
            "space is free or the path is back")
    except RuntimeError as e:
        if out_of_memory(e):
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
    sys.exit(code)
