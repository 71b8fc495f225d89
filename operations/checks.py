"""A run's settings checked before any work: each bad flag one line naming the fix; what a resume
may change and must find unchanged (the data); fine-tuning's trunk; the settings lines a run prints.

Run: python train.py --help (every flag), or any run's first lines (its settings)
"""
import math
import os
import textwrap
from dataclasses import fields, replace

import torch

from bamboo import TRUNK
from data import IMAGE_DATASETS
from operations import checkpoint, fast
from operations.cli import RUN_FILES, TrainingError, flags_given
from operations.streaming import ImageStream

SCHEDULE = ("max_iters", "lr", "min_lr", "warmup")  # what get_lr reads


def check_invocation(args):
    """What no setting fixes: torch < 2.6; --overwrite with --resume, --eval_only or its init."""
    if not hasattr(torch.compiler, "set_stance"):  # evaluate() needs it; check before any work
        raise TrainingError(f"torch {torch.__version__} is older than 2.6, the oldest release "
                            "this code runs on; pip install -r requirements.txt")
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        raise TrainingError("--resume continues the run, --overwrite replaces it: choose one")
    if getattr(args, "eval_only", False) and getattr(args, "overwrite", False):
        raise TrainingError("--eval_only saves nothing, so it replaces nothing; drop --overwrite")
    init, out = getattr(args, "init_from", ""), getattr(args, "out_dir", "out")
    if getattr(args, "overwrite", False) and init and os.path.basename(init) in RUN_FILES and (
            os.path.realpath(os.path.dirname(init)) == os.path.realpath(out)):
        raise TrainingError(f"--overwrite would remove --init_from {init} with the run in {out}; "
                            "copy it elsewhere first, or choose another --out_dir")


