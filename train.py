"""Train any of the four objectives on images or text; one process, or DDP under torchrun.

The recipe follows nanoGPT's train.py (AdamW with decay/no-decay groups, warmup + cosine in
a visible get_lr, one checkpoint dict holding the config) and Bamboo's protocol (MAE
pre-training, then fine-tuning with layer-wise lr decay via --init_from). The file reads top
to bottom: settings, optimisation, evaluation, checkpoints (save and resume side by side),
set-up, then the loop in train(). Hardware-specific speedups come from fast.py in one call.

Examples:
  python train.py --objective mae --depth 48 --width 384                 # CIFAR-10, downloaded to ./data
  python train.py --preset cifar-small --dataset folder --data_dir ../shared/data/cifar10-jpeg
  python train.py --objective cls --init_from out/ckpt.pt --layer_decay 0.65 --out_dir out-ft
  python train.py --objective next --preset wikitext-small --dataset wikitext2
  torchrun --nproc_per_node=2 train.py --objective cls ...                # DDP: NCCL on GPUs, gloo on CPU
  python train.py --resume --out_dir out --max_iters 4000                 # continue exactly, here for longer
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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fast
from bamboo import IMAGE_OBJECTIVES, OBJECTIVES, PRESETS, Bamboo, Config
from data import IMAGE_DATASETS, TEXT_DATASETS, DataError, ImageData, TextData, atomic_write, to_device

PEAK_BF16_TFLOPS = {"A100": 312, "H100": 989, "H200": 989}  # dense, per GPU


def gpu_peak_tflops(device):
    """Dense bf16 peak of a known CUDA GPU, or None for one not in the table."""
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


@dataclass
class TrainConfig:
    preset: str = ""                 # start from a named model preset (bamboo.PRESETS); model flags override it
    dataset: str = "cifar10"         # cifar10 | cifar100 | folder | wikitext2 | wikitext103 | text
    data_dir: str = "./data"         # where the dataset lives, or is downloaded to
    tokenizer: str = "gpt2"          # text: a tiktoken encoding name, or bytes (256 ids, no download)
    train_file: str = "train.txt"    # --dataset text: training file inside data_dir
    val_file: str = "val.txt"        # --dataset text: evaluation file inside data_dir
    cache_dir: str = "./data/cache"  # text: where tokenized .bin files are cached
    batch_size: int = 128            # samples per optimizer step, summed over processes and grad_accum
    grad_accum: int = 1              # micro-batches per optimizer step
    max_iters: int = 2000            # optimizer steps
    lr: float = -1.0                 # peak learning rate (times the layer-decay scale); -1: base_lr x batch_size / 256
    base_lr: float = 3e-4            # with --lr -1: the peak rate per 256 samples (linear scaling, as DeiT and MAE)
    min_lr: float = 1e-5             # learning rate at the end of the cosine (with --lr -1: at most that rate)
    warmup: int = -1                 # linear warmup steps; -1: max(100, 10 x depth), longer for deeper trunks
    weight_decay: float = 0.05       # AdamW decay on matrices (not on biases, norms, positions)
    beta2: float = 0.95              # AdamW beta2
    grad_clip: float = 1.0           # clip the global gradient norm; 0 turns it off
    layer_decay: float = 1.0         # fine-tuning: lr of block i scaled by layer_decay^(depth + 1 - i)
    eval_interval: int = 200         # evaluate and checkpoint every this many steps
    eval_samples: int = 10000        # held-out images or text windows per evaluation; 0 means all
    train_samples: int = 0           # images: train on a fixed random subset of this many (0: all)
    log_interval: int = 10           # write the training loss to log.jsonl every this many steps
    out_dir: str = "out"             # checkpoint and log.jsonl go here
    overwrite: bool = False          # start afresh in an out_dir that holds another run (its files are replaced)
    seed: int = 1337                 # one seed for the init, the data order and the masks
    device: str = "auto"             # auto picks cuda, then mps, then cpu; or cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto | float32 | bfloat16 | float16 (autocast; auto = bf16 where native)
    compile: str = "auto"            # auto | off | model | blocks | graphs (see fast.py; auto = graphs on CUDA)
    resume: bool = False             # continue from out_dir/ckpt.pt with its settings (see RESUMABLE)
    init_from: str = ""              # fine-tune: load a pretrained trunk (e.g. MAE) from this checkpoint
    time_limit: float = 0.0          # stop with a checkpoint after this many seconds (0: no limit)


CHOICES = {"dataset": IMAGE_DATASETS + TEXT_DATASETS, "objective": OBJECTIVES, "pool": ("mean", "cls"),
           "dtype": ("auto", "float32", "bfloat16", "float16"), "compile": fast.COMPILE_MODES,
           "preset": ("",) + tuple(PRESETS)}
# What --resume may change: length and learning rate, where the data lives, logging. The settings of one
# invocation (machine, time limit) are never inherited from the checkpoint: they are given now or default.
RESUMABLE = ("max_iters", "lr", "base_lr", "min_lr", "warmup", "grad_clip", "eval_interval", "eval_samples",
             "log_interval", "data_dir", "cache_dir", "init_from")
PER_INVOCATION = ("out_dir", "device", "compile", "time_limit", "resume", "overwrite")


class TrainingError(Exception):
    """The run cannot go on; the message is one line and says what to do."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line and says why."""


