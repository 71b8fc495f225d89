"""Train any of the four objectives (mae, cls, mlm, next) on images or text; alone or under DDP.

nanoGPT's train.py with Bamboo's protocol: AdamW with decay and no-decay groups, warmup and cosine
in a visible get_lr, MAE pre-training, then fine-tuning with layer-wise decay (--init_from). Read
top to bottom: the settings, the learning rate, then train(): set-up, then the loop. The path:

  main -> train -> load_data (-> streaming.open_images: data.ImageData, or a stream)
       -> Bamboo, Bamboo.configure_optimizer (bamboo.py), fast.for_training (the module that runs)
       -> the loop: get_lr, data.sample, shard, data.train_batch (data.py), module(x, y) (the
          model's forward and loss, compiled as for_training chose), scaler.step(optimizer)

What surrounds a run (the out_dir's lock, signals, progress, one-line errors), the checkpoint files
and the speedups are in operations/, called by module name where they happen.

Run: python train.py --objective mae --depth 48 --width 384
"""
import time

STARTED = time.time()  # --time_limit counts from here, before torch is imported (hence E402)

import json
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from operations import checkpoint, checks, cli, fast, out_dir, progress, runlog, streaming
from bamboo import IMAGE_OBJECTIVES, OBJECTIVES, PRESETS, Bamboo, Config, training_flops
from data import IMAGE_DATASETS, TEXT_DATASETS, TextData, first_samples, shard
from probe import logged_metrics


# ----------------------------------------------------------------------------- settings

@dataclass
class TrainConfig:
    preset: str = ""                 # a named model (bamboo.PRESETS); model flags override it
    dataset: str = "cifar10"         # cifar10 | cifar100 | folder | wikitext2 | wikitext103 | text
    data_dir: str = "./data"         # where the dataset lives, or is downloaded to
    tokenizer: str = "gpt2"          # text: a tiktoken encoding, bytes (256 ids, offline), hf:NAME
    train_file: str = "train.txt"    # --dataset text: training file inside data_dir
    val_file: str = "val.txt"        # --dataset text: evaluation file inside data_dir
    cache_dir: str = "./data/cache"  # tokenized text and decoded image folders are kept here
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
    layer_decay: float = 1.0         # fine-tuning: block i (from 1)'s lr x decay^(depth + 1 - i)
    eval_interval: int = 200         # evaluate and checkpoint every this many steps
    eval_samples: int = 10000        # held-out images or text windows per evaluation; 0 means all
    probe_samples: int = 64          # each evaluation logs probe.py's per-layer metrics on these
    train_samples: int = 0           # images: train on a fixed random subset of this many (0: all)
    stream: str = "auto"             # folder: on reads files as it trains (MAE's crops), off once
    memory_gb: float = 16.0          # --stream auto streams a folder larger than this decoded
    workers: int = -1                # streaming: decoders per rank; -1: CPUs per rank - 1, <= 8
    crop_scale: float = -1.0         # streaming: smallest crop area; -1: 0.2 (mae), 0.08 (cls)
    log_interval: int = 10           # write the training loss to log.jsonl every this many steps
    out_dir: str = "out"             # checkpoint and log.jsonl go here
    overwrite: bool = False          # start afresh in an out_dir that holds another run (removed)
    seed: int = 1337                 # one seed for the init, the data order and the masks
    device: str = "auto"             # auto: cuda, then mps, then cpu; or cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto | float32 | bfloat16 | float16 (auto: bf16 where native)
    threads: int = 0                 # CPU threads; 0: torch's, one per core (busy CPU: try 1)
    compile: str = "auto"            # auto | off | model | blocks | graphs (see operations/fast.py)
    resume: bool = False             # continue from out_dir/ckpt.pt with its settings (RESUMABLE)
    init_from: str = ""              # fine-tune: load a pretrained trunk (e.g. MAE) from this file
    time_limit: float = 0.0          # end within this long of starting, evaluated as fits (0: none)
    eval_only: bool = False          # evaluate the weights as set up (--resume, --init_from), once


# The laptop presets' training recipes, as nanoGPT's config files: what learns on a 2-core CPU.
RECIPES = {
    "cifar-small": dict(batch_size=128, max_iters=3600, lr=2e-3, warmup=200, eval_interval=400),
    "cifar-deep": dict(batch_size=128, max_iters=1500, lr=2e-3, warmup=100, eval_interval=500),
    **dict.fromkeys(("wikitext-small", "wikitext-deep"), dict(
        batch_size=16, max_iters=400, lr=2e-3, warmup=40, eval_interval=100, eval_samples=1024)),
}


