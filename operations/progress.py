"""Where a run is and how it stops: the progress bar (a line every 30 s in a log file), the time
limit, Ctrl-C and SIGTERM, a non-finite loss, the command that resumes, and DDP ranks stopping
together.

Run: python train.py --time_limit 60 (a run that ends on time, evaluated and saved)
"""
import math
import os
import signal
import sys
import time
import types
from contextlib import contextmanager

import torch
import torch.distributed as dist

from bamboo import training_flops
from operations import fast
from operations.cli import TrainingError, resume_command
from operations.runlog import selection_metric


PROGRESS_EVERY_S = 30  # in a log file, a progress line at most this often
EXIT_S = 1.0  # --time_limit keeps this back for the process's exit after its last line
EVAL_MARGIN = 1.25  # and, for timings that drift, the final evaluation's time this many times


class Clock:
    """The run's timing: the steps so far, the last evaluation and save; from them, where
    --time_limit stops the run, the progress lines and the summary's speed."""

    def __init__(self, t_begin, cfg, held_out_batches, steps_per_check=1):
        self.t_begin, self.cfg, self.held_out_batches = t_begin, cfg, held_out_batches
        self.steps_per_check = steps_per_check  # DDP ranks agree to stop every log_interval steps
        self.step_times = []  # seconds per step, evaluations left out
        self.eval_s = self.save_s = None  # seconds the last evaluation and checkpoint took
        # an evaluation's parts, timed at the start (train.time_evaluation): fixed, a batch, probe
        self.overhead_s = self.batch_s = self.probe_s = 0.0
        self.said = 0.0  # wall clock of the last progress line in a log file

    def step_s(self, last=None):
        """The mean time of the steps so far (of the last ones, if given), the first step left out
        as warm-up unless it is the only one; None before any step."""
        timed = (self.step_times[1:] or self.step_times)[-last if last else 0:]
        return sum(timed) / len(timed) if timed else None

    def slowest_step_s(self):
        """The slowest of the last 50 steps after the first (compilation, capture), or the first
        while it is the only one; 0 before any."""
        recent = self.step_times[max(1, len(self.step_times) - 50):]  # not a copy of them all
        return max(recent or self.step_times, default=0.0)

    def time_left(self):
        """Seconds until --time_limit, from the invocation's start, less the process's exit."""
        return self.cfg.time_limit - (time.time() - self.t_begin) - EXIT_S

    def limit_left(self, margin=EVAL_MARGIN):
        """Seconds of --time_limit left for steps, keeping back the final evaluation (times the
        margin) and checkpoint, so that a stop ends with both."""
        return self.time_left() - margin * self.evaluation_s() - (self.save_s or 0.0)

    def evaluation_s(self):
        """What an evaluation takes: as last measured, or before the first, from its parts."""
        if self.eval_s is not None:
            return self.eval_s
        return self.overhead_s + self.held_out_batches * self.batch_s + self.probe_s

    def short_of_time(self):
        """Whether --time_limit leaves no room for a whole evaluation with the probe."""
        return bool(self.cfg.time_limit) and self.limit_left(margin=1.0) < 0

    def limit_note(self):
        """Said at the start when --time_limit cannot hold even the final evaluation: why, and what
        to change; or ''."""
        if not self.short_of_time():
            return ""
        left = max(0.0, self.time_left())
        return (f"note: --time_limit {self.cfg.time_limit:g} s leaves {left:.0f} s, too little "
                f"for an evaluation (about {self.evaluation_s():.0f} s: "
                f"{self.held_out_batches} held-out batches of {self.batch_s:.2f} s, "
                f"{self.overhead_s:.1f} s besides, the probe {self.probe_s:.1f} s): the run will "
                "stop at its first chance and score the held-out samples that fit, without the "
                "probe; to score them all, lower --eval_samples or --probe_samples, or raise "
                "--time_limit")

    def evaluation_deadline(self, short):
        """The wall clock after which an evaluation starts no batch under --time_limit (None: no
        limit): room kept for the batch in flight, the checkpoint, the exit and, unless short of
        time, the probe."""
        if not self.cfg.time_limit:
            return None
        return (self.t_begin + self.cfg.time_limit - EXIT_S - self.batch_s - (self.save_s or 0.0)
                - (0.0 if short else self.probe_s))

    def out_of_time(self, step):
        """Whether --time_limit leaves no room for the steps before the ranks next agree (one
        without DDP) and then the final evaluation."""
        cfg = self.cfg
        return bool(cfg.time_limit) and step < cfg.max_iters and (
            self.limit_left() < self.slowest_step_s() * self.steps_per_check)

    def show_progress(self, bar, step, train_loss, lr, master=True):
        """The loss on the progress bar, whose end is where --time_limit will stop the run if it
        comes first; in a log file (no bar), a progress line at most every 30 s with the time left,
        evaluations counted, and where a time limit will stop."""
        bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}")
        step_s = self.step_s(last=50)
        if step_s is None:
            return
        cfg = self.cfg
        steps = cfg.max_iters - step
        evals = math.ceil(steps / cfg.eval_interval)  # the last step evaluates too
        whole = steps * step_s + evals * self.evaluation_s()
        timed = cfg.time_limit or self.eval_s is not None  # else the evaluations count as 0 s
        left, where = whole, "" if timed else " (steps only: no evaluation timed yet)"
        if cfg.time_limit:
            # the steps that fit, each with its share of the evaluations between (may be huge)
            fit = max(0.0, self.limit_left()) / (step_s + self.evaluation_s() / cfg.eval_interval)
            steps = max(0, int(min(steps, fit)))
            bar.total = step + steps
            bar.refresh()
            if step + steps < cfg.max_iters:
                left = max(0.0, self.time_left())
                where = (f": --time_limit stops the run at about step {step + steps} "
                         f"(all {cfg.max_iters} steps would take about {whole / 60:.1f} min)")
        if bar.disable and master and time.time() - self.said >= PROGRESS_EVERY_S:
            self.said = time.time()
            print(f"step {step}/{cfg.max_iters}: loss {train_loss:.4f}, lr {lr:.2e}, "
                  f"{step_s * 1000:.0f} ms/step, about {left / 60:.1f} min left{where}",
                  flush=True)

    def summary(self, model, metrics, best, stopped, device, dtype):
        """The last evaluation, the best, and the speed: ms per step, samples or tokens/s, MFU."""
        c, cfg = model.config, self.cfg
        name, _ = selection_metric(c.objective)
        unit, per_sample = ("img", 1) if c.is_image else ("tok", c.seq_len)
        step_s = self.step_s()
        best = f"best {best:.4g}" if best is not None else "no best: no whole evaluation"
        result = f"{name} {metrics[name]:.4g} ({best})" if metrics is not None else "not evaluated"
        line = (f"{'stopped' if stopped else 'done'}: {result}, {step_s * 1000:.1f} ms/step, "
                f"{cfg.batch_size * per_sample / step_s:.0f} {unit}/s")
        peak = fast.peak_tflops(device, dtype)
        if peak:
            flops = training_flops(model.config) * cfg.batch_size / step_s
            line += f", MFU {flops / (peak * 1e12) * 100:.1f}%"
        line += f"; first step {self.step_times[0]:.1f} s"
        if self.eval_s is not None:
            line += f", last evaluation {self.eval_s:.1f} s"
        return line