# ----------------------------------------------------------------------------- settings

def field_comments(cls):
    """The comment after each field of a dataclass: the --help text."""
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))


def build_parser():
    """Every TrainConfig and Config field as a flag. Flags not given stay unset, so that a preset,
    a pretrained trunk or a resumed checkpoint can fill them, and --resume knows what was asked."""
    parser = argparse.ArgumentParser(description="Train bamboo models.", formatter_class=argparse.RawTextHelpFormatter)
    for cls, title in ((TrainConfig, "training"), (Config, "model (defaults shown; a --preset sets its own)")):
        group, comments = parser.add_argument_group(title), field_comments(cls)
        for f in fields(cls):
            kwargs = dict(help=f"{comments.get(f.name, '')} (default: {f.default!r})", default=argparse.SUPPRESS)
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = type(f.default)
                if CHOICES.get(f.name):
                    kwargs["choices"] = CHOICES[f.name]
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def given(args, cls):
    """The flags of dataclass cls that the command line set."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def schedule_defaults(cfg, depth):
    """--lr -1 and --warmup -1 made concrete. The peak rate grows with the batch, as DeiT and MAE scale it; deep
    trunks get a longer warmup: on a GPU, 48 blocks diverged with 100 and, in one seed of five, with 240 warmup
    steps, and trained with 480 in all five (results/gpu/README.md)."""
    warmup = max(100, 10 * depth) if cfg.warmup == -1 else cfg.warmup
    if cfg.lr != -1:
        return replace(cfg, warmup=warmup)
    lr = cfg.base_lr * cfg.batch_size / 256
    return replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr), warmup=warmup)  # small batches: the cosine never rises


def validate(cfg):
    """Check every training setting (after schedule_defaults) as Config checks its fields: one line naming the
    flag and the fix."""
    checks = [
        ("batch_size", cfg.batch_size >= 1, "must be at least 1"),
        ("grad_accum", cfg.grad_accum >= 1, "must be at least 1"),
        ("max_iters", cfg.max_iters >= 1, "must be at least 1"),
        ("base_lr", cfg.base_lr >= 0 and math.isfinite(cfg.base_lr), "must be a finite number >= 0"),
        ("lr", cfg.lr >= 0 and math.isfinite(cfg.lr), "must be a finite number >= 0, or -1 (base_lr x batch / 256)"),
        ("min_lr", 0 <= cfg.min_lr <= max(cfg.lr, 0), f"must be in [0, --lr {cfg.lr}]; lower --min_lr"),
        ("warmup", cfg.warmup >= 0, "must be >= 0, or -1 (max(100, 10 x depth))"),
        ("weight_decay", cfg.weight_decay >= 0, "must be >= 0"),
        ("beta2", 0 < cfg.beta2 < 1, "must be in (0, 1)"),
        ("grad_clip", cfg.grad_clip >= 0, "must be >= 0 (0 turns clipping off)"),
        ("layer_decay", 0 < cfg.layer_decay <= 1, "must be in (0, 1] (1 turns layer decay off)"),
        ("eval_interval", cfg.eval_interval >= 1, "must be at least 1"),
        ("eval_samples", cfg.eval_samples >= 0, "must be >= 0 (0 means the whole held-out split)"),
        ("train_samples", cfg.train_samples >= 0, "must be >= 0 (0 means the whole training split)"),
        ("log_interval", cfg.log_interval >= 1, "must be at least 1"),
        ("time_limit", cfg.time_limit >= 0, "must be >= 0 (0 means no limit)"),
        ("out_dir", cfg.out_dir.strip() != "", "must name a folder"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise TrainingError(f"--{name} {getattr(cfg, name)!r} {why}")


# ----------------------------------------------------------------------------- optimisation

def get_lr(it, cfg):
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at cfg.max_iters."""
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    progress = min(1.0, (it - cfg.warmup) / max(1, cfg.max_iters - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def layer_id(name, depth):
    """0 for the stem, i + 1 for block i, depth + 1 for the final norm and the heads."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return 0 if name.startswith(("patch_embed", "pos_embed", "cls_token", "tok_embed")) else depth + 1


def make_optimizer(model, cfg, device):
    """AdamW; matrices decay, everything else does not; each layer's lr carries its decay scale."""
    depth, groups = model.config.depth, {}
    for name, p in model.named_parameters():
        # No decay on positions, special tokens, or the eigen-parameterization (decay would pull l to 0).
        decay = p.dim() >= 2 and not name.endswith(("pos_embed", "cls_token", "mask_token", "vo.psi", "vo.basis"))
        lr_scale = cfg.layer_decay ** (depth + 1 - layer_id(name, depth))
        # One group per distinct setting: 2 groups without layer decay, so one fused kernel call each.
        group = groups.setdefault((decay, lr_scale), {"params": [], "weight_decay": cfg.weight_decay if decay else 0.0,
                                                      "lr_scale": lr_scale})
        group["params"].append(p)
    return torch.optim.AdamW(list(groups.values()), lr=cfg.lr, betas=(0.9, cfg.beta2), fused=fused_adamw(device))


def fused_adamw(device):
    """The fused AdamW kernel exists on CUDA and CPU, and is the faster one on both (results/bench/README.md)."""
    return device.type in ("cuda", "cpu")


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, data, cfg, batch_size, device):
    """The metric each objective is judged by, on fixed held-out data with fixed masks.

    Sums stay on the device (no host sync per batch).
    """
    objective = model.config.objective
    was_training = model.training
    model.eval()
    loss_sum, count, correct = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    # Compiled blocks run eagerly here: the last batch may be smaller, and no-grad graphs of other shapes
    # would be compiled and captured for a pass that runs once per eval_interval steps.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.compiler.set_stance("force_eager"):
        torch.manual_seed(cfg.seed)  # the same masks every evaluation (training RNG untouched)
        for x, y in data.eval_batches(batch_size, cfg.eval_samples or None):
            x = x.to(device)
            if objective == "cls":
                y = y.to(device)
                logits, loss = model(x, y)
                correct += (logits.argmax(-1) == y).sum()
                weight = len(x)
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


def headline(objective):
    """The metric that decides the best checkpoint and whether larger is better."""
    return {"cls": ("top1", True), "mlm": ("mlm_acc", True), "next": ("ppl", False),
            "mae": ("val_loss", False)}[objective]


# ----------------------------------------------------------------------------- checkpoints: save and resume

def save_checkpoint(path, ckpt):
    """Write ckpt atomically: the last good checkpoint stays as it was if anything goes wrong."""
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except OSError as e:
        raise TrainingError(f"could not write {path} ({e.strerror}); free space in {os.path.dirname(path) or '.'} "
                            "or choose another --out_dir, then continue with --resume") from None


def checkpoint_dict(run):
    """Everything a resume needs, as plain data: config, weights, optimizer, step, every rank's RNG."""
    cuda = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else torch.empty(0, dtype=torch.uint8)
    own = {"torch": torch.get_rng_state(), "cuda": cuda}
    ranks = [own]
    if run.ddp:  # masks and dropout differ per rank, so a resume needs each rank's own state
        ranks = [None] * run.world
        dist.all_gather_object(ranks, own)
    return {"config": run.raw.config.to_dict(), "train": asdict(run.cfg), "model": run.raw.state_dict(),
            "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(), "step": run.step,
            "best": run.best, "rng": {"data": run.generator.get_state(), "ranks": ranks}}


def load_checkpoint(path):
    """A checkpoint dict written by train.py, loaded without running any code (weights_only)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}; check the path (train.py writes OUT_DIR/ckpt.pt)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); "
                              "use another checkpoint or train again") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict) and isinstance(ckpt.get("model"), dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in ckpt["model"].items())):
        raise CheckpointError(f"{path} is not a bamboo checkpoint (no config dict and tensor weights inside)")
    return ckpt


def model_from_checkpoint(path):
    """Rebuild the exact model a checkpoint holds."""
    ckpt = load_checkpoint(path)
    try:
        model = Bamboo(Config.from_dict(ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: its weights do not fit its config ({str(e).splitlines()[0][:160]}); "
                              "it is damaged, train again") from None
    return model, ckpt


def resume_config(args):
    """The saved run's TrainConfig, with the RESUMABLE flags given now; any other flag must agree."""
    path = os.path.join(getattr(args, "out_dir", TrainConfig.out_dir), "ckpt.pt")
    ckpt = load_checkpoint(path)
    saved = ckpt.get("train")
    if not isinstance(saved, dict) or set(saved) - {f.name for f in fields(TrainConfig)}:
        raise CheckpointError(f"{path} has no training state this version can resume; fine-tune from it with "
                              "--init_from instead")
    now = given(args, TrainConfig)
    for name, value in {**now, **given(args, Config)}.items():
        before = saved.get(name, ckpt["config"].get(name))
        if name not in RESUMABLE + PER_INVOCATION and value != before:
            hint = " or fine-tune from it with --init_from" if name == "objective" else ""
            may = " ".join("--" + n for n in RESUMABLE[:-1])
            raise TrainingError(f"--resume: the run in {os.path.dirname(path)} has {name}={before!r}, not {value!r}; "
                                f"--resume may change only {may}; drop --{name}{hint}")
    settings = {f.name: saved.get(f.name, f.default) for f in fields(TrainConfig)}  # fields added since: defaults
    for f in fields(TrainConfig):
        kinds = (int, float) if f.type is float else f.type
        if not isinstance(settings[f.name], kinds) or (f.type is not bool and isinstance(settings[f.name], bool)):
            raise CheckpointError(f"{path}: its training setting {f.name}={settings[f.name]!r} is damaged; train again")
    settings.update({name: getattr(TrainConfig, name) for name in PER_INVOCATION})
    settings.update({name: value for name, value in now.items() if name in RESUMABLE + PER_INVOCATION})
    try:
        return TrainConfig(**settings), ckpt
    except TypeError as e:
        raise CheckpointError(f"{path}: its training settings are damaged ({e})") from None


def restore(run, ckpt):
    """Put the model, optimizer, scaler, step and this rank's RNG back as the checkpoint has them."""
    path = os.path.join(run.cfg.out_dir, "ckpt.pt")
    try:
        run.raw.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not match its own config ({' '.join(str(e).split())[:160]}); "
                              "it is damaged, train again") from None
    try:
        run.scaler.load_state_dict(ckpt["scaler"])
        run.step, run.best = int(ckpt["step"]), ckpt["best"]
        run.generator.set_state(ckpt["rng"]["data"])
        ranks = ckpt["rng"]["ranks"]
        if len(ranks) != run.world:
            raise ValueError(f"it was written by {len(ranks)} processes, this run has {run.world}; use as many")
        torch.set_rng_state(ranks[run.rank]["torch"])
        if run.device.type == "cuda" and ranks[run.rank]["cuda"].numel():
            torch.cuda.set_rng_state(ranks[run.rank]["cuda"], run.device)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CheckpointError(f"{path} cannot be resumed ({' '.join(str(e).split())[:160]})") from None
    run.saved_step = run.step