def schedule_defaults(cfg, depth):
    """--lr -1 and --warmup -1 made concrete. The peak rate grows with the batch, as DeiT and MAE
    scale it; deep trunks get a longer warmup, which a 48-block trunk needed to stay finite."""
    warmup = max(100, 10 * depth) if cfg.warmup == -1 else cfg.warmup
    if cfg.lr != -1:
        return replace(cfg, warmup=warmup)
    lr = cfg.base_lr * cfg.batch_size / 256
    return replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr), warmup=warmup)  # the cosine never rises


# What --resume may change: length and learning rate (the peak itself: --base_lr made it once),
# where the data lives, logging; one invocation's (machine, time limit) are never the checkpoint's.
RESUMABLE = ("max_iters", "lr", "min_lr", "warmup", "grad_clip", "eval_interval", "eval_samples",
             "probe_samples", "log_interval", "data_dir", "cache_dir")
PER_INVOCATION = ("out_dir", "device", "threads", "compile", "time_limit", "resume", "overwrite",
                  "eval_only", "memory_gb", "workers")
# What --eval_only --init_from takes from the checkpoint: its data and batches (masks), as drawn
HELD_OUT = ("dataset", "data_dir", "tokenizer", "train_file", "val_file", "cache_dir",
            "eval_samples", "stream", "train_samples", "seed", "batch_size")
# What fine-tuning keeps of the pretrained model: the trunk's shape
TRUNK_SHAPE = ("depth", "width", "heads", "mlp_ratio", "patch_size", "image_size", "vocab_size",
               "seq_len", "neutreno", "vo_param")


def resolve_settings(args):
    """(cfg, resumed and pretrained checkpoints, model settings, where each came from), checked
    before any work. Precedence, lowest first: defaults < preset and recipe < a resumed run < the
    --init_from trunk's shape (--eval_only: its whole model and data) < flags."""
    checks.check_invocation(args)
    resumed = pretrained = None
    given = {**cli.flags_given(args, TrainConfig), **cli.flags_given(args, Config)}
    if getattr(args, "resume", False):  # the saved run, flags allowed only where RESUMABLE
        cfg, resumed = checks.resumed_settings(args, TrainConfig, Config, RESUMABLE, PER_INVOCATION)
        settings = dict(resumed["config"])
        saved = [k for k in vars(cfg) if k in resumed["train"] and k not in PER_INVOCATION]
        sources = dict.fromkeys([*settings, *saved], "the resumed run")
    else:
        recipe = RECIPES.get(given.get("preset", ""), {})
        cfg = TrainConfig(**{**recipe, **cli.flags_given(args, TrainConfig)})
        settings = dict(PRESETS[cfg.preset]) if cfg.preset else {}
        sources = {**dict.fromkeys(settings, f"the {cfg.preset} preset"),
                   **dict.fromkeys(recipe, f"the {cfg.preset} recipe")}
        if cfg.init_from:  # fine-tuning keeps the pretrained trunk's shape, and a text one's tokens
            pretrained = checkpoint.load(cfg.init_from)
            kept = list(pretrained["config"]) if cfg.eval_only else TRUNK_SHAPE
            settings.update({k: pretrained["config"][k] for k in kept})
            text = pretrained["config"].get("objective") not in IMAGE_OBJECTIVES
            taken = HELD_OUT if cfg.eval_only else ("tokenizer",) if text else ()
            saved = {k: v for k, v in pretrained.get("train", {}).items()
                     if k in taken and k not in given}  # scoring: its data, as it was trained
            cfg = replace(cfg, **saved)
            sources.update(dict.fromkeys([*kept, *saved], "the --init_from checkpoint"))
        if cfg.preset in RECIPES:  # on the data it will run on (--eval_only: the checkpoint's)
            checks.check_recipe_fits(cfg.preset, cfg.dataset, "seq_len" in PRESETS[cfg.preset])
        settings.update(cli.flags_given(args, Config))
        if cfg.eval_only and pretrained is not None:
            checks.check_scored_as_trained(cfg.init_from, pretrained, settings)
    sources.update(dict.fromkeys(given, "flags"))
    objective = settings.get("objective", Config.objective)
    streaming.check_dataset_fits(objective in IMAGE_OBJECTIVES, objective, cfg.dataset)
    Config.from_dict(settings)  # a bad model flag stops here, before the data is decoded
    derived = {"lr": cfg.lr == -1, "min_lr": cfg.lr == -1, "warmup": cfg.warmup == -1}
    cfg = schedule_defaults(cfg, settings.get("depth", Config.depth))
    sources.update({k: "the batch and depth (-1)" for k, auto in derived.items() if auto})
    if cfg.crop_scale == -1 and objective in IMAGE_OBJECTIVES:  # MAE's: 0.2 pre-trains, 0.08 tunes
        cfg = replace(cfg, crop_scale=0.2 if objective == "mae" else 0.08)
        sources["crop_scale"] = "the objective (-1)"
    checks.check_settings(cfg)
    return cfg, resumed, pretrained, settings, sources


