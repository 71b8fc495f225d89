"""Checkpoints: one dict of plain data (config, weights, optimizer, step, settings and every rank's
random state, so that a resume repeats the uninterrupted run exactly), written atomically and
loaded with torch.load(weights_only=True).

Run: python -c "from operations import checkpoint; print(checkpoint.load('out/ckpt.pt')['step'])"
"""
import hashlib
import os
import tempfile
from contextlib import suppress

import torch
import torch.distributed as dist

from bamboo import TRUNK, Bamboo, Config
from operations.cli import resume_command


LAST_TO_READ_OLD = "0bbb605"  # the last commit that reads checkpoints written before 2026-11-27


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written; the message is one line and says why."""


def atomic_write(path, write):
    """Call write(f) on a binary temp file unique to this process beside path, then rename it to
    path: a crash, a full disk or a second process writing the same path never leaves it
    half-written. On failure the temp file (ours) is removed, and an OSError names path."""
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as e:  # a read-only or vanished folder: name the file asked for, not the temp
        raise OSError(e.errno, e.strerror or str(e), path) from None
    try:
        umask = os.umask(0)  # mkstemp makes 0o600; a file open() makes gets 0o666 less the umask
        os.umask(umask)
        with suppress(OSError):  # a file system without modes keeps its own
            os.chmod(tmp, 0o666 & ~umask)  # so that whoever may read the folder may read it
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        os.remove(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise


def weights_hash(model, trunk_only=False):
    """{"trunk": sha256 of the stem's and blocks' tensors, "model": of every tensor}, each over the
    names and bytes in name order: two runs that start from the same trunk (cls and MAE arms of one
    seed) show it in their checkpoints and logs. trunk_only: the trunk's alone (no head copied)."""
    trunk, everything, state = hashlib.sha256(), hashlib.sha256(), model.state_dict()
    for name in sorted(n for n in state if not trunk_only or n.startswith(TRUNK)):
        raw = state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        data = name.encode() + raw.numpy().tobytes()
        everything.update(data)
        if name.startswith(TRUNK):
            trunk.update(data)
    return {"trunk": trunk.hexdigest(), **({} if trunk_only else {"model": everything.hexdigest()})}


def random_states(generator, device, world=1):
    """The data order's generator and every rank's torch (and CUDA or MPS) random state, so that a
    resume repeats the uninterrupted run; under DDP a collective (masks and dropout differ per
    rank)."""
    cuda = (torch.cuda.get_rng_state(device) if device.type == "cuda"
            else torch.empty(0, dtype=torch.uint8))
    ranks = [{"torch": torch.get_rng_state(), "cuda": cuda}]
    if device.type == "mps":  # a key of its own: a resume on another kind of GPU leaves it be
        ranks[0]["mps"] = torch.mps.get_rng_state()
    if world > 1:
        own, ranks = ranks[0], [None] * world
        dist.all_gather_object(ranks, own)
    return {"data": generator.get_state(), "ranks": ranks}


WEIGHTS = ("config", "train", "model", "step", "best", "classes", "statistics", "window",
           "fingerprint", "init_hash", "made_by")


def weights_only(state):
    """What probe.py, look.py and --init_from read, without the optimizer and random states: a
    third of a training checkpoint's size (AdamW keeps two tensors per weight)."""
    return {key: state[key] for key in WEIGHTS if key in state}


def save(path, state):
    """Write state atomically: the last good checkpoint stays as it was if anything goes wrong."""
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        why = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][-80:]
        folder = os.path.dirname(path) or "."
        raise CheckpointError(f"could not write {path} ({why}); free space in {folder}, then "
                              f"continue with: {resume_command(folder)}") from None


def load(path):
    """A checkpoint dict written by train.py, loaded without running any code (weights_only)."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder; pass a checkpoint in it, e.g. "
                              f"{os.path.join(path, 'ckpt.pt')}")
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}; check the path (train.py writes "
                              "OUT_DIR/ckpt.pt)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); "
                              "use another checkpoint or train again") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict) and "model" in ckpt):
        raise CheckpointError(f"{path} is not a bamboo checkpoint (no config dict and tensor "
                              "weights inside)")
    if "window" not in ckpt:  # every checkpoint since 2026-11-27 has it (None for images)
        raise CheckpointError(f"{path} was written by a development version before 2026-11-27; "
                              f"read it with commit {LAST_TO_READ_OLD} or train again")
    return ckpt


def data_settings(ckpt):
    """The checkpoint's training settings and pixel statistics: its held-out data as it saw it."""
    return {**ckpt.get("train", {}), "statistics": ckpt.get("statistics")}


def model_from_checkpoint(path):
    """(the exact model a checkpoint holds, the checkpoint)."""
    ckpt = load(path)
    model = Bamboo(Config.from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model, ckpt


def load_states(ckpt, path, model, optimizer, scaler):
    """(step, best evaluation), the weights, optimizer and scaler state put back; or one line."""
    if "optimizer" not in ckpt:  # best.pt, or an export of it: weights only
        raise CheckpointError(f"{path} holds weights only (as best.pt does), not a run to resume; "
                              "fine-tune or score it with --init_from")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        return int(ckpt["step"]), ckpt["best"]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not match its own config "
                              f"({' '.join(str(e).split())[:160]}); "
                              "it is damaged, train again") from None


def restore_random_states(ckpt, path, generator, rank, world, device):
    """The data order and this rank's random state as the checkpoint at path has them."""
    try:
        generator.set_state(ckpt["rng"]["data"])
        ranks = ckpt["rng"]["ranks"]
        if len(ranks) != world:
            raise ValueError(f"it was written by {len(ranks)} processes, this run has "
                             f"{world}; use as many")
        torch.set_rng_state(ranks[rank]["torch"])
        if device.type == "cuda" and ranks[rank]["cuda"].numel():
            torch.cuda.set_rng_state(ranks[rank]["cuda"], device)
        if device.type == "mps" and "mps" in ranks[rank]:
            torch.mps.set_rng_state(ranks[rank]["mps"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        why = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{path} cannot be resumed ({why})") from None
