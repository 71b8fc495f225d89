"""Train any of the four objectives on images or text; one process, or DDP under torchrun.

The recipe follows nanoGPT's train.py (AdamW with decay/no-decay groups, warmup + cosine in
a visible get_lr, one checkpoint dict holding the config) and Bamboo's protocol (MAE
pre-training, then fine-tuning with layer-wise lr decay via --init_from). The file reads top
to bottom: settings, the learning rate, evaluation, set-up, the bookkeeping that is not the
step (stopping, logging), then train(), whose loop holds the whole step on one screen.
Checkpoints are written and resumed by checkpoint.py; hardware-specific speedups come from
fast.py as a visible wrapper. The commands are in README.md.

Run: python train.py --objective mae --depth 48 --width 384
"""
import argparse
import inspect
import json
import math
import os
import re
import signal
import sys
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import checkpoint
import fast
from bamboo import IMAGE_OBJECTIVES, OBJECTIVES, PRESETS, Bamboo, Config
from data import IMAGE_DATASETS, TEXT_DATASETS, DataError, ImageData, TextData, to_device


@dataclass
class TrainConfig:
    preset: str = ""                 # a named model (bamboo.PRESETS); model flags override it
    dataset: str = "cifar10"         # cifar10 | cifar100 | folder | wikitext2 | wikitext103 | text
    data_dir: str = "./data"         # where the dataset lives, or is downloaded to
    tokenizer: str = "gpt2"          # text: a tiktoken encoding, or bytes (256 ids, no download)
    train_file: str = "train.txt"    # --dataset text: training file inside data_dir
    val_file: str = "val.txt"        # --dataset text: evaluation file inside data_dir
    cache_dir: str = "./data/cache"  # text: where tokenized .bin files are cached
    batch_size: int = 128            # samples per optimizer step, over processes and grad_accum
    grad_accum: int = 1              # micro-batches per optimizer step
    max_iters: int = 2000            # optimizer steps
    lr: float = -1.0                 # peak rate (times layer decay); -1: base_lr x batch_size / 256
    base_lr: float = 3e-4            # with --lr -1: the peak rate per 256 samples (as DeiT and MAE)
    min_lr: float = 1e-5             # rate at the end of the cosine (--lr -1: at most the peak)
    warmup: int = -1                 # linear warmup steps; -1: max(100, 10 x depth)
    weight_decay: float = 0.05       # AdamW decay on matrices (not on biases, norms, positions)
    beta2: float = 0.95              # AdamW beta2
    grad_clip: float = 1.0           # clip the global gradient norm; 0 turns it off
    layer_decay: float = 1.0         # fine-tuning: block i's lr times layer_decay^(depth + 1 - i)
    eval_interval: int = 200         # evaluate and checkpoint every this many steps
    eval_samples: int = 10000        # held-out images or text windows per evaluation; 0 means all
    train_samples: int = 0           # images: train on a fixed random subset of this many (0: all)
    log_interval: int = 10           # write the training loss to log.jsonl every this many steps
    out_dir: str = "out"             # checkpoint and log.jsonl go here
    overwrite: bool = False          # start afresh in an out_dir that holds another run (replaced)
    seed: int = 1337                 # one seed for the init, the data order and the masks
    device: str = "auto"             # auto: cuda, then mps, then cpu; or cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto | float32 | bfloat16 | float16 (auto: bf16 where native)
    compile: str = "auto"            # auto | off | model | blocks | graphs (see fast.py)
    resume: bool = False             # continue from out_dir/ckpt.pt with its settings (RESUMABLE)
    init_from: str = ""              # fine-tune: load a pretrained trunk (e.g. MAE) from this file
    time_limit: float = 0.0          # stop with a checkpoint after this many seconds (0: no limit)


# The training recipes of the laptop presets, as nanoGPT's config files hold theirs: what a quick
# run needs to learn on a 2-core CPU (the README gives each one's measured outcome). Flags override
# them; a preset without a recipe trains with TrainConfig's defaults.
RECIPES = {
    "cifar-small": dict(batch_size=128, max_iters=3600, lr=2e-3, warmup=200, eval_interval=400),
    "cifar-deep": dict(batch_size=128, max_iters=1500, lr=2e-3, warmup=100, eval_interval=500),
    "wikitext-small": dict(batch_size=16, max_iters=400, lr=2e-3, warmup=40, eval_interval=100,
                           eval_samples=1024),
    "wikitext-deep": dict(batch_size=16, max_iters=400, lr=2e-3, warmup=40, eval_interval=100,
                          eval_samples=1024),
}
CHOICES = {"dataset": IMAGE_DATASETS + TEXT_DATASETS, "objective": OBJECTIVES,
           "pool": ("mean", "cls"), "dtype": fast.DTYPES, "compile": fast.COMPILE_MODES,
           "preset": ("",) + tuple(PRESETS)}
