"""Train any of the four objectives on images or text; one process, or DDP under torchrun.

The recipe follows nanoGPT's train.py (AdamW with decay/no-decay groups, warmup + cosine in
a visible get_lr, one checkpoint dict holding the config) and Bamboo's protocol (MAE
pre-training, then fine-tuning with layer-wise lr decay via --init_from).

Examples:
  python train.py --objective mae --depth 48 --width 384                 # CIFAR-10, downloaded to ./data
  python train.py --preset cifar-small --dataset folder --data_dir ../shared/data/cifar10-jpeg
  python train.py --objective cls --init_from out/ckpt.pt --layer_decay 0.65 --out_dir out-ft
  python train.py --objective next --preset wikitext-small --dataset wikitext2
  torchrun --nproc_per_node=2 train.py --objective cls ...                # DDP: NCCL on GPUs, gloo on CPU
  python train.py --resume --out_dir out                                  # continue exactly where it stopped
"""
import argparse
import ctypes
import inspect
import json
import math
import os
import re
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bamboo import IMAGE_OBJECTIVES, OBJECTIVES, PRESETS, Bamboo, CheckpointError, Config, load_checkpoint
from data import IMAGE_DATASETS, TEXT_DATASETS, DataError, ImageData, TextData

PEAK_BF16_TFLOPS = {"A100": 312, "H100": 989, "H200": 989}  # dense, per GPU


def gpu_peak_tflops(device):
    """Dense bf16 peak of a known CUDA GPU, or None for one not in the table."""
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


@dataclass
class TrainConfig:
    preset: str = ""                # start from a named model preset (bamboo.PRESETS); model flags override it
    dataset: str = "cifar10"        # cifar10 | cifar100 | folder | wikitext2 | wikitext103 | text
    data_dir: str = "./data"        # where the dataset lives, or is downloaded to
    tokenizer: str = "gpt2"         # text: a tiktoken encoding name, or bytes (256 ids, no download)
    train_file: str = "train.txt"   # --dataset text: training file inside data_dir
    val_file: str = "val.txt"       # --dataset text: evaluation file inside data_dir
    cache_dir: str = "./data/cache" # text: where tokenized .bin files are cached
    batch_size: int = 128           # samples per optimizer step, summed over processes and grad_accum
    grad_accum: int = 1             # micro-batches per optimizer step
    max_iters: int = 2000           # optimizer steps
    lr: float = 1e-3                # peak learning rate (times the layer-decay scale)
    min_lr: float = 1e-5            # learning rate at the end of the cosine
    warmup: int = 100               # linear warmup steps
    weight_decay: float = 0.05      # AdamW decay on matrices (not on biases, norms, positions)
    beta2: float = 0.95             # AdamW beta2
    grad_clip: float = 1.0          # clip the global gradient norm; 0 turns it off
    layer_decay: float = 1.0        # fine-tuning: lr of block i scaled by layer_decay^(depth + 1 - i)
    eval_interval: int = 200        # evaluate and checkpoint every this many steps
    eval_samples: int = 10000       # held-out images or text windows per evaluation; 0 means all
    log_interval: int = 10          # write the training loss to log.jsonl every this many steps
    out_dir: str = "out"            # checkpoint and log.jsonl go here
    seed: int = 1337                # one seed for the init, the data order and the masks
    device: str = "auto"            # auto picks cuda, then mps, then cpu
    dtype: str = "auto"             # auto | float32 | bfloat16 | float16 (autocast; auto = bf16 where native)
    compile: str = "auto"           # auto | on | off: torch.compile (auto = on for CUDA)
    resume: bool = False            # continue from out_dir/ckpt.pt with its config
    init_from: str = ""             # fine-tune: load a pretrained trunk (e.g. MAE) from this checkpoint
    time_limit: float = 0.0         # stop with a checkpoint after this many seconds (0: no limit)


CHOICES = {"dataset": IMAGE_DATASETS + TEXT_DATASETS, "objective": OBJECTIVES, "pool": ("mean", "cls"),
           "dtype": ("auto", "float32", "bfloat16", "float16"), "compile": ("auto", "on", "off"),
           "preset": ("",) + tuple(PRESETS)}


class TrainingError(Exception):
    """The run cannot go on; the message is one line and says what to do."""


# ----------------------------------------------------------------------------- command line

def field_comments(cls):
    """The comment after each field of a dataclass: the --help text."""
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))


