"""probe.py's command line: checkpoints, fresh models (init:PRESET) and timm or Hugging Face models
(timm:NAME, hf:NAME) side by side on the same held-out samples; a table per model, JSON and a
figure. The metrics themselves are probe.py's.

Run: python probe.py out/ckpt.pt init:cifar-deep --labels trained,init --json p.json --plot p.png
"""
import argparse
import json

import torch

from bamboo import Bamboo
from data import IMAGE_DATASETS, TEXT_DATASETS, first_samples, held_out
from operations import checkpoint, fast, housekeeping
from probe import (LAYER_METRICS, TOKEN_METRICS, WEIGHT_METRICS, beta, probe_model, rounded)


# ----------------------------------------------------------------------------- models and data

def load_model(spec, dataset):
    """A checkpoint path, init:PRESET[,key=value,...] for a fresh model (seed 0, so equal specs
    are equal), or timm:NAME / hf:NAME[,key=value,...] for a foreign one (operations/adapters.py).
    """
    if spec.startswith(("timm:", "hf:")):  # a pretrained timm or Hugging Face transformer
        from operations import adapters

        model = adapters.load(spec)
        return model, {"tokenizer": model.tokenizer} if model.tokenizer else {}
    if not spec.startswith("init:"):
        model, ckpt = checkpoint.model_from_checkpoint(spec)
        return model.eval(), checkpoint.data_settings(ckpt)
    config = housekeeping.config_from_spec(spec[len("init:"):],
                                           objective="cls" if dataset in IMAGE_DATASETS else "next")
    torch.manual_seed(0)
    return Bamboo(config).eval(), {}


def load_samples(args, model, train_cfg):
    """The first args.samples held-out samples, in order, un-augmented, as one (N, ...) tensor."""
    text = not model.config.is_image and args.dataset not in IMAGE_DATASETS  # else: one line below
    if text and not (args.tokenizer or train_cfg.get("tokenizer")):
        named = getattr(model, "spec", "a fresh model (init:)")  # a foreign model knows its spec
        raise ValueError(f"{named} has no tokenizer of its own (random weights); pass --tokenizer: "
                         "a tiktoken encoding, bytes, or hf:NAME")
    data = held_out(model.config, train_cfg, args.dataset, args.data_dir, args.tokenizer,
                    args.val_file)
    samples = first_samples(data, args.samples)
    if model.config.is_image and hasattr(model, "normalize"):  # a foreign model's own statistics
        samples = model.normalize(samples * data.std + data.mean)
    return samples


def samples_key(model, train_cfg):
    """What load_samples' result depends on besides the command line: models that agree on it
    (checkpoints of one run, say) share one decoding; each model keeps its own normalisation."""
    c, statistics = model.config, train_cfg.get("statistics")
    own = repr(getattr(model, "statistics", None))  # a foreign model's own normalisation
    return (c.is_image, c.image_size, c.seq_len, c.vocab_size, own,
            None if statistics is None else repr([s.tolist() for s in statistics]),
            *(train_cfg.get(k) for k in ("dataset", "data_dir", "stream", "tokenizer", "val_file",
                                         "cache_dir")))


# ----------------------------------------------------------------------------- report

def pad(values, length):
    return list(values) + [None] * (length - len(values))


TABLE_BLOCKS = (TOKEN_METRICS, LAYER_METRICS + WEIGHT_METRICS)  # each block under 100 columns