# What --resume may change: length and learning rate, where the data lives, logging. The settings
# of one invocation (machine, time limit) are never taken from the checkpoint: given, or default.
RESUMABLE = ("max_iters", "lr", "base_lr", "min_lr", "warmup", "grad_clip", "eval_interval",
             "eval_samples", "log_interval", "data_dir", "cache_dir", "init_from")
PROGRESS_EVERY_S = 30  # in a log file, a progress line at most this often
PER_INVOCATION = ("out_dir", "device", "compile", "time_limit", "resume", "overwrite")


class TrainingError(Exception):
    """The run cannot go on; the message is one line and says what to do."""


# ----------------------------------------------------------------------------- settings

def field_comments(cls):
    """The comment after each field of a dataclass: the --help text."""
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))


def build_parser():
    """Every TrainConfig and Config field as a flag. Flags not given stay unset, so that a preset,
    a pretrained trunk or a resumed checkpoint can fill them, and --resume knows what was asked."""
    parser = argparse.ArgumentParser(description="Train bamboo models.", allow_abbrev=False,
                                     formatter_class=argparse.RawTextHelpFormatter)
    for cls, title in ((TrainConfig, "training"),
                       (Config, "model (defaults shown; a --preset sets its own)")):
        group, comments = parser.add_argument_group(title), field_comments(cls)
        for f in fields(cls):
            kwargs = dict(help=f"{comments.get(f.name, '')} (default: {f.default!r})",
                          default=argparse.SUPPRESS)
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = type(f.default)
                if CHOICES.get(f.name):
                    kwargs["choices"] = CHOICES[f.name]
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def flags_given(args, cls):
    """The flags of dataclass cls that the command line set."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def schedule_defaults(cfg, depth):
    """--lr -1 and --warmup -1 made concrete. The peak rate grows with the batch, as DeiT and MAE
    scale it; deep trunks get a longer warmup, which a 48-block trunk needed to stay finite
    (results/gpu/README.md)."""
    warmup = max(100, 10 * depth) if cfg.warmup == -1 else cfg.warmup
    if cfg.lr != -1:
        return replace(cfg, warmup=warmup)
    lr = cfg.base_lr * cfg.batch_size / 256
    # small batches: the cosine never rises
    return replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr), warmup=warmup)


def validate(cfg):
    """Check every training setting (after schedule_defaults) as Config checks its fields: one line
    naming the flag and the fix."""
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
        ("time_limit", cfg.time_limit >= 0, "must be >= 0 (0 means no limit)"),
        ("out_dir", cfg.out_dir.strip() != "", "must name a folder"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise TrainingError(f"--{name} {getattr(cfg, name)!r} {why}")


# ----------------------------------------------------------------------------- the learning rate

def get_lr(it, cfg):
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at cfg.max_iters."""
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    progress = min(1.0, (it - cfg.warmup) / max(1, cfg.max_iters - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, data, cfg, batch_size, device, per_sample=None):
    """The metric each objective is judged by, on fixed held-out data with fixed masks. A classifier
    appends each held-out image's correctness (bool, in order) to per_sample if a list is given, so
    that paired tests between runs can be recomputed from files.

    Sums stay on the device (no host sync per batch).
    """
    objective = model.config.objective
    was_training = model.training
    model.eval()
    loss_sum, count, correct = (torch.zeros((), dtype=torch.float64, device=device)
                                for _ in range(3))
    # Compiled blocks run eagerly here: the last batch may be smaller, and no-grad graphs of other
    # shapes would be compiled and captured for a pass that runs once per eval_interval steps.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.compiler.set_stance("force_eager"):
        torch.manual_seed(cfg.seed)  # the same masks every evaluation (training RNG untouched)
        for x, y in data.eval_batches(batch_size, cfg.eval_samples or None):
            x = x.to(device)
            if objective == "cls":
                y = y.to(device)
                logits, loss = model(x, y)
                right = logits.argmax(-1) == y
                correct += right.sum()
                weight = len(x)
                if per_sample is not None:
                    per_sample.append(right)
            elif objective == "mlm":
                inputs, targets = model.mask_tokens(x)
                logits, loss = model(inputs, targets)
                chosen = targets[targets != -100]  # lines up with logits' rows
                correct += (logits.argmax(-1) == chosen).sum()
                weight = (targets != -100).sum()
            else:  # mae: masked-patch loss; next: loss per predicted token
                _, loss = model(x)
                weight = len(x) if objective == "mae" else x[:, 1:].numel()
            loss_sum += loss.double() * weight
            count += weight
    model.train(was_training)
    loss_sum, count, correct = loss_sum.item(), count.item(), correct.item()
    metrics = {"val_loss": loss_sum / count}
    if objective in ("cls", "mlm"):
        metrics["top1" if objective == "cls" else "mlm_acc"] = 100 * correct / count
    elif objective == "next":
        metrics["ppl"] = math.exp(min(metrics["val_loss"], 50))
    return metrics


def selection_metric(objective):
    """The metric that decides the best checkpoint, and whether larger is better."""
    return {"cls": ("top1", True), "mlm": ("mlm_acc", True), "next": ("ppl", False),
            "mae": ("val_loss", False)}[objective]


# ----------------------------------------------------------------------------- set-up

def resume_config(args):
    """The saved run's TrainConfig, with the RESUMABLE flags given now; any other flag must
    agree."""
    path = os.path.join(getattr(args, "out_dir", TrainConfig.out_dir), "ckpt.pt")
    ckpt = checkpoint.load(path)
    saved = ckpt.get("train")
    if not isinstance(saved, dict) or set(saved) - {f.name for f in fields(TrainConfig)}:
        raise checkpoint.CheckpointError(f"{path} has no training state this version can resume; "
                                         "fine-tune from it with --init_from instead")
    now = flags_given(args, TrainConfig)
    if now.get("init_from", saved.get("init_from")) != saved.get("init_from"):
        raise TrainingError(f"--resume continues from {path}; --init_from counts only when a run "
                            f"starts (this one started from {saved.get('init_from') or 'scratch'})"
                            "; drop --init_from")
    for name, value in {**now, **flags_given(args, Config)}.items():
        before = saved.get(name, ckpt["config"].get(name))
        if name not in RESUMABLE + PER_INVOCATION and value != before:
            hint = " or fine-tune from it with --init_from" if name == "objective" else ""
            may = " ".join("--" + n for n in RESUMABLE[:-1])
            raise TrainingError(f"--resume: the run in {os.path.dirname(path)} has "
                                f"{name}={before!r}, not {value!r}; "
                                f"--resume may change only {may}; drop --{name}{hint}")
    # fields added since: defaults
    settings = {f.name: saved.get(f.name, f.default) for f in fields(TrainConfig)}
    for f in fields(TrainConfig):
        kinds = (int, float) if f.type is float else f.type
        value = settings[f.name]
        if not isinstance(value, kinds) or (f.type is not bool and isinstance(value, bool)):
            raise checkpoint.CheckpointError(f"{path}: its training setting {f.name}={value!r} is "
                                             "damaged; train again")
    settings.update({name: getattr(TrainConfig, name) for name in PER_INVOCATION})
    settings.update({k: v for k, v in now.items() if k in RESUMABLE + PER_INVOCATION})
    try:
        return TrainConfig(**settings), ckpt
    except TypeError as e:
        raise checkpoint.CheckpointError(f"{path}: its training settings are damaged ({e})") \
            from None


def start_processes(cfg):
    """(device, rank, world): one process, or this rank of a torchrun DDP group."""
    rank, world, local_rank = 0, 1, 0
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    device = fast.pick_device(cfg.device, local_rank)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch_size % (world * cfg.grad_accum):
        raise TrainingError(f"--batch_size {cfg.batch_size} must be divisible by "
                            f"processes x grad_accum = "
                            f"{world} x {cfg.grad_accum}")
    return device, rank, world


def prepare_out_dir(run):
    """Check out_dir before any data is decoded: a writable folder that no other train.py is using
    (a lock held for the whole run), with no other run's files unless --resume or --overwrite.
    --overwrite removes the old run's checkpoint and log now, so that a new run stopped before its
    first checkpoint cannot leave its log beside the old run's checkpoint."""
    out = run.cfg.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out_dir {out} is a file, not a folder; choose another --out_dir")
    run.created_out_dir = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise TrainingError(f"cannot create --out_dir {out} ({e.strerror}); "
                            f"choose another --out_dir") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainingError(f"--out_dir {out} is not writable; choose another --out_dir or "
                            f"fix its permissions")
    run.lock = lock_out_dir(out)
    taken = [name for name in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(out, name))]
    if taken and not run.cfg.resume and not run.cfg.overwrite:
        raise TrainingError(f"--out_dir {out} holds another run ({', '.join(taken)}); "
                            f"continue it with --resume, "
                            "choose another --out_dir, or pass --overwrite to replace it")
    if run.cfg.overwrite:
        for name in taken:  # files train.py wrote, which the user asked to replace
            os.remove(os.path.join(out, name))