# ----------------------------------------------------------------------------- set-up

def pick_device(name, local_rank):
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("mps") if torch.backends.mps.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainingError(f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise TrainingError(f"--device {name}: no {device.type} device here; use --device auto or cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise TrainingError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA devices")
    return device


def cpu_has_bf16():
    """Native bf16 arithmetic (AVX512-BF16 or AMX); elsewhere bf16 autocast is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def pick_dtype(name, device):
    """auto: bf16 on CUDA and on CPUs with native bf16 (faster than fp32 there at the same loss:
    results/bench/README.md); fp32 elsewhere, where bf16 is emulated."""
    if name == "auto":
        bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu" and cpu_has_bf16()
        name = "bfloat16" if bf16 else "float32"
    return getattr(torch, name)


def prepare_out_dir(cfg):
    """Check out_dir before any data is decoded: a writable folder, and no other run's files unless --overwrite."""
    out = cfg.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out_dir {out} is a file, not a folder; choose another --out_dir")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise TrainingError(f"cannot create --out_dir {out} ({e.strerror}); choose another --out_dir") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainingError(f"--out_dir {out} is not writable; choose another --out_dir or fix its permissions")
    taken = [name for name in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(out, name))]
    if taken and not cfg.resume and not cfg.overwrite:
        raise TrainingError(f"--out_dir {out} holds another run ({', '.join(taken)}); continue it with --resume, "
                            "choose another --out_dir, or pass --overwrite to replace it")