def print_table(report):
    """Per checkpoint, one table per block of metrics, layers as rows."""
    for label in report["labels"]:
        depth = report["depth"][label]
        print(f"\n{label}  ({report['source'][label]})")
        for names in TABLE_BLOCKS:
            widths = [max(12, len(n)) for n in names]
            print("layer " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
            for layer in range(depth + 1):
                cells = [report["metrics"][n][label][layer] for n in names]
                print(f"{layer:>5} " + " ".join(f"{'-':>{w}}" if c is None else f"{c:>{w}.4f}"
                                                for c, w in zip(cells, widths)))
        print(f"attn_entropy of uniform attention, its ceiling here: "
              f"{report['attn_entropy_ceiling'][label]:.4f} nats")
    print(f"\nbeta_qk and beta_v are each checkpoint's over those of {report['labels'][0]}.")


def absent_metrics(model, raw, reference):
    """{metric: why} for the metrics this model cannot have; their values are left out (None)."""
    absent = dict(getattr(model, "absent", {}))  # a foreign model says what it cannot have
    for name in absent:
        raw[name] = [None] * (model.config.depth + 1)
    if not raw["beta_qk"]:
        for name in ("beta_qk", "beta_v"):
            absent[name] = f"not the shape of {reference}, the reference: the layers do not pair up"
    return absent


def run(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    labels = args.labels.split(",") if args.labels else list(args.checkpoints)
    if len(labels) != len(args.checkpoints) or len(set(labels)) != len(labels):
        raise ValueError(f"--labels needs {len(args.checkpoints)} distinct "
                         f"names, one per checkpoint")
    report = {"labels": labels, "layers": [], "samples": args.samples, "depth": {}, "source": {},
              "metrics": {}, "absent": {}, "attn_entropy_ceiling": {}}
    reference, raw, sample_sets = None, {}, {}
    for i, (label, spec) in enumerate(zip(labels, args.checkpoints), 1):
        print(f"probing {label} ({i} of {len(labels)}) ...", flush=True)
        model, train_cfg = load_model(spec, args.dataset or "cifar10")
        model.to(fast.pick_device(args.device, 0))
        # decode or tokenize each dataset once for every model that sees it alike
        key = samples_key(model, train_cfg)
        if key not in sample_sets:
            sample_sets[key] = load_samples(args, model, train_cfg)
        raw[label] = probe_model(model, sample_sets[key], args.batch_size, args.mask)
        if reference is None:
            reference = model
        raw[label]["beta_qk"], raw[label]["beta_v"] = (
            [None] + values if values is not None else [] for values in beta(model, reference))
        report["absent"][label] = absent_metrics(model, raw[label], labels[0])
        report["depth"][label] = model.config.depth
        report["attn_entropy_ceiling"][label] = round(raw[label].pop("attn_entropy_ceiling")[-1], 6)
        report["source"][label] = spec
    probed = min(len(s) for s in sample_sets.values())
    if probed < args.samples:
        print(f"note: the held-out split has {probed} samples; probed {probed}, not {args.samples}")
    report["samples"] = probed  # what was run, not what was asked
    layers = max(report["depth"].values()) + 1
    report["layers"] = list(range(layers))
    order = TOKEN_METRICS + LAYER_METRICS + WEIGHT_METRICS
    report["metrics"] = {name: {label: rounded(pad(raw[label][name], layers)) for label in labels}
                         for name in order}
    print_table(report)
    if args.json:
        checkpoint.atomic_write(args.json, lambda f: f.write(json.dumps(report, indent=1).encode()))
    if args.plot:
        import look  # the pictures live there

        checkpoint.save_figure(look.probe_figure(report, args.relative), args.plot)
    return report


def build_parser():
    p = argparse.ArgumentParser(description="Measure over-smoothing layer by layer.",
                                allow_abbrev=False)
    add = p.add_argument
    add("checkpoints", nargs="+",
        help="checkpoint paths, or init:PRESET[,key=value,...] for a fresh model")
    add("--labels", default="",
        help="comma-separated names for the checkpoints (default: their paths)")
    add("--dataset", default="", choices=("",) + IMAGE_DATASETS + TEXT_DATASETS,
        help="data to probe with (default: each checkpoint's own training data)")
    add("--data_dir", default="", help="where the dataset lives (default: the checkpoint's)")
    add("--tokenizer", default="",
        help="text: tiktoken encoding, bytes or hf:NAME (default: the checkpoint's or model's)")
    add("--val_file", default="",
        help="--dataset text: held-out file in data_dir (default: the checkpoint's, or val.txt)")
    add("--samples", type=int, default=256,
        help="held-out samples, the first N in order (default: 256)")
    add("--batch_size", type=int, default=32, help="samples per forward pass (default: 32)")
    add("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default: cpu)")
    add("--threads", type=int, default=0,
        help="CPU threads; 0: torch's default (1 on a CPU shared with other work)")
    add("--mask", action="store_true", help="probe MAE's visible patches only, as in pre-training")
    add("--relative", action="store_true", help="plot against relative depth (layer / depth)")
    add("--json", default="", help="write the numbers here")
    add("--plot", default="", help="write a PNG with one panel per metric here")
    return p


def check_args(args):
    """One line for the first bad argument, before any model is loaded."""
    if args.samples < 2 or args.batch_size < 1 or args.threads < 0:
        raise ValueError("--samples must be at least 2, --batch_size at least 1, --threads >= 0")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            checkpoint.check_output_path(flag, path)


def main(argv=None):
    args = build_parser().parse_args(argv)
    with housekeeping.one_line_errors() as outcome:  # a user's mistake: one line
        check_args(args)
        run(args)
    return outcome.code