def lock_out_dir(out):
    """An exclusive lock on out_dir/.lock for this process's lifetime (None where the platform has
    no flock): a second run into the same folder stops at once instead of interleaving its log and
    replacing the first one's checkpoint."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return None
    f = open(os.path.join(out, ".lock"), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise TrainingError(f"another train.py is running in --out_dir {out}; wait for it to "
                            "finish or choose another --out_dir") from None
    return f


def release_out_dir(run):
    """Drop the lock, and remove out_dir again if this run created it and left nothing in it (a
    run that failed before training leaves no empty folder behind)."""
    if run.lock is None:
        return
    run.lock.close()
    run.lock = None
    out = run.cfg.out_dir
    with suppress(FileNotFoundError):  # someone removed it meanwhile
        os.remove(os.path.join(out, ".lock"))
    if run.created_out_dir and not os.listdir(out):
        os.rmdir(out)


def model_settings(args, cfg, resumed, pretrained):
    """The model's settings before the data is seen: the checkpoint's (resume), or preset, then
    flags."""
    if resumed is not None:
        return dict(resumed["config"])
    settings = dict(PRESETS[cfg.preset]) if cfg.preset else {}
    if pretrained is not None:  # fine-tuning keeps the pretrained trunk's shape
        trunk = ("depth", "width", "heads", "mlp_ratio", "patch_size", "image_size", "vocab_size",
                 "seq_len", "neutreno")
        settings.update({k: pretrained["config"][k] for k in trunk})
    settings.update(flags_given(args, Config))
    objective = settings.get("objective", Config.objective)
    image = objective in IMAGE_OBJECTIVES
    if image != (cfg.dataset in IMAGE_DATASETS):
        wanted = IMAGE_DATASETS if image else TEXT_DATASETS
        raise TrainingError(f"--objective {objective} needs "
                            f"{'an image' if image else 'a text'} dataset "
                            f"({', '.join(wanted)}), not --dataset {cfg.dataset}")
    Config.from_dict(settings)  # a bad model flag stops here, before the data is decoded
    return settings


def load_data(cfg, settings, device):
    if cfg.dataset in IMAGE_DATASETS:
        return ImageData(cfg.dataset, cfg.data_dir, device,
                         settings.get("image_size", Config.image_size),
                         train_samples=cfg.train_samples)
    return TextData(cfg.dataset, cfg.data_dir, cfg.tokenizer, cfg.train_file, cfg.val_file,
                    cfg.cache_dir,
                    settings.get("seq_len", Config.seq_len))


def model_config(settings, data):
    """The final Config: what the data dictates (classes, image size, vocabulary) on top of the
    settings."""
    if isinstance(data, ImageData):
        settings = {**settings, "image_size": data.image_size, "channels": data.channels,
                    "num_classes": data.num_classes}
    else:
        asked = settings.get("vocab_size", data.vocab_size)
        if asked != data.vocab_size:
            raise TrainingError(f"--vocab_size {asked} differs from the tokenizer's "
                                f"{data.vocab_size} ids; drop --vocab_size (the --tokenizer sets "
                                "it)")
        settings = {**settings, "vocab_size": data.vocab_size}
    return Config.from_dict(settings)


def check_trunk_loaded(model, loaded, path):
    """Fine-tuning must start from the pretrained trunk: every block tensor and the stem must have
    come from the checkpoint (a text trunk for an image model, or a flag that reshapes the trunk,
    would silently train from scratch). Fewer blocks than the checkpoint is allowed: the first ones
    are used."""
    stem = ("patch_embed.",) if model.config.is_image else ("tok_embed.", "pos_embed")
    missing = [name for name in model.state_dict() if name.startswith(("blocks.",) + stem)
               and name not in loaded]
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise TrainingError(f"--init_from {path} does not hold this model's trunk: {len(missing)} "
                            f"tensors are absent "
                            f"or shaped differently ({names}); fine-tune from a checkpoint of "
                            f"the same modality and "
                            "tokenizer, without flags that reshape its trunk (--width, "
                            "--mlp_ratio, --patch_size)")


@dataclass
class Run:
    """A training run's state, every field declared here: setup() fills it, train() advances it."""

    cfg: TrainConfig  # the settings (a resumed run: the checkpoint's, with the flags given now)
    device: torch.device  # where the model and the batches live
    rank: int = 0  # this process's rank under torchrun; 0 alone
    world: int = 1  # processes in the DDP group; 1 alone
    data: object = None  # ImageData or TextData
    model: Bamboo = None  # the model itself: what is evaluated and saved
    training_module: nn.Module = None  # what the step calls: model, in fast.py's wrappers, DDP
    compile_mode: str = "off"  # the compilation fast.for_training chose
    dtype: torch.dtype = torch.float32  # autocast dtype
    autocast: object = None  # the context of the forward pass: autocast, or nullcontext in float32
    optimizer: torch.optim.Optimizer = None  # AdamW, one group per (decay, layer-decay scale)
    params: list = None  # every parameter, clipped as one vector each step (a list made once)
    scaler: torch.amp.GradScaler = None  # loss scaling for float16; does nothing otherwise
    generator: torch.Generator = None  # data order and augmentation: the same on every rank
    micro_batch: int = 0  # samples per forward pass on this rank
    step: int = 0  # optimizer steps taken
    best: float = None  # the best value of selection_metric so far
    saved_step: int = None  # the step the checkpoint on disk holds, None before the first
    metrics: dict = None  # the last evaluation
    stop: str = None  # why the run stops early (a signal, the time limit), None while it goes on
    step_times: list = field(default_factory=list)  # seconds per step, evaluations left out
    t_start: float = 0.0  # wall clock at the loop's start, for --time_limit
    lock: object = None  # the open out_dir/.lock that keeps a second run out (rank 0)
    created_out_dir: bool = False  # whether this run made out_dir (removed again if left empty)
    said: float = 0.0  # wall clock of the last progress line in a log file
    init_hash: dict = None  # sha256 of the initial weights: {"trunk": stem and blocks, "model"}

    @property
    def ddp(self):
        return self.world > 1

    @property
    def master(self):
        return self.rank == 0

    @property
    def ckpt_path(self):
        return os.path.join(self.cfg.out_dir, "ckpt.pt")

    @property
    def log_path(self):
        return os.path.join(self.cfg.out_dir, "log.jsonl")

    def log(self, *args):
        if self.master:
            print(*args, flush=True)

    def seconds_per_step(self, last=None):
        """The mean time of the steps so far (of the last ones, if given), the first step left out
        as warm-up unless it is the only one; None before any step."""
        timed = (self.step_times[1:] or self.step_times)[-last if last else 0:]
        return sum(timed) / len(timed) if timed else None