def model_settings(args, cfg, resumed, pretrained):
    """The model's settings before the data is seen: the checkpoint's (resume), or preset, then flags."""
    if resumed is not None:
        return dict(resumed["config"])
    settings = dict(PRESETS[cfg.preset]) if cfg.preset else {}
    if pretrained is not None:  # fine-tuning keeps the pretrained trunk's shape
        settings.update({k: pretrained["config"][k] for k in ("depth", "width", "heads", "mlp_ratio", "patch_size",
                                                              "image_size", "vocab_size", "seq_len", "neutreno")})
    settings.update(given(args, Config))
    objective = settings.get("objective", Config.objective)
    image = objective in IMAGE_OBJECTIVES
    if image != (cfg.dataset in IMAGE_DATASETS):
        wanted = IMAGE_DATASETS if image else TEXT_DATASETS
        raise TrainingError(f"--objective {objective} needs {'an image' if image else 'a text'} dataset "
                            f"({', '.join(wanted)}), not --dataset {cfg.dataset}")
    Config.from_dict(settings)  # a bad model flag stops here, before the data is decoded
    return settings


def load_data(cfg, settings, device):
    if cfg.dataset in IMAGE_DATASETS:
        return ImageData(cfg.dataset, cfg.data_dir, device, settings.get("image_size", Config.image_size),
                         train_samples=cfg.train_samples)
    return TextData(cfg.dataset, cfg.data_dir, cfg.tokenizer, cfg.train_file, cfg.val_file, cfg.cache_dir,
                    settings.get("seq_len", Config.seq_len))