def progress_bar(total, initial, master=True):
    """A progress bar on a terminal; none in a log file (a scheduler's stdout), where
    Clock.show_progress prints a line instead. As a context manager (tqdm's own), closed on the
    way out, before any error line."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not (master and sys.stderr.isatty()),
                dynamic_ncols=True, mininterval=1.0)


def held_out_batches(data, eval_samples, batch_size):
    """How many batches an evaluation takes: --eval_samples of the held-out split (0: all)."""
    return math.ceil(min(eval_samples or math.inf, data.num_held_out()) / batch_size)


def evaluation_progress(batches, total):
    """The evaluation's batches as they go: a bar on a terminal, or in a log file a line at most
    every 30 s with the time left; a long evaluation (a stop's, --eval_only's) is never silent."""
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


def diverged(what, cfg, saved_step):
    """The error for a run gone non-finite: what, that nothing was saved, where the last good
    state is, and what to change (the rate and the warmup first, then clipping)."""
    if saved_step is None:
        where = (f"no checkpoint was written yet (the first comes at step {cfg.eval_interval}), "
                 "so this run is lost")
    else:
        where = (f"{os.path.join(cfg.out_dir, 'ckpt.pt')} still holds step {saved_step}, the last "
                 f"good state; continue from it with: {resume_command(cfg.out_dir)}")
    clip = ", or clip with --grad_clip 1.0" if cfg.grad_clip == 0 else ""
    return TrainingError(f"{what}; nothing was saved; {where}; lower the rate (--lr, now "
                         f"{cfg.lr:.3g}) or lengthen --warmup (now {cfg.warmup}){clip}")


def read_loss(total, step, cfg, saved_step):
    """The training loss as a number (a host sync), refusing a non-finite one before any save."""
    train_loss = total.item()
    if not math.isfinite(train_loss):
        raise diverged(f"loss is {train_loss} at step {step} (read every --log_interval steps)",
                       cfg, saved_step)
    return train_loss


def how_to_resume(reason, step, world, out_dir):
    """After an early stop: why, where the checkpoint is, and the command that continues."""
    return (f"{reason or 'stopped by another rank'} at step {step}; checkpoint saved to "
            f"{os.path.join(out_dir, 'ckpt.pt')}; continue with: {resume_command(out_dir, world)}")


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
            print(f"\nstop requested: finishing {when}, then evaluating and saving (Ctrl-C again "
                  "stops at once, without saving)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


def any_rank(flag, device):
    """Under DDP, True on every rank if it is True on any (so all ranks stop together)."""
    value = torch.tensor([float(flag)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@contextmanager
def process_group_left(ddp):
    """A DDP rank leaves its group on the way out, however the run ended."""
    try:
        yield
    finally:
        if ddp:
            dist.destroy_process_group()