def settings_of(args):
    """(training settings, the checkpoint resumed or None, the pretrained checkpoint or None, the
    model's settings): checked, flags over a preset, a trunk or a resumed run, before any work."""
    if not hasattr(torch.compiler, "set_stance"):  # evaluate() needs it; check before any work
        raise TrainingError(f"torch {torch.__version__} is older than 2.6, the oldest release "
                            f"this code runs on; "
                            "pip install -r requirements.txt")
    resumed = None
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        raise TrainingError("--resume continues the run in --out_dir and --overwrite "
                            "replaces it; choose one")
    if getattr(args, "resume", False):
        cfg, resumed = resume_config(args)
    else:
        given = flags_given(args, TrainConfig)
        cfg = TrainConfig(**{**RECIPES.get(given.get("preset", ""), {}), **given})
    pretrained = checkpoint.load(cfg.init_from) if cfg.init_from and resumed is None else None
    settings = model_settings(args, cfg, resumed, pretrained)
    cfg = schedule_defaults(cfg, settings.get("depth", Config.depth))
    validate(cfg)
    return cfg, resumed, pretrained, settings


def setup(args):
    """Settings, processes, the out_dir, then the run itself (build): everything that can be checked
    is checked before any data is decoded, and a run that fails here leaves no empty out_dir."""
    cfg, resumed, pretrained, settings = settings_of(args)
    device, rank, world = start_processes(cfg)
    run = Run(cfg, device, rank, world)
    try:
        if run.master:
            prepare_out_dir(run)
        build(run, settings, resumed, pretrained)
    except BaseException:
        release_out_dir(run)
        raise
    return run