def model_config(settings, data):
    """The final Config: what the data dictates (classes, image size, vocabulary) on top of the settings."""
    if isinstance(data, ImageData):
        settings = {**settings, "image_size": data.image_size, "channels": data.channels,
                    "num_classes": data.num_classes}
    else:
        settings = {**settings, "vocab_size": data.vocab_size}
    return Config.from_dict(settings)


class Run:
    """One training run's state: settings, processes, data, model, optimizer, progress."""

    def __init__(self, cfg, device, rank, world):
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.ddp, self.master = world > 1, rank == 0
        self.step, self.best, self.saved_step, self.metrics, self.stop, self.step_times = 0, None, None, None, None, []
        self.ckpt_path, self.log_path = os.path.join(cfg.out_dir, "ckpt.pt"), os.path.join(cfg.out_dir, "log.jsonl")

    def log(self, *args):
        if self.master:
            print(*args, flush=True)


def check_trunk_loaded(model, loaded, path):
    """Fine-tuning must start from the pretrained trunk: every block tensor and the stem must have come from the
    checkpoint (a text trunk for an image model, or a flag that reshapes the trunk, would silently train from
    scratch). Fewer blocks than the checkpoint is allowed: the first ones are used."""
    stem = ("patch_embed.",) if model.config.is_image else ("tok_embed.", "pos_embed")
    missing = [name for name in model.state_dict() if name.startswith(("blocks.",) + stem) and name not in loaded]
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise TrainingError(f"--init_from {path} does not hold this model's trunk: {len(missing)} tensors are absent "
                            f"or shaped differently ({names}); fine-tune from a checkpoint of the same modality and "
                            "tokenizer, without flags that reshape its trunk (--width, --mlp_ratio, --patch_size)")


