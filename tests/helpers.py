"""Shared helpers of the test suite: tiny configs and batches, and the training CLI run as users run it.

Run: python -m pytest -q tests
"""
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import torch
import torch.nn.functional as F

from bamboo import Config


def tiny(objective, **overrides):
    """A config small enough to train in a second on CPU."""
    base = dict(objective=objective, depth=2, width=32, heads=2, image_size=16, patch_size=4,
                vocab_size=64, seq_len=16, decoder_depth=1, decoder_width=32, decoder_heads=2)
    return Config(**{**base, **overrides})


def batch(config, B=4, seed=0):
    """A clean batch for the config: smooth images in [0, 1] with labels, or token windows.

    Images are 2x2 random colours blown up bilinearly, so that, as in real photos, the
    visible patches say something about the hidden ones and MAE has something to learn.
    """
    g = torch.Generator().manual_seed(seed)
    if config.is_image:
        corners = torch.rand(B, config.channels, 2, 2, generator=g)
        x = F.interpolate(corners, size=config.image_size, mode="bilinear", align_corners=True)
        return x, torch.randint(0, config.num_classes, (B,), generator=g)
    return torch.randint(0, config.vocab_size, (B, config.seq_len), generator=g), None


def mean_cos(h):
    """Mean pairwise cosine over i != j of (B, T, D) tokens (the probe's `cos`, kept local here)."""
    h = F.normalize(h, dim=-1)
    T = h.shape[1]
    return ((h @ h.transpose(1, 2)).sum((1, 2)) - T).div(T * (T - 1)).mean().item()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_IMAGE_FLAGS = ["--depth", "2", "--width", "32", "--heads", "2", "--image_size", "16", "--patch_size", "4",
                    "--decoder_depth", "1", "--decoder_width", "32", "--decoder_heads", "2"]
TINY_TEXT_FLAGS = ["--depth", "2", "--width", "32", "--heads", "2", "--seq_len", "32", "--tokenizer", "bytes"]


def run_train(*flags, out_dir):
    """train.py's command line, run in this process as main(argv) (no interpreter start-up to pay);
    returns (exit code, everything printed, the log.jsonl records). Runs that need a process of their
    own (signals, torchrun) start one."""
    import train

    printed = io.StringIO()
    with redirect_stdout(printed), redirect_stderr(printed):
        code = train.main([str(f) for f in flags] + ["--out_dir", str(out_dir), "--log_interval", "1"])
    log = out_dir / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return code, printed.getvalue(), records


def train_losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def image_flags(tiny_data, objective, *extra):
    lr = "1e-2" if objective == "mae" else "3e-3"  # the tiny MAE needs a higher lr to learn in 40 steps
    return ["--objective", objective, "--dataset", "folder", "--data_dir", str(tiny_data / "images"),
            *TINY_IMAGE_FLAGS, "--batch_size", "16", "--lr", lr, "--warmup", "2", *extra]


def text_flags(tiny_data, objective, *extra):
    return ["--objective", objective, "--dataset", "text", "--data_dir", str(tiny_data / "text"),
            "--cache_dir", str(tiny_data / "cache"), *TINY_TEXT_FLAGS, "--batch_size", "16", "--lr", "3e-3",
            "--warmup", "2", *extra]


def trained_checkpoint(tiny_data, objective, out_dir, steps=1, *extra):
    """Train a tiny `objective` model on the tiny data for `steps` steps (evaluated and saved at the last);
    returns the path of its checkpoint."""
    flags = (image_flags if objective in ("mae", "cls") else text_flags)(
        tiny_data, objective, "--max_iters", str(steps), "--eval_interval", str(steps), *extra)
    code, out, _ = run_train(*flags, out_dir=out_dir)
    assert code == 0, out
    return out_dir / "ckpt.pt"


def run_torchrun(*flags, out_dir):
    """train.py under a 2-process gloo DDP group, logging every step unless flags say otherwise; returns (exit code,
    output, log records)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "train.py", "--log_interval", "1", *flags, "--out_dir", str(out_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    log = out_dir / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, records


def cli_error(capsys, *argv):
    """Run train.main in-process; it must return 2 and print exactly one line, no traceback."""
    import train

    assert train.main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err, err
    return lines[0]