def build(run, settings, resumed, pretrained):
    """Data, model, optimizer and the module the step calls; resumed if asked."""
    cfg, device = run.cfg, run.device
    run.log(f"loading {cfg.dataset} from {cfg.data_dir} (decoded or tokenized once) ...")
    run.data = load_data(cfg, settings, device)
    config = model_config(settings, run.data)
    run.dtype = fast.pick_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)  # the same init on every rank and for every arm of a comparison
    explicit = fast.use_explicit_attention("auto", device, run.dtype, config)
    run.model = Bamboo(config, explicit_attention=explicit).to(device)
    run.init_hash = checkpoint.weights_hash(run.model)  # before any training or loading
    if pretrained is not None:
        load_pretrained_trunk(run, pretrained)
    run.optimizer = run.model.configure_optimizer(cfg.lr, cfg.weight_decay, cfg.beta2,
                                                  cfg.layer_decay, fused=fast.fused_adamw(device))
    run.params = list(run.model.parameters())
    run.scaler = torch.amp.GradScaler(device.type, enabled=run.dtype == torch.float16)  # not bf16
    run.generator = torch.Generator().manual_seed(cfg.seed)  # data order: the same on every rank
    torch.manual_seed(cfg.seed + 1 + run.rank)  # masks and dropout differ across ranks
    if resumed is not None:
        check_same_classes(run, resumed)
        checkpoint.restore(run, resumed, run.ckpt_path)
        forget_unsaved_steps(run)
        run.log(f"resumed from {run.ckpt_path} at step {run.step}")
    module, run.compile_mode, note = fast.for_training(run.model, device, run.dtype, cfg.compile,
                                                       run.ddp)
    run.log(note)
    run.training_module = module
    if run.ddp:
        ids = [device] if device.type == "cuda" else None
        run.training_module = DistributedDataParallel(module, device_ids=ids)
    run.autocast = nullcontext()
    if run.dtype != torch.float32:  # no autocast cache under CUDA graphs: it outlives a replay
        cache = run.compile_mode != "graphs"
        run.autocast = torch.autocast(device.type, dtype=run.dtype, cache_enabled=cache)
    run.micro_batch = cfg.batch_size // (run.world * cfg.grad_accum)
    run.log(f"{config.objective} {config.depth}x{config.width} ({config.heads} heads), "
            f"{run.model.num_params() / 1e6:.2f}M params, "
            f"{run.model.flops_per_sample() / 1e9:.3f} GFLOPs/sample, "
            f"{device} {str(run.dtype).replace('torch.', '')}, batch {cfg.batch_size} = "
            f"{run.world} x {cfg.grad_accum} x {run.micro_batch}, peak lr {cfg.lr:.3g}, warmup "
            f"{cfg.warmup} steps")
    if cfg.warmup >= cfg.max_iters:
        run.log(f"note: --warmup {cfg.warmup} is not shorter than --max_iters {cfg.max_iters}: the "
                "rate never reaches its peak and never decays")