def check_settings(cfg):
    """Every training setting (after schedule_defaults): one line naming the flag and the fix."""
    checks = [
        ("batch_size", cfg.batch_size >= 1, "must be at least 1"),
        ("grad_accum", cfg.grad_accum >= 1, "must be at least 1"),
        ("max_iters", cfg.max_iters >= 1, "must be at least 1"),
        ("base_lr", 0 <= cfg.base_lr < math.inf, "must be a finite number >= 0"),
        ("lr", 0 <= cfg.lr < math.inf,
         "must be a finite number >= 0, or -1 (base_lr x batch / 256)"),
        ("min_lr", 0 <= cfg.min_lr <= max(cfg.lr, 0),
         f"must be in [0, --lr {cfg.lr}]; lower --min_lr"),
        ("warmup", cfg.warmup >= 0, "must be >= 0, or -1 (max(100, 10 x depth))"),
        ("weight_decay", cfg.weight_decay >= 0, "must be >= 0"),
        ("beta2", 0 < cfg.beta2 < 1, "must be in (0, 1)"),
        ("grad_clip", cfg.grad_clip >= 0, "must be >= 0 (0 turns clipping off)"),
        ("layer_decay", 0 < cfg.layer_decay <= 1, "must be in (0, 1] (1 turns layer decay off)"),
        ("eval_interval", cfg.eval_interval >= 1, "must be at least 1"),
        ("eval_samples", cfg.eval_samples >= 0, "must be >= 0 (0: the whole held-out split)"),
        ("train_samples", cfg.train_samples >= 0, "must be >= 0 (0: the whole training split)"),
        ("log_interval", cfg.log_interval >= 1, "must be at least 1"),
        ("threads", cfg.threads >= 0, "must be >= 0 (0: torch's default)"),
        ("probe_samples", cfg.probe_samples >= 0, "must be >= 0 (0: no per-layer metrics)"),
        ("time_limit", 0 <= cfg.time_limit < math.inf, "must be a number of seconds >= 0 (0 "
         "means no limit)"),
        ("out_dir", cfg.out_dir.strip() != "", "must name a folder"),
        ("seed", -2 ** 63 <= cfg.seed < 2 ** 63 - 1024, "must fit in 64 bits (at most 18 digits)"),
        ("memory_gb", cfg.memory_gb >= 0, "must be >= 0 (0 streams every image folder)"),
        ("workers", cfg.workers >= -1, "must be >= 0, or -1 (CPUs per rank but one, at most 8)"),
        ("crop_scale", 0 < cfg.crop_scale <= 1 or cfg.crop_scale == -1, "must be in (0, 1], or -1 "
         "(MAE's for the objective)"),
        ("stream", cfg.stream != "on" or cfg.dataset in IMAGE_DATASETS or cfg.resume,
         f"reads image files; --dataset {cfg.dataset} is text, tokenized once (drop --stream)"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise TrainingError(f"--{name} {getattr(cfg, name)!r} {why}")


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
    if not isinstance(saved, dict):  # a field since removed (wandb_project) is left unread
        raise checkpoint.CheckpointError(f"{path} has no training state this version can resume; "
                                         "fine-tune from it with --init_from instead")
    now = flags_given(args, train_config)
    if now.get("init_from", saved.get("init_from")) != saved.get("init_from"):
        raise TrainingError(f"--resume continues from {path}; --init_from counts only when a run "
                            f"starts (this one started from {saved.get('init_from') or 'scratch'})"
                            "; drop --init_from")
    given = {**now, **flags_given(args, model_config)}
    before = {name: saved.get(name, ckpt["config"].get(name)) for name in given}
    changed = [name for name, value in given.items()  # every one, in one line
               if name not in resumable + per_invocation and value != before[name]]
    if changed:
        hint = " or fine-tune from it with --init_from" if "objective" in changed else ""
        has = ", ".join(f"{name}={before[name]!r}, not {given[name]!r}" for name in changed)
        raise TrainingError(f"--resume: the run in {os.path.dirname(path)} has {has}; --resume "
                            f"may change only {' '.join('--' + n for n in resumable)}; drop "
                            f"{' '.join('--' + n for n in changed)}{hint}")
    settings = {f.name: saved.get(f.name, f.default) for f in fields(train_config)}  # or default
    settings.update({name: getattr(train_config, name) for name in per_invocation})
    settings.update({k: v for k, v in now.items() if k in resumable + per_invocation})
    return train_config(**settings), ckpt


def check_same_data(resumed, data, data_dir, eval_samples, master=True):
    """A resumed run must see the data it was trained on: a folder's files and labels (the data
    order), CIFAR's pixels, the same text. Another --eval_samples is said."""
    if "fingerprint" not in resumed:  # written before 2026-11-28: it kept no data fingerprint
        raise TrainingError(f"--resume: this checkpoint predates the data check of this version; "
                            f"resume it with commit {checkpoint.LAST_TO_READ_OLD}, or fine-tune or "
                            "score it with --init_from")
    if resumed["fingerprint"] != data.fingerprint:
        raise TrainingError(f"--resume: the data in {data_dir} are not those the run was trained "
                            "on (files, class folders or text changed since); point --data_dir at "
                            "them, or start a new run on these")
    before = resumed["train"].get("eval_samples", eval_samples)
    if master and before != eval_samples:
        print(f"note: --eval_samples {eval_samples} (the run evaluated {before} before): 'best' "
              "now compares evaluations on different held-out sets", flush=True)


def schedule_note(saved, cfg, step, get_lr):
    """A line when a resumed run's new schedule (a longer --max_iters re-times the cosine) raises
    the learning rate over what the run's own schedule gives at this step; else ''."""
    if cfg.eval_only or saved.get("max_iters", cfg.max_iters) == cfg.max_iters:
        return ""
    old = replace(cfg, **{k: saved[k] for k in SCHEDULE if k in saved})
    was = get_lr(min(step, old.max_iters - 1), old)  # past its end: the rate of its last step
    now = get_lr(step, cfg)
    if now <= 1.5 * was:
        return ""
    return (f"note: the new schedule raises the learning rate at step {step} from {was:.2g} to "
            f"{now:.2g} (the cosine now ends at step {cfg.max_iters}); to go on at {was:.2g}, pass "
            f"--lr {was:.2g} --min_lr {was:.2g}")


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
                            "on the data it was trained on (drop --dataset, --data_dir)") from None


def check_trunk_loaded(model, path, loaded, skipped):
    """The line that says what fine-tuning loaded; refused unless the stem and every block came
    from the checkpoint (else a mismatched trunk would train from scratch). Fewer blocks: fine."""
    missing = [name for name in model.state_dict() if name.startswith(TRUNK) and name not in loaded]
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise TrainingError(f"--init_from {path} does not hold this model's trunk: {len(missing)} "
                            f"tensors are absent or shaped differently ({names}); fine-tune from "
                            "a checkpoint of the same modality and tokenizer, without flags that "
                            "reshape its trunk (--width, --mlp_ratio, --patch_size, --vo_param)")
    return (f"init_from {path}: loaded {len(loaded)} tensors, skipped {len(skipped)} "
            f"({', '.join(sorted({s.split('.')[0] for s in skipped})) or 'none'})")


# What only training reads: given with --eval_only, it does nothing
TRAINING_ONLY = ("max_iters", "lr", "min_lr", "warmup", "weight_decay", "beta2", "grad_clip",
                 "layer_decay", "grad_accum", "eval_interval", "log_interval", "probe_samples",
                 "time_limit", "compile")


def where_flags_apply(cfg, config, streamed, given):
    """{setting: (whether it does anything in this run, where it would)}: a row for every training
    setting (train.TrainConfig) and every model flag that only some runs read."""
    image, folder, training = config.is_image, cfg.dataset == "folder", not cfg.eval_only
    return {
        **dict.fromkeys(("mask_ratio", "decoder_depth", "decoder_width", "decoder_heads",
                         "norm_pix_loss"), (config.objective == "mae", "--objective mae")),
        "mlm_prob": (config.objective == "mlm", "--objective mlm"),
        **dict.fromkeys(("pool", "label_smoothing"),
                        (config.objective == "cls", "--objective cls")),
        **dict.fromkeys(("image_size", "patch_size", "channels", "num_classes", "train_samples"),
                        (image, "images")),
        **dict.fromkeys(("seq_len", "vocab_size", "tokenizer"), (not image, "text")),
        **dict.fromkeys(("train_file", "val_file"), (cfg.dataset == "text", "--dataset text")),
        "stream": (folder, "an image folder"),
        "memory_gb": (folder and "stream" not in given, "an image folder under --stream auto"),
        **dict.fromkeys(("crop_scale", "workers"), (streamed, "a streamed image folder")),
        **dict.fromkeys(TRAINING_ONLY, (training, "training, not --eval_only")),
        "base_lr": (training and "lr" not in given, "--lr -1 (peak rate base_lr x batch / 256)"),
        **dict.fromkeys(("preset", "dataset", "data_dir", "cache_dir", "batch_size", "eval_samples",
                         "out_dir", "overwrite", "seed", "device", "dtype", "threads", "resume",
                         "init_from", "eval_only"), (True, "every run")),
    }


def settings_lines(cfg, config, data, sources, device):
    """What streaming does, then every setting by where it came from; a note for each flag given
    that does nothing here, and for a CPU busy with other work."""
    lines, unused = [], {}
    cores = fast.cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0  # none on Windows
    if device.type == "cpu" and not cfg.threads and load > cores:  # threads then wait on each other
        lines.append(f"note: this CPU is busy (load {load:.1f} on {cores} cores): --threads 1 is "
                     "often faster then (docs/guide.md)")
    given, streamed = {k for k, v in sources.items() if v == "flags"}, isinstance(data, ImageStream)
    for name, (applies, where) in where_flags_apply(cfg, config, streamed, given).items():
        if name in given and not applies:
            unused.setdefault(where, []).append(f"--{name}")
        elif not applies:  # a setting this run does not read is not listed
            sources.pop(name, None)
    lines += [f"note: this run ignores {' '.join(names)} (read only for {where})"
              for where, names in unused.items()]
    if cfg.eval_only and not cfg.resume and not cfg.init_from:
        lines.append("note: --eval_only without --resume or --init_from scores freshly "
                     f"initialised weights; add --resume to score the run in {cfg.out_dir}")
    if config.is_image and cfg.train_samples > data.num_train():
        lines.append(f"note: --train_samples {cfg.train_samples} is more than the "
                     f"{data.num_train()} training images; the run takes those")
    if streamed:
        lines.append(f"streaming {data.num_train():,} training images from disk, {data.workers} "
                     f"decoding process{'es' * (data.workers != 1)} per rank: MAE's crops (area "
                     f"{cfg.crop_scale:g} to 1) and flips, ImageNet's mean and std")
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
    if cfg.warmup >= cfg.max_iters and not cfg.eval_only:
        lines.append(f"note: --warmup {cfg.warmup} is not shorter than --max_iters "
                     f"{cfg.max_iters}: the rate never reaches its peak and never decays")
    return lines


def settings_block(values, sources, width=100):
    """The settings a run uses, grouped by where each came from (flags, a resumed run, a preset or
    its recipe, the --init_from trunk, derived); the defaults are left to --help."""
    groups = {}
    for name, source in sources.items():
        if name in values:
            groups.setdefault(source, []).append(f"{name}={values[name]}")
    lines = [line for source, items in groups.items() for line in textwrap.wrap(
        " ".join(items), width, initial_indent=f"from {source}: ", subsequent_indent="    ",
        break_long_words=False, break_on_hyphens=False)]
    return lines + ["every other setting: its default, where this run reads it (train.py --help)"]