def start_processes(cfg):
    """(device, rank, world): one process, or this rank of a torchrun DDP group."""
    rank, world, local_rank = 0, 1, 0
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(cfg.device, local_rank)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch_size % (world * cfg.grad_accum):
        raise TrainingError(f"--batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                            f"{world} x {cfg.grad_accum}")
    return device, rank, world


def setup(args):
    """Settings, checks (before any data is decoded), processes, data, model, optimizer; resumed if asked."""
    if not hasattr(torch.compiler, "set_stance"):  # evaluate() needs it: else the first evaluation would fail
        raise TrainingError(f"torch {torch.__version__} is older than 2.6, the oldest release this code runs on; "
                            "pip install -r requirements.txt")
    resumed = None
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        raise TrainingError("--resume continues the run in --out_dir and --overwrite replaces it; choose one")
    if getattr(args, "resume", False):
        cfg, resumed = resume_config(args)
    else:
        cfg = TrainConfig(**given(args, TrainConfig))
    pretrained = load_checkpoint(cfg.init_from) if cfg.init_from and resumed is None else None
    settings = model_settings(args, cfg, resumed, pretrained)
    cfg = schedule_defaults(cfg, settings.get("depth", Config.depth))
    validate(cfg)
    device, rank, world = start_processes(cfg)
    run = Run(cfg, device, rank, world)
    if run.master:
        prepare_out_dir(cfg)
    run.data = load_data(cfg, settings, device)
    config = model_config(settings, run.data)
    run.dtype = pick_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)  # the same init on every rank and for every arm of a comparison
    run.raw = Bamboo(config).to(device)  # what is saved: never the compiled or DDP wrapper
    if pretrained is not None:
        loaded, skipped = run.raw.load_encoder(pretrained["model"])
        check_trunk_loaded(run.raw, loaded, cfg.init_from)
        run.log(f"init_from {cfg.init_from}: loaded {len(loaded)} tensors, skipped {len(skipped)} "
                f"({', '.join(sorted({s.split('.')[0] for s in skipped})) or 'none'})")
    run.optimizer = make_optimizer(run.raw, cfg, device)
    run.params = list(run.raw.parameters())  # clipped every step: a list, not a walk of every module each time
    run.scaler = torch.amp.GradScaler(device.type, enabled=run.dtype == torch.float16)  # bf16 needs no scaling
    run.generator = torch.Generator().manual_seed(cfg.seed)  # data order and augmentation, the same on every rank
    torch.manual_seed(cfg.seed + 1 + rank)  # masks and dropout differ across ranks
    if resumed is not None:
        restore(run, resumed)
        run.log(f"resumed from {run.ckpt_path} at step {run.step}")
    model, run.compile_mode, note = fast.for_training(run.raw, device, run.dtype, cfg.compile, run.ddp)
    run.log(note)
    run.model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) if run.ddp \
        else model
    run.autocast = torch.autocast(device.type, dtype=run.dtype, cache_enabled=run.compile_mode != "graphs") \
        if run.dtype != torch.float32 else nullcontext()
    run.micro = cfg.batch_size // (world * cfg.grad_accum)
    run.log(f"{config.objective} {config.depth}x{config.width} ({config.heads} heads), "
            f"{run.raw.num_params() / 1e6:.2f}M params, {run.raw.flops_per_sample() / 1e9:.3f} GFLOPs/sample, "
            f"{device} {str(run.dtype).replace('torch.', '')}, batch {cfg.batch_size} = {world} x {cfg.grad_accum} "
            f"x {run.micro}, peak lr {cfg.lr:.3g}, warmup {cfg.warmup} steps")
    return run


# ----------------------------------------------------------------------------- the loop