def check_same_classes(run, resumed):
    """A resumed image run must see the class folders it was trained on, in the same order: labels
    are class indices, so renamed or reordered folders would train on permuted labels."""
    saved = resumed.get("classes")
    now = getattr(run.data, "classes", None)
    if saved is not None and now is not None and list(saved) != list(now):
        raise TrainingError(f"--resume: the run was trained on the classes {saved[:6]}, but "
                            f"{run.cfg.data_dir} holds {now[:6]}; point --data_dir at the same "
                            "class folders (same names, so the same order)")


def logged_step(line):
    """The step of a log.jsonl line; infinite for a line a kill cut short (never kept)."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


def forget_unsaved_steps(run):
    """log.jsonl without the records after the checkpoint's step: the run repeats those steps, and a
    killed run's log would otherwise hold them twice."""
    if not run.master or not os.path.exists(run.log_path):
        return
    with open(run.log_path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = [line for line in lines if logged_step(line) <= run.step]
    if len(kept) < len(lines):
        checkpoint.atomic_write(run.log_path, lambda f: f.write("".join(kept).encode()))


def load_pretrained_trunk(run, pretrained):
    """--init_from: the pretrained stem and blocks, checked to be whole."""
    loaded, skipped = run.model.load_encoder(pretrained["model"])
    check_trunk_loaded(run.model, loaded, run.cfg.init_from)
    run.log(f"init_from {run.cfg.init_from}: loaded {len(loaded)} tensors, skipped {len(skipped)} "
            f"({', '.join(sorted({s.split('.')[0] for s in skipped})) or 'none'})")


# ----------------------------------------------------------------- bookkeeping that is not the step

def any_rank(run, flag):
    """In DDP, True on every rank if it is True on any (so all ranks stop together); else flag."""
    if not run.ddp:
        return flag
    value = torch.tensor([float(flag)], device=run.device if run.device.type == "cuda" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def time_to_stop(run):
    """Whether the run stops after this step: a signal came (stop_signals) or --time_limit passed.
    Every DDP rank must stop at the same step, and agreeing is a host sync: the ranks agree only at
    the steps that read the loss anyway, so that the CPU queues a step while the GPU runs one."""
    cfg = run.cfg
    if cfg.time_limit and time.time() - run.t_start > cfg.time_limit and run.step < cfg.max_iters:
        run.stop = run.stop or "time limit reached"
    if run.ddp:
        return run.step % cfg.log_interval == 0 and any_rank(run, run.stop is not None)
    return run.stop is not None


def last_good_state(run):
    """Where the last good state is, said truthfully."""
    if run.saved_step is None:
        return (f"no checkpoint was written yet (the first comes at step {run.cfg.eval_interval}), "
                "so this run is lost")
    return (f"{run.ckpt_path} still holds step {run.saved_step}, the last good state; resume from "
            "it with --resume")


def divergence_advice(cfg):
    """What to change after a non-finite loss: the rate and the warmup first (a deep trunk diverged
    on a GPU with a warmup that was too short), then clipping if it is off."""
    clip = ", or clip with --grad_clip 1.0" if cfg.grad_clip == 0 else ""
    return f"lower the rate (--lr, now {cfg.lr:.3g}) or lengthen --warmup (now {cfg.warmup}){clip}"


def read_loss(run, total):
    """The training loss as a number (a host sync), refusing a non-finite one before any save."""
    train_loss = total.item()
    if not math.isfinite(train_loss):
        raise TrainingError(f"loss is {train_loss} at step {run.step} (read every "
                            f"--log_interval steps); nothing "
                            f"was saved; {last_good_state(run)}; {divergence_advice(run.cfg)}")
    return train_loss


def stop_if_non_finite(run, metrics):
    """Stop every rank, before anything is saved, where rank 0 found the weights or its evaluation
    non-finite (other ranks pass metrics None)."""
    problem = None
    if run.master:
        weights_finite = all(torch.isfinite(p).all() for p in run.params)
        finite = weights_finite and math.isfinite(metrics["val_loss"])
        if not finite:
            problem = (f"the weights or the evaluation went non-finite at step {run.step}; "
                       f"nothing was saved; "
                       f"{last_good_state(run)}; {divergence_advice(run.cfg)}")
    if any_rank(run, problem is not None):
        raise TrainingError(problem or "rank 0 stopped the run")


def record_evaluation(run, metrics, train_loss, log, bar, correct):
    """Keep the best, write the evaluation to log.jsonl (with the initial trunk's hash) and print
    it; a classifier's per-image correctness goes to eval_correct.npy beside the checkpoint."""
    name, larger_is_better = selection_metric(run.model.config.objective)
    value = metrics[name]
    if run.best is None or (value > run.best if larger_is_better else value < run.best):
        run.best = value
    run.metrics = metrics
    elapsed = time.time() - run.t_start
    record = {"step": run.step, "train_loss": train_loss, **metrics, "elapsed_s": elapsed}
    log.write(json.dumps({"eval": True, **record, "init_trunk_sha256": run.init_hash["trunk"]})
              + "\n")
    if correct:
        flags = torch.cat(correct).cpu().numpy().astype("uint8")  # 1: right, per held-out image
        path = os.path.join(run.cfg.out_dir, "eval_correct.npy")
        checkpoint.atomic_write(path, lambda f: np.save(f, flags))
    bar.write(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items()))


def micro_batch(run, draws, k):
    """Micro-batch k of this rank's part of the global batch whose random draws are `draws`."""
    cfg = run.cfg
    part = {name: v.view(run.world, cfg.grad_accum, run.micro_batch, *v.shape[1:])[run.rank][k]
            for name, v in draws.items()}
    x, y = run.data.train_batch(part)
    return to_device(x, run.device), y


@contextmanager
def stop_signals(run):
    """Ctrl-C and SIGTERM (what schedulers send) set run.stop: the loop finishes the step (under
    DDP, the steps up to the next one that logs the loss), saves and exits; a second Ctrl-C stops at
    once. The handlers before are put back on the way out."""
    def handler(signum, frame):
        if run.stop == "interrupted" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        run.stop = "interrupted"
        when = "the next step that logs the loss" if run.ddp else "this step"
        if run.master:
            print(f"\nstop requested: finishing {when}, then saving a checkpoint (Ctrl-C again "
                  "stops at once, without saving)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


@contextmanager
def log_and_progress(run):
    """(log.jsonl, progress bar) for the loop; on the way out the bar is closed before any error
    line and a DDP rank leaves its process group."""
    from tqdm import tqdm

    # A progress bar on a terminal; in a log file (a scheduler's stdout) only the evaluation lines.
    bar = tqdm(total=run.cfg.max_iters, initial=run.step,
               disable=not (run.master and sys.stderr.isatty()),
               dynamic_ncols=True, mininterval=1.0)
    mode = "a" if run.cfg.resume else "w"  # a fresh run (--overwrite included) starts its own log
    try:
        # Line-buffered: `tail -f log.jsonl` follows the run; a killed run keeps what it logged.
        with open(run.log_path, mode, buffering=1) if run.master else nullcontext() as log:
            yield log, bar
    finally:
        bar.close()
        release_out_dir(run)
        if run.ddp:
            dist.destroy_process_group()


def show_progress(run, bar, train_loss, lr):
    """The loss on the progress bar, whose end is where --time_limit will stop the run if it comes
    first; in a log file (no bar), a progress line with the time left at most every 30 s."""
    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}")
    step_s = run.seconds_per_step(last=50)
    if step_s is None:
        return
    left = run.cfg.max_iters - run.step
    if run.cfg.time_limit:
        left = max(0, min(left, int((run.cfg.time_limit - (time.time() - run.t_start)) / step_s)))
        bar.total = run.step + left
        bar.refresh()
    if bar.disable and run.master and time.time() - run.said >= PROGRESS_EVERY_S:
        run.said = time.time()
        print(f"step {run.step}/{run.cfg.max_iters}: loss {train_loss:.4f}, lr {lr:.2e}, "
              f"{step_s * 1000:.0f} ms/step, about {left * step_s / 60:.1f} min left", flush=True)


def summary(run):
    """The last evaluation, the best, and the speed: ms per step, samples or tokens/s, MFU."""
    if not run.step_times or not run.master or run.metrics is None:
        return
    c, cfg = run.model.config, run.cfg
    name, _ = selection_metric(c.objective)
    unit, per_sample = ("img", 1) if c.is_image else ("tok", c.seq_len)
    step_s = run.seconds_per_step()
    line = (f"{'done' if run.stop is None else 'stopped'}: {name} {run.metrics[name]:.4g} "
            f"(best {run.best:.4g}), "
            f"{step_s * 1000:.1f} ms/step, "
            f"{cfg.batch_size * per_sample / step_s:.0f} {unit}/s")
    peak = fast.gpu_peak_tflops(run.device) if run.device.type == "cuda" else None
    if peak:
        flops = run.model.flops_per_sample() * cfg.batch_size / step_s
        line += f", MFU {flops / (peak * 1e12) * 100:.1f}%"
    run.log(line)


# ----------------------------------------------------------------------------- the training loop

def train(args):
    run = setup(args)
    cfg, model = run.cfg, run.training_module  # the Bamboo, or it in fast.py's wrappers and DDP
    if run.step >= cfg.max_iters:
        run.log(f"nothing to train: the run in {cfg.out_dir} is at step {run.step} of --max_iters "
                f"{cfg.max_iters}; raise --max_iters to train on")
        release_out_dir(run)
        if run.ddp:
            dist.destroy_process_group()
        return 0
    run.t_start = time.time()
    with stop_signals(run), log_and_progress(run) as (log, bar):
        while run.step < cfg.max_iters:
            t0 = time.time()
            # 1. the learning rate of this step; each group scales it by its layer-decay factor
            lr = get_lr(run.step, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr * group["lr_scale"]
            # 2. forward and backward over grad_accum micro-batches of this rank's part of the batch
            draws = run.data.sample(cfg.batch_size, run.generator)  # the global batch, every rank
            loss_sum = torch.zeros((), device=run.device)  # mean over micro-batches and ranks
            for k in range(cfg.grad_accum):
                x, y = micro_batch(run, draws, k)
                # DDP averages the gradients over ranks on the last micro-batch only
                with model.no_sync() if run.ddp and k < cfg.grad_accum - 1 else nullcontext():
                    with run.autocast:
                        _, loss = model(x, y)
                    run.scaler.scale(loss / cfg.grad_accum).backward()
                loss_sum += loss.detach() / (cfg.grad_accum * run.world)
            # 3. clip the whole model's gradient, take the optimizer step, clear the gradients
            if cfg.grad_clip > 0:
                run.scaler.unscale_(run.optimizer)
                torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)
            if run.ddp:
                dist.all_reduce(loss_sum)  # a sum of shares: gloo in torch 2.6 has no ReduceOp.AVG
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.optimizer.zero_grad(set_to_none=True)
            run.step += 1
            bar.update(1)
            # 4. log the loss: reading it waits for the device, so only every log_interval steps
            stopping = time_to_stop(run)
            evaluating = run.step % cfg.eval_interval == 0 or run.step == cfg.max_iters or stopping
            if run.step % cfg.log_interval == 0 or evaluating:
                train_loss = read_loss(run, loss_sum)  # refuses a non-finite loss before any save
                show_progress(run, bar, train_loss, lr)
            run.step_times.append(time.time() - t0)  # up to the read: they add up to the wall clock
            if run.master and run.step % cfg.log_interval == 0:
                log.write(json.dumps({"step": run.step, "loss": train_loss, "lr": lr}) + "\n")
            # 5. evaluate on held-out data and save a checkpoint
            if evaluating:
                state = checkpoint.training_state(run)  # every rank's RNG: a collective under DDP
                metrics, correct = None, []
                if run.master:
                    batch = run.micro_batch * cfg.grad_accum
                    metrics = evaluate(run.model, run.data, cfg, batch, run.device, correct)
                stop_if_non_finite(run, metrics)
                if run.master:
                    record_evaluation(run, metrics, train_loss, log, bar, correct)
                    checkpoint.save(run.ckpt_path, {**state, "best": run.best})
                    run.saved_step = run.step
            if stopping:
                if run.master:  # on a line of its own, not after the progress bar
                    bar.write(f"{run.stop or 'stopped by another rank'} at step {run.step}; "
                              f"checkpoint saved to {run.ckpt_path}; continue with: python "
                              f"train.py --resume --out_dir {cfg.out_dir}")
                break
    summary(run)
    return 130 if run.stop == "interrupted" else 0


def last_checkpoint(args):
    """What a failed run leaves to resume from, said truthfully."""
    path = os.path.join(getattr(args, "out_dir", TrainConfig.out_dir), "ckpt.pt")
    if os.path.isfile(path):
        return "the last checkpoint is as it was; continue with --resume"
    return "no checkpoint was written, so there is nothing to resume"


def out_of_memory(e):
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (DataError, TrainingError, ValueError) as e:
        message = str(e)
    except OSError as e:  # mostly the log: a full disk, a removed folder
        message = (f"input/output failed on {e.filename or 'the log'} ({e.strerror or e}); "
                   f"{last_checkpoint(args)}, once space is free or the path is back")
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        message = (f"out of memory ({str(e).splitlines()[0][:120]}); lower --batch_size (with "
                   f"--grad_accum to keep the batch) or --eval_samples; {last_checkpoint(args)}")
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without saving this step
        print(f"error: interrupted twice; stopped at once; {last_checkpoint(args)}",
              file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # A finished DDP rank (checkpoint replaced, log closed, process group destroyed) leaves
        # without the interpreter's shutdown, where gloo's threads can still touch Python objects
        # and now and then abort the rank after a good run ("terminate called without an active").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
