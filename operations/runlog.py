"""A run's record: log.jsonl (one JSON line per logged step and per evaluation, line-buffered);
what made the run; the one reader of the log, for a resume and for look.py.

Run: python -c "from operations import runlog; print(runlog.read_log('out/log.jsonl')[-1])"
"""
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import torch

from operations import checkpoint, fast


def selection_metric(objective):
    """The metric that decides the best checkpoint, and whether larger is better."""
    return {"cls": ("top1", True), "mlm": ("mlm_acc", True), "next": ("ppl", False),
            "mae": ("val_loss", False)}[objective]


@contextmanager
def log_file(path, cfg, master, made_by, from_step):
    """log.jsonl, line-buffered (`tail -f` follows the run), opened afresh unless resumed; each
    invocation's first record says what made it. None on other ranks."""
    if not master:
        yield None
        return
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_APPEND if cfg.resume else os.O_TRUNC
    with os.fdopen(os.open(path, flags, 0o644), "a" if cfg.resume else "w", buffering=1) as log:
        log.write(json.dumps({"run": made_by, "from_step": from_step}) + "\n")
        yield log


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
    """A classifier's per-image correctness at the evaluation ckpt.pt holds: eval_correct.npy (the
    images it scored: fewer after an evaluation short of time)."""
    if correct:
        flags = torch.cat(correct).cpu().numpy().astype("uint8")  # 1: right, per held-out image
        path = os.path.join(out_dir, "eval_correct.npy")
        checkpoint.atomic_write(path, lambda f: np.save(f, flags))


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


def code_and_machine(device, dtype):
    """What made a run: the commit (and whether the tree had uncommitted changes), the command
    line, torch, the device (a CPU by its model) and the dtype. Outside git the commit is None."""
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
            "torch": str(torch.__version__), "device": name, "cpu": fast.cpu_model(),
            "dtype": str(dtype).removeprefix("torch.")}