def agree(run, flag):
    """In DDP, True on every rank if it is True on any (so all ranks stop together); else flag itself."""
    if not run.ddp:
        return flag
    value = torch.tensor([float(flag)], device=run.device if run.device.type == "cuda" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def lost_work(run):
    """Where the last good state is, said truthfully."""
    if run.saved_step is None:
        return f"no checkpoint was written yet (the first comes at step {run.cfg.eval_interval}), so this run is lost"
    return f"{run.ckpt_path} still holds step {run.saved_step}, the last good state; resume from it with --resume"


def optimizer_step(run):
    """One optimizer step over grad_accum micro-batches; returns the mean training loss of all ranks as a
    tensor on the device: reading it would make the CPU wait for the GPU, so train() reads it only to log."""
    cfg, lr = run.cfg, get_lr(run.step, run.cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]
    recipe = run.data.sample(cfg.batch_size, run.generator)  # the global batch; each rank takes its shard
    shard = {k: v.view(run.world, cfg.grad_accum, run.micro, *v.shape[1:])[run.rank] for k, v in recipe.items()}
    total = torch.zeros((), device=run.device)
    for k in range(cfg.grad_accum):
        x, y = run.data.train_batch({key: v[k] for key, v in shard.items()})
        x = to_device(x, run.device)
        # DDP syncs gradients only on the last micro-batch; forward and backward share one no_sync context
        with run.model.no_sync() if run.ddp and k < cfg.grad_accum - 1 else nullcontext():
            with run.autocast:
                _, loss = run.model(x, y)
            run.scaler.scale(loss / cfg.grad_accum).backward()
        total += loss.detach() / (cfg.grad_accum * run.world)  # this rank's share of the mean over all ranks
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)
    if run.ddp:
        dist.all_reduce(total)  # the sum of the shares: gloo in torch 2.6 has no ReduceOp.AVG
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return total, lr


def divergence_advice(cfg):
    """What to change after a non-finite loss: the rate and the warmup first (a deep trunk diverged on a GPU with
    a warmup that was too short), then clipping if it is off."""
    clip = ", or clip with --grad_clip 1.0" if cfg.grad_clip == 0 else ""
    return f"lower the rate (--lr, now {cfg.lr:.3g}) or lengthen --warmup (now {cfg.warmup}){clip}"


def read_loss(run, total):
    """The training loss as a number (a host sync), refusing a non-finite one before anything is saved."""
    train_loss = total.item()
    if not math.isfinite(train_loss):
        raise TrainingError(f"loss is {train_loss} at step {run.step} (read every --log_interval steps); nothing "
                            f"was saved; {lost_work(run)}; {divergence_advice(run.cfg)}")
    return train_loss


def parameters_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