def build_parser():
    parser = argparse.ArgumentParser(description="Train bamboo models.", formatter_class=argparse.RawTextHelpFormatter)
    for cls, title in ((TrainConfig, "training"), (Config, "model (defaults shown; a --preset sets its own)")):
        group, comments = parser.add_argument_group(title), field_comments(cls)
        for f in fields(cls):
            kwargs = dict(help=f"{comments.get(f.name, '')} (default: {f.default!r})")
            # Model flags not given stay unset, so that a preset or a checkpoint can fill them.
            kwargs["default"] = argparse.SUPPRESS if cls is Config else f.default
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = type(f.default)
                if CHOICES.get(f.name):
                    kwargs["choices"] = CHOICES[f.name]
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


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
    """The fused AdamW kernel exists on CUDA and CPU; on CPU it was 3 to 9x faster (results/bench/changes.txt)."""
    return device.type in ("cuda", "cpu")


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, data, cfg, batch_size, device):
    """The metric each objective is judged by, on fixed held-out data with fixed masks."""
    objective = model.config.objective
    was_training = model.training
    model.eval()
    totals = {"loss": 0.0, "n": 0, "correct": 0, "tokens": 0}
    with torch.random.fork_rng(devices=[]):  # the same masks every evaluation; training RNG untouched
        torch.manual_seed(cfg.seed)
        for x, y in data.eval_batches(batch_size, cfg.eval_samples or None):
            x = x.to(device)
            if objective == "cls":
                y = y.to(device)
                logits, loss = model(x, y)
                totals["correct"] += (logits.argmax(-1) == y).sum().item()
                weight = len(x)
            elif objective == "mlm":
                inputs, targets = model.mask_tokens(x)
                logits, loss = model(inputs, targets)
                chosen = targets[targets != -100]  # lines up with logits' rows
                totals["correct"] += (logits.argmax(-1) == chosen).sum().item()
                weight = len(chosen)
            else:  # mae: masked-patch loss; next: loss per predicted token
                _, loss = model(x)
                weight = len(x) if objective == "mae" else x[:, 1:].numel()
            totals["loss"] += loss.item() * weight
            totals["n"] += weight
    model.train(was_training)
    loss = totals["loss"] / max(1, totals["n"])
    metrics = {"val_loss": loss}
    if objective == "cls":
        metrics["top1"] = 100 * totals["correct"] / totals["n"]
    elif objective == "mlm":
        metrics["mlm_acc"] = 100 * totals["correct"] / totals["n"]
    elif objective == "next":
        metrics["ppl"] = math.exp(min(loss, 50))
    return metrics