# ----------------------------------------------------------------------------- the learning rate

def get_lr(it, cfg):
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at cfg.max_iters. Unless given, the
    peak cfg.lr is base_lr x batch / 256 and the warmup max(100, 10 x depth) (schedule_defaults)."""
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    decayed = min(1.0, (it - cfg.warmup) / max(1, cfg.max_iters - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * decayed))


# ----------------------------------------------------------------------------- the run

def train(args, started=None):
    """One run, top to bottom as nanoGPT's: settings, processes, data, model, optimizer, a resumed
    run's state, then the loop. Its state is the local variables below."""
    t_begin = time.time() if started is None else started  # --time_limit counts from here
    cfg, resumed, pretrained, settings, sources = resolve_settings(args)
    device, rank, world = start_processes(cfg)
    master, ddp = rank == 0, world > 1

    def say(*lines):  # rank 0 speaks for the run; an empty note says nothing
        if master and any(lines):
            print(*lines, flush=True)

    ckpt_path, best_path, log_path = (os.path.join(cfg.out_dir, name)
                                      for name in ("ckpt.pt", "best.pt", "log.jsonl"))
    # out_dir: locked for the run, removed again if made and left empty (--eval_only writes none)
    with out_dir.out_dir_claimed(cfg.out_dir, cfg.resume, cfg.overwrite,
                                 master and not cfg.eval_only), \
            progress.process_group_left(ddp):
        say(f"loading {cfg.dataset} from {cfg.data_dir} ...")
        data, config = load_data(cfg, settings, device, rank, world, resumed or pretrained)

        # the model: the same initial weights on every rank and for every arm of a comparison
        dtype = fast.pick_dtype(cfg.dtype, device)
        torch.manual_seed(cfg.seed)
        explicit = fast.use_explicit_attention("auto", device, dtype, config)
        model = Bamboo(config, explicit_attention=explicit).to(device)
        init_hash = checkpoint.weights_hash(model)  # before any training or loading
        if pretrained is not None and cfg.eval_only:  # scoring: every weight, the head too
            checks.load_whole(model, pretrained["model"], cfg.init_from)
        elif pretrained is not None:  # --init_from: the pretrained stem and blocks, whole
            loaded, skipped = model.load_encoder(pretrained["model"])
            say(checks.check_trunk_loaded(model, cfg.init_from, loaded, skipped))
            init_hash["loaded_trunk"] = checkpoint.weights_hash(model, trunk_only=True)["trunk"]

        # the optimizer and the data order, then a resumed run's state over all of it
        optimizer = model.configure_optimizer(cfg.lr, cfg.weight_decay, cfg.beta2, cfg.layer_decay)
        params = list(model.parameters())  # clipped as one vector each step
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        generator = torch.Generator().manual_seed(cfg.seed)  # data order: the same on every rank
        torch.manual_seed(cfg.seed + 1 + rank)  # masks and dropout differ across ranks
        step, best, saved_step = 0, None, None  # saved_step: what ckpt.pt holds (None: nothing)
        if resumed is not None:
            checks.check_same_data(resumed, data, cfg.data_dir, cfg.eval_samples, master)
            step, best = checkpoint.load_states(resumed, ckpt_path, model, optimizer, scaler)
            checkpoint.restore_random_states(resumed, ckpt_path, generator, rank, world, device)
            saved_step, init_hash = step, resumed.get("init_hash") or init_hash  # the run's start
            if master and not cfg.eval_only:  # the log's records after the checkpoint, dropped
                runlog.forget_unsaved_steps(log_path, step)
            say(f"resumed from {ckpt_path} at step {step}")
            say(checks.schedule_note(resumed["train"], cfg, step, get_lr))  # a longer cosine

        # what the step calls: the model, or the same forward and loss compiled (fast.for_training)
        module, compile_mode = model, "off"  # --eval_only: evaluation runs eagerly
        if not cfg.eval_only:
            module, compile_mode, note = fast.for_training(model, device, dtype, cfg.compile, ddp,
                                                           cfg.max_iters)
            say(note)
        if ddp:
            module = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda"
                                             else None)
        # no autocast cache under CUDA graphs: it outlives a replay
        autocast = (torch.autocast(device.type, dtype=dtype, cache_enabled=compile_mode != "graphs")
                    if dtype != torch.float32 else nullcontext())
        micro_batch = cfg.batch_size // (world * cfg.grad_accum)  # samples per forward, this rank
        eval_batch = cfg.batch_size  # however the batch is split: the same evaluation masks
        probe_x = first_samples(data, cfg.probe_samples) if master and cfg.probe_samples else None
        if master and cfg.overwrite:  # only now that every check has passed
            out_dir.remove_old_run(cfg.out_dir)
        say(f"{config.objective} {config.depth}x{config.width}, heads {config.heads}, "
            f"{model.num_params() / 1e6:.2f}M params, {training_flops(config) / 1e9:.3f} "
            f"GFLOPs/sample, {device} {str(dtype).replace('torch.', '')}, batch {cfg.batch_size} "
            f"= {world} process(es) x {cfg.grad_accum} accumulated x {micro_batch}"
            + ("" if cfg.eval_only else f", peak lr {cfg.lr:.3g}, warmup {cfg.warmup} steps"))
        say("\n".join(checks.settings_lines(cfg, config, data, sources, device)))

        if cfg.eval_only:  # nanoGPT's eval_only: the weights as set up, judged once, nothing saved
            metrics = evaluate(model, data, cfg.eval_samples, eval_batch, device, cfg.seed)
            what = f"{cfg.init_from} as trained" if cfg.init_from and step == 0 else None
            say(f"evaluated {what or f'at step {step}'}: "
                + " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
            return 0
        if step >= cfg.max_iters:
            say(f"nothing to train: the run in {cfg.out_dir} is at step {step} of --max_iters "
                f"{cfg.max_iters}; raise --max_iters to train on")
            return 0

        # ------------------------------------------------------------------------- the loop
        clock = progress.Clock(t_begin, cfg, progress.held_out_batches(
            data, cfg.eval_samples, eval_batch), cfg.log_interval if ddp else 1)
        if cfg.time_limit and master:  # what an evaluation takes, timed now: the limit keeps back
            clock.overhead_s, clock.batch_s, clock.probe_s = time_evaluation(
                model, data, eval_batch, device, probe_x)
            say(clock.limit_note())
        made_by = runlog.code_and_machine(device, dtype)  # commit, command, torch, machine
        metrics, t_start = None, time.time()
        with progress.stop_signals(ddp, master) as stop, \
                runlog.log_file(log_path, cfg, master, made_by, step) as log, \
                progress.progress_bar(cfg.max_iters, step, master) as bar:
            while step < cfg.max_iters:
                t0 = time.time()
                # 1. the learning rate of this step; each group scales it by its layer-decay factor
                lr = get_lr(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                # 2. forward and backward over grad_accum micro-batches of this rank's share
                draws = data.sample(cfg.batch_size, generator)  # the global batch, every rank
                loss_sum = torch.zeros((), device=device)  # mean over micro-batches and ranks
                for k in range(cfg.grad_accum):
                    part = shard(draws, rank, world, cfg.grad_accum, k)  # this rank's slice
                    x, y = data.train_batch(part)  # on the device
                    # DDP averages the gradients over ranks on the last micro-batch only
                    with module.no_sync() if ddp and k < cfg.grad_accum - 1 else nullcontext():
                        with autocast:
                            _, loss = module(x, y)
                        scaler.scale(loss / cfg.grad_accum).backward()
                    loss_sum += loss.detach() / (cfg.grad_accum * world)
                # 3. clip the whole model's gradient, take the optimizer step, clear the gradients
                if cfg.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if ddp:
                    dist.all_reduce(loss_sum)  # a sum of shares: gloo in torch 2.6 has no AVG
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                bar.update(1)
                # 4. log the loss: reading it waits for the device, so only every log_interval
                if clock.out_of_time(step):
                    stop.reason = stop.reason or "time limit reached"
                stopping = stop.reason is not None
                if ddp:  # the ranks agree, at the steps that read the loss anyway
                    stopping = step % cfg.log_interval == 0 and progress.any_rank(stopping, device)
                evaluating = step % cfg.eval_interval == 0 or step == cfg.max_iters or stopping
                if step % cfg.log_interval == 0 or evaluating:
                    train_loss = progress.read_loss(loss_sum, step, cfg, saved_step)
                    clock.show_progress(bar, step, train_loss, lr, master)
                clock.step_times.append(time.time() - t0)  # up to the read: the wall clock's
                if master and step % cfg.log_interval == 0:
                    log.write(json.dumps({"step": step, "loss": train_loss, "lr": lr}) + "\n")
                # 5. evaluate on held-out data and save a checkpoint (a stop too: time was kept)
                if not evaluating:
                    continue
                rng = checkpoint.random_states(generator, device, world)  # a collective in DDP
                correct = []
                if master:
                    t_eval = time.time()
                    short = clock.short_of_time()  # then no probe, and the batches that fit
                    metrics = evaluate(model, data, cfg.eval_samples, eval_batch, device, cfg.seed,
                                       correct, until=clock.evaluation_deadline(short))
                    if probe_x is not None and not short and math.isfinite(metrics["val_loss"]):
                        # over-smoothing as it forms, layer by layer
                        metrics["layers"] = logged_metrics(model, probe_x, eval_batch)
                    clock.eval_s = time.time() - t_eval
                # nothing non-finite is saved: every rank stops where rank 0 found it
                finite = not master or (math.isfinite(metrics["val_loss"])
                                        and all(torch.isfinite(p).all() for p in params))
                stop_all = progress.any_rank(not finite, device) if ddp else not finite
                if stop_all:  # every rank joins the all-reduce, then every rank stops
                    what = (f"the weights or the evaluation went non-finite at step {step}"
                            if not finite else "rank 0 stopped the run")
                    raise progress.diverged(what, cfg, saved_step)
                if master:
                    name, larger_is_better = runlog.selection_metric(config.objective)
                    improved = "eval_samples" not in metrics and (best is None or (
                        metrics[name] > best if larger_is_better else metrics[name] < best))
                    best = metrics[name] if improved else best
                    record = {"step": step, "train_loss": train_loss, **metrics,
                              "elapsed_s": time.time() - t_start}
                    runlog.record_evaluation(log, bar, record, model, init_hash)
                    state = {"config": config.to_dict(), "train": asdict(cfg),
                             "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "step": step, "best": best,
                             "rng": rng, "classes": getattr(data, "classes", None),
                             "fingerprint": data.fingerprint,  # what a resume must find
                             "window": getattr(data, "window", None),  # tokens per text window
                             "statistics": ((data.mean.cpu(), data.std.cpu()) if config.is_image
                                            else None),  # the pixels' normalisation
                             "init_hash": init_hash, "made_by": made_by}
                    t_save = time.time()
                    checkpoint.save(ckpt_path, state)  # first: best.pt is never ahead of it
                    runlog.save_correct(correct, cfg.out_dir)  # nor is eval_correct.npy
                    if improved:  # the best weights so far, without the optimizer
                        checkpoint.save(best_path, checkpoint.weights_only(state))
                    saved_step, clock.save_s = step, time.time() - t_save
                if cfg.time_limit and not stopping:  # no room left for a step and an evaluation
                    stopping = clock.out_of_time(step)
                    stopping = progress.any_rank(stopping, device) if ddp else stopping
                    if stopping or stop.reason == "time limit reached":  # as the ranks agreed
                        stop.reason = (stop.reason or "time limit reached") if stopping else None
                if stopping:
                    if master:
                        bar.write(progress.how_to_resume(stop.reason, step, world, cfg.out_dir))
                    break
        say(clock.summary(model, metrics, best, stop.reason, device, dtype))
    return 130 if stop.reason == "interrupted" else 0


# ---------------------------------------------------------- what set-up and the loop call, in order

CHOICES = {"dataset": IMAGE_DATASETS + TEXT_DATASETS, "stream": ("auto", "on", "off"),
           "objective": OBJECTIVES, "pool": ("mean", "cls"), "dtype": fast.DTYPES,
           "compile": fast.COMPILE_MODES, "preset": ("",) + tuple(PRESETS)}


def build_parser():
    """Every TrainConfig and Config field as a flag, with its comment as the help."""
    recipes = "\n".join(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in recipe.items())
                         for name, recipe in RECIPES.items())
    return cli.parser_of(((TrainConfig, "training"),
                          (Config, "model (defaults shown; a --preset sets its own)")),
                         CHOICES, "a laptop preset also sets its training recipe (flags "
                         "override it):\n" + recipes)


def start_processes(cfg):
    """(device, rank, world): one process, or this rank of a torchrun DDP group."""
    if cfg.threads:  # on a CPU shared with other work, fewer threads than cores can be faster
        torch.set_num_threads(cfg.threads)
    rank, world, local_rank = 0, 1, 0
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # torchrun sets these three
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    device = fast.pick_device(cfg.device, local_rank)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch_size % (world * cfg.grad_accum):
        raise cli.TrainingError(f"--batch_size {cfg.batch_size} must be divisible by "
                                f"processes x grad_accum = {world} x {cfg.grad_accum}")
    return device, rank, world


def load_data(cfg, settings, device, rank=0, world=1, saved=None):
    """(the dataset, decoded or tokenized once, images on the device as uint8; the final Config,
    in which what the data dictates wins: classes, image size, vocabulary). A resumed or scored
    checkpoint (saved) is seen as it was trained: its pixel statistics, its text windows."""
    saved = saved if cfg.resume or cfg.eval_only else None  # fine-tuning reads the data afresh
    if cfg.dataset in IMAGE_DATASETS:
        data = streaming.open_images(
            cfg.dataset, cfg.data_dir, device, settings.get("image_size", Config.image_size),
            train_samples=cfg.train_samples, stream=cfg.stream, memory_gb=cfg.memory_gb,
            cache_dir=cfg.cache_dir, statistics=saved and saved.get("statistics"),
            crop_scale=cfg.crop_scale, workers=cfg.workers, rank=rank, world=world,
            grad_accum=cfg.grad_accum)
        cfg.stream = "on" if isinstance(data, streaming.ImageStream) else "off"  # kept in ckpt.pt
        return data, Config.from_dict({**settings, "image_size": data.image_size,
                                       "channels": data.channels, "num_classes": data.num_classes})
    data = TextData(cfg.dataset, cfg.data_dir, cfg.tokenizer, cfg.train_file, cfg.val_file,
                    cfg.cache_dir, settings.get("seq_len", Config.seq_len), device=device,
                    next_token=settings.get("objective", Config.objective) == "next")
    checks.check_vocab_size(settings.get("vocab_size"), data.vocab_size)
    return data, Config.from_dict({**settings, "vocab_size": data.vocab_size})


@torch.no_grad()
def evaluate(model, data, samples, batch_size, device, seed=0, per_sample=None, until=None):
    """The metric each objective is judged by, on the first `samples` held-out samples (0: all),
    masks fixed by the seed; per_sample (a list) gets each image's correctness, in order. Past the
    wall clock `until` no more batches: the metrics then name the eval_samples they are of."""
    objective, was_training = model.config.objective, model.training
    model.eval()
    loss_sum, count, correct = (torch.zeros((), dtype=torch.float64, device=device)
                                for _ in range(3))
    # Eager here: a smaller last batch would compile (and capture) graphs for a rare no-grad pass.
    with torch.random.fork_rng([] if device.type == "cpu" else [device], device_type=device.type), \
            torch.compiler.set_stance("force_eager"):
        torch.manual_seed(seed)  # the same masks every evaluation (training RNG untouched)
        batches = data.eval_batches(batch_size, samples or None)
        total = progress.held_out_batches(data, samples, batch_size)
        scored, cut = 0, False
        for x, y in progress.evaluation_progress(batches, total):
            if until is not None and scored and time.time() > until:
                cut = True
                break
            scored += len(x)
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
    if cut:
        metrics["eval_samples"] = scored
    return metrics


def time_evaluation(model, data, batch_size, device, probe_x):
    """(seconds an evaluation takes besides its batches, seconds per held-out batch, seconds of the
    probe): from warm evaluations of one batch and of two, for --time_limit to keep back."""
    times = []
    for n in (1, 1, 2):  # the first warms up
        t = time.time()
        evaluate(model, data, n * batch_size, batch_size, device)
        times.append(time.time() - t)
    t = time.time()
    if probe_x is not None:
        logged_metrics(model, probe_x, batch_size)
    one = min(times[:2])  # a hiccup in one of them is not read as the fixed cost
    batch_s = max(0.0, times[2] - one)
    return max(0.0, one - batch_s), batch_s, time.time() - t


def main(argv=None, started=None):
    args = build_parser().parse_args(argv)
    with cli.one_line_errors(getattr(args, "out_dir", TrainConfig.out_dir)) as outcome:
        outcome.code = train(args, started)
    return outcome.code


if __name__ == "__main__":
    cli.exit_process(main(started=STARTED))