def evaluate_and_save(run, train_loss, jsonl):
    """Evaluate on rank 0, then save if the evaluation and the weights are finite; every rank takes part."""
    ckpt = checkpoint_dict(run)  # a collective under DDP: every rank gives its RNG
    problem = None
    if run.master:
        metrics = evaluate(run.raw, run.data, run.cfg, run.micro * run.cfg.grad_accum, run.device)
        name, larger_is_better = headline(run.raw.config.objective)
        if not parameters_finite(run.raw) or not math.isfinite(metrics["val_loss"]):
            problem = (f"the weights or the evaluation went non-finite at step {run.step}; nothing was saved; "
                       f"{lost_work(run)}; {divergence_advice(run.cfg)}")
        else:
            if run.best is None or (metrics[name] > run.best if larger_is_better else metrics[name] < run.best):
                run.best = ckpt["best"] = metrics[name]
            record = {"step": run.step, "train_loss": train_loss, **metrics, "elapsed_s": time.time() - run.t_start}
            jsonl.write(json.dumps({"eval": True, **record}) + "\n")
            jsonl.flush()
            run.bar.write(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
            run.metrics = metrics
            save_checkpoint(run.ckpt_path, ckpt)
            run.saved_step = run.step
    if agree(run, problem is not None):
        raise TrainingError(problem or "rank 0 stopped the run")


def request_stop(run):
    """Ctrl-C and SIGTERM (what schedulers send) finish the step (under DDP, the steps up to the next one that logs
    the loss), save and exit; a second Ctrl-C stops at once. Returns the handlers it replaced, for train() to put
    back."""
    def handler(signum, frame):
        if run.stop == "interrupted" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        run.stop = "interrupted"

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def summary(run):
    """The last evaluation, the best, and the speed: ms per step, samples or tokens per second, MFU on GPUs."""
    if not run.step_times or not run.master or run.metrics is None:
        return
    c, cfg = run.raw.config, run.cfg
    name, _ = headline(c.objective)
    unit, per_sample = ("img", 1) if c.is_image else ("tok", c.seq_len)
    step_s = sum(run.step_times[1:] or run.step_times) / max(1, len(run.step_times) - 1)  # the first step warms up
    line = (f"done: {name} {run.metrics[name]:.4g} (best {run.best:.4g}), {step_s * 1000:.1f} ms/step, "
            f"{cfg.batch_size * per_sample / step_s:.0f} {unit}/s")
    peak = gpu_peak_tflops(run.device) if run.device.type == "cuda" else None
    if peak:
        line += f", MFU {run.raw.flops_per_sample() * cfg.batch_size / step_s / (peak * 1e12) * 100:.1f}%"
    run.log(line)


def train(args):
    run = setup(args)
    cfg = run.cfg
    if run.step >= cfg.max_iters:
        run.log(f"nothing to train: the run in {cfg.out_dir} is at step {run.step} of --max_iters {cfg.max_iters}; "
                "raise --max_iters to train on")
        if run.ddp:
            dist.destroy_process_group()
        return 0
    previous_handlers = request_stop(run)
    from tqdm import tqdm

    # A progress bar on a terminal; in a log file (a scheduler's stdout) only the evaluation lines.
    run.bar = tqdm(total=cfg.max_iters, initial=run.step, disable=not (run.master and sys.stderr.isatty()),
                   dynamic_ncols=True, mininterval=1.0)
    run.t_start = time.time()
    mode = "a" if cfg.resume else "w"  # a fresh run (--overwrite included) starts its own log
    try:
        # Line-buffered: `tail -f log.jsonl` follows the run, and a killed run keeps every line it logged.
        with open(run.log_path, mode, buffering=1) if run.master else nullcontext() as jsonl:
            while run.step < cfg.max_iters:
                t0 = time.time()
                total, lr = optimizer_step(run)
                run.bar.update(1)
                if cfg.time_limit and time.time() - run.t_start > cfg.time_limit and run.step < cfg.max_iters:
                    run.stop = run.stop or "time limit reached"
                stopping = run.stop is not None
                if run.ddp:
                    # Every rank must stop at the same step, and agreeing on it is a host sync: the ranks agree only
                    # at the steps that read the loss anyway, so that the CPU queues a step while the GPU runs one.
                    stopping = run.step % cfg.log_interval == 0 and agree(run, stopping)
                evaluating = run.step % cfg.eval_interval == 0 or run.step == cfg.max_iters or stopping
                if run.step % cfg.log_interval == 0 or evaluating:
                    train_loss = read_loss(run, total)
                    run.bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}")
                # A GPU only queues the steps between two reads of the loss, and the read waits for them to run:
                # timed up to here, the steps' times add up to the wall clock, evaluations left out.
                run.step_times.append(time.time() - t0)
                if run.master and run.step % cfg.log_interval == 0:
                    jsonl.write(json.dumps({"step": run.step, "loss": train_loss, "lr": lr}) + "\n")
                if evaluating:
                    evaluate_and_save(run, train_loss, jsonl)
                if stopping:
                    run.log(f"{run.stop or 'stopped by another rank'} at step {run.step}; checkpoint saved to "
                            f"{run.ckpt_path}; continue with: python train.py --resume --out_dir {cfg.out_dir}")
                    break
    finally:
        run.bar.close()  # before any error line, so the message is the last thing printed
        for sig, previous in previous_handlers.items():
            signal.signal(sig, previous)
        if run.ddp:
            dist.destroy_process_group()
    if run.stop is None:
        summary(run)
    return 130 if run.stop == "interrupted" else 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (DataError, TrainingError, CheckpointError, ValueError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # mostly the log: a full disk, a removed folder (checkpoints say so themselves)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: input/output failed on {e.filename or 'the log'} ({e.strerror or e}); the last checkpoint "
                  "is as it was; free space or restore the path, then continue with --resume", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without saving this step
        print("error: interrupted twice; stopped at once, the last checkpoint is as it was", file=sys.stderr)
        return 130


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # A finished DDP rank (checkpoint replaced, log closed, process group destroyed) leaves without the
        # interpreter's shutdown, where gloo's threads can still touch Python objects and, now and then, abort
        # the rank after a good run ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