def headline(objective):
    """The metric that decides the best checkpoint and whether larger is better."""
    return {"cls": ("top1", True), "mlm": ("mlm_acc", True), "next": ("ppl", False), "mae": ("val_loss", False)}[objective]


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(path, model, optimizer, scaler, cfg, step, best, generator):
    """One dict of plain data; written to a temp file and renamed, so a crash never corrupts it."""
    ckpt = {
        "config": model.config.to_dict(),
        "train": asdict(cfg),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "best": best,
        "rng": {"torch": torch.get_rng_state(), "data": generator.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- setup

def pick_device(name, local_rank):
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# glibc's malloc hands large freed blocks back to the kernel, so every CPU training step page-faults
# its activations and autocast's bf16 weight copies in again. Keeping them made a next:wikitext-small
# step 1.5x and a cls:bamboo-b step 1.1x to 1.2x faster on our 2-core EPYC (README, Performance).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt() parameters from <malloc.h>


def keep_freed_memory():
    """Linux/glibc: reuse freed memory instead of returning it to the kernel; True if applied.

    Blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap is not
    trimmed. Peak RSS stays about the same; the process just keeps it. MALLOC_* variables in the
    environment are the user's own allocator settings, and they win.
    """
    if not sys.platform.startswith("linux") or any(key.startswith("MALLOC_") for key in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, for one)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def cpu_has_bf16():
    """Native bf16 arithmetic (AVX512-BF16 or AMX); elsewhere bf16 autocast is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def pick_dtype(name, device):
    """auto: bf16 on CUDA and on CPUs with native bf16 (measured: 2.9x faster than fp32 on a 2-core
    AVX512-BF16 EPYC, loss after 200 steps within 0.2%); fp32 elsewhere."""
    if name == "auto":
        bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu" and cpu_has_bf16()
        name = "bfloat16" if bf16 else "float32"
    return getattr(torch, name)


def model_settings(args, cfg, resumed, pretrained):
    """The model's settings before the data is seen: the checkpoint's (resume), or preset, then flags."""
    given = {f.name: getattr(args, f.name) for f in fields(Config) if hasattr(args, f.name)}
    if resumed is not None:
        saved = resumed["config"]
        clash = {k: v for k, v in given.items() if saved.get(k) != v}
        if clash:
            k, v = next(iter(clash.items()))
            hint = " or fine-tune from it with --init_from" if k == "objective" else ""
            raise TrainingError(f"--resume: the checkpoint in {cfg.out_dir} has {k}={saved.get(k)!r}, "
                                f"not {v!r}; resume with the same settings{hint}")
        return dict(saved)
    settings = dict(PRESETS[cfg.preset]) if cfg.preset else {}
    if pretrained is not None:  # fine-tuning keeps the pretrained trunk's shape
        settings.update({k: pretrained["config"][k] for k in ("depth", "width", "heads", "mlp_ratio", "patch_size",
                                                              "image_size", "vocab_size", "seq_len", "neutreno")})
    settings.update(given)
    objective = settings.get("objective", Config.objective)
    image = objective in IMAGE_OBJECTIVES
    if image != (cfg.dataset in IMAGE_DATASETS):
        wanted = IMAGE_DATASETS if image else TEXT_DATASETS
        raise TrainingError(f"--objective {objective} needs {'an image' if image else 'a text'} dataset "
                            f"({', '.join(wanted)}), not --dataset {cfg.dataset}")
    return settings


def load_data(cfg, settings, device):
    if cfg.dataset in IMAGE_DATASETS:
        return ImageData(cfg.dataset, cfg.data_dir, device, settings.get("image_size", Config.image_size))
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


# ----------------------------------------------------------------------------- the run

def train(args):
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    resumed = None
    if cfg.resume:
        path = os.path.join(cfg.out_dir, "ckpt.pt")
        resumed = load_checkpoint(path)
        keep = {k: getattr(cfg, k) for k in ("out_dir", "device", "time_limit", "resume", "compile")}
        unknown = set(resumed.get("train", {})) - {f.name for f in fields(TrainConfig)}
        if "train" not in resumed or unknown:
            raise CheckpointError(f"{path} has no training state this version can resume; fine-tune from it with "
                                  "--init_from instead")
        cfg = TrainConfig(**{**resumed["train"], **keep})
    if cfg.batch_size < 1 or cfg.max_iters < 1 or cfg.grad_accum < 1 or cfg.eval_interval < 1:
        raise TrainingError("--batch_size, --max_iters, --grad_accum and --eval_interval must be at least 1")
    pretrained = load_checkpoint(cfg.init_from) if cfg.init_from else None
    settings = model_settings(args, cfg, resumed, pretrained)

    ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    rank, world, local_rank = 0, 1, 0
    if ddp:
        rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(cfg.device, local_rank)
    if device.type == "cpu":
        keep_freed_memory()
    if ddp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch_size % (world * cfg.grad_accum):
        raise TrainingError(f"--batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                            f"{world} x {cfg.grad_accum}")
    micro = cfg.batch_size // (world * cfg.grad_accum)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    data = load_data(cfg, settings, device)
    config = model_config(settings, data)
    dtype = pick_dtype(cfg.dtype, device)

    torch.manual_seed(cfg.seed)  # the same init on every rank and for every arm of a comparison
    model = Bamboo(config).to(device)
    if pretrained is not None:
        loaded, skipped = model.load_encoder(pretrained["model"])
        log(f"init_from {cfg.init_from}: loaded {len(loaded)} tensors, skipped {len(skipped)} "
            f"({', '.join(sorted({s.split('.')[0] for s in skipped})) or 'none'})")
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # bf16 needs no scaling
    generator = torch.Generator().manual_seed(cfg.seed)  # data order and augmentation, the same on every rank
    torch.manual_seed(cfg.seed + 1 + rank)  # masks and dropout differ across ranks
    step, best = 0, None
    if resumed is not None:
        try:
            model.load_state_dict(resumed["model"])
            optimizer.load_state_dict(resumed["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{cfg.out_dir}/ckpt.pt does not match its own config "
                                  f"({str(e).splitlines()[0][:120]}); it is damaged, train again") from None
        scaler.load_state_dict(resumed["scaler"])
        step, best = resumed["step"], resumed["best"]
        generator.set_state(resumed["rng"]["data"])
        torch.set_rng_state(resumed["rng"]["torch"])
        if device.type == "cuda" and resumed["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(resumed["rng"]["cuda"])
        log(f"resumed from {cfg.out_dir}/ckpt.pt at step {step}")

    raw = model  # what is saved: never the compiled or DDP wrapper
    if cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda"):
        model = torch.compile(model)
    if ddp:
        model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path, log_path = os.path.join(cfg.out_dir, "ckpt.pt"), os.path.join(cfg.out_dir, "log.jsonl")
    metric_name, larger_is_better = headline(config.objective)
    unit = "tok" if not config.is_image else "img"
    per_sample = config.seq_len if unit == "tok" else 1
    log(f"{config.objective} {config.depth}x{config.width} ({config.heads} heads), "
        f"{raw.num_params() / 1e6:.2f}M params, {raw.flops_per_sample() / 1e9:.3f} GFLOPs/sample, "
        f"{device} {str(dtype).replace('torch.', '')}, batch {cfg.batch_size} = {world} x {cfg.grad_accum} x {micro}")

    stop = {"why": None}

    def request_stop(signum, frame):
        if stop["why"] == "interrupted":
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        stop["why"] = "interrupted"

    signal.signal(signal.SIGINT, request_stop)
    from tqdm import tqdm

    bar = tqdm(total=cfg.max_iters, initial=step, disable=not master, dynamic_ncols=True, mininterval=1.0)
    t_start, step_times = time.time(), []
    try:
        with open(log_path, "a") if master else nullcontext() as jsonl:
            while step < cfg.max_iters:
                t0 = time.time()
                lr = get_lr(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                recipe = data.sample(cfg.batch_size, generator)  # the global batch; each rank takes its shard
                shard = {k: v.view(world, cfg.grad_accum, micro, *v.shape[1:])[rank] for k, v in recipe.items()}
                total = 0.0
                for k in range(cfg.grad_accum):
                    x, y = data.train_batch({key: v[k] for key, v in shard.items()})
                    x = x.to(device, non_blocking=True)
                    sync = model.no_sync() if ddp and k < cfg.grad_accum - 1 else nullcontext()
                    with sync, autocast:
                        _, loss = model(x, y)
                    with sync:
                        scaler.scale(loss / cfg.grad_accum).backward()
                    total += loss.detach() / cfg.grad_accum
                if cfg.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
                if ddp:
                    dist.all_reduce(total, op=dist.ReduceOp.AVG)
                train_loss = total.item()
                if not math.isfinite(train_loss):
                    raise TrainingError(f"loss is {train_loss} at step {step}; stopped without saving, so "
                                        f"{ckpt_path} still holds the last good state; lower --lr or set --grad_clip")
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                step_times.append(time.time() - t0)
                bar.update(1)
                bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}",
                                **{f"{unit}/s": f"{cfg.batch_size * per_sample / step_times[-1]:.0f}"})
                if master and step % cfg.log_interval == 0:
                    jsonl.write(json.dumps({"step": step, "loss": train_loss, "lr": lr}) + "\n")
                if cfg.time_limit and time.time() - t_start > cfg.time_limit and step < cfg.max_iters:
                    stop["why"] = "time limit reached"
                if step % cfg.eval_interval == 0 or step == cfg.max_iters or stop["why"]:
                    if master:
                        metrics = evaluate(raw, data, cfg, micro * cfg.grad_accum, device)
                        value = metrics[metric_name]
                        if best is None or (value > best if larger_is_better else value < best):
                            best = value
                        record = {"step": step, "train_loss": train_loss, **metrics, "elapsed_s": time.time() - t_start}
                        jsonl.write(json.dumps({"eval": True, **record}) + "\n")
                        jsonl.flush()
                        bar.write(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
                        save_checkpoint(ckpt_path, raw, optimizer, scaler, cfg, step, best, generator)
                    if ddp:
                        dist.barrier()
                if stop["why"]:
                    log(f"{stop['why']} at step {step}; checkpoint saved to {ckpt_path}; "
                        f"continue with: python train.py --resume --out_dir {cfg.out_dir}")
                    break
    finally:
        bar.close()  # before any error line, so the message is the last thing printed
    if step_times and master and not stop["why"]:
        step_s = sum(step_times[1:] or step_times) / max(1, len(step_times) - 1)  # the first step pays warm-up
        summary = (f"done: {metric_name} {metrics[metric_name]:.4g} (best {best:.4g}), {step_s * 1000:.1f} ms/step, "
                   f"{cfg.batch_size * per_sample / step_s:.0f} {unit}/s")
        if device.type == "cuda":
            peak = gpu_peak_tflops(device)
            if peak:
                summary += f", MFU {raw.flops_per_sample() * cfg.batch_size / step_s / (peak * 1e12) * 100:.1f}%"
        log(summary)
    if ddp:
        dist.destroy_process_group()
    return 130 if stop["why"] == "interrupted" else 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (DataError, TrainingError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
