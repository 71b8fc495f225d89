"""Experiment 4's numbers from the checkpoints results/e4.sh wrote (out/e4/s<seed>/<depth>x<width>/{cls,mae,ft}).

Per seed and trunk: checks that the cls and mae arms started from bit-identical trunks, scores every test
image with cls from scratch and with the fine-tuned MAE (accuracy, McNemar's exact test on the paired
per-image outcomes), and probes both on the first 256 test images. Then mean ± std over seeds per trunk, written
to <out>/<name of out>.json, and a figure of the probes against relative depth with one band per trunk and arm.

Run: python results/e4_analyze.py [DATA]     (DATA defaults to ../shared/data)
     python results/e4_analyze.py --runs out/e4-x3 --out results/e4-x3 --trunks 6x128 12x92 24x64   (after BUDGET=3)
     python results/e4_analyze.py --runs out/e4-n20000 --out results/e4-n20000 --trunks 24x64 --train_samples 20000
     python results/e4_analyze.py --runs out/e4-i32 --out results/e4-i32 --trunks 24x64 --image_size 32
     python results/e4_analyze.py --runs out/e4-w2 --out results/e4-w2 --trunks 24x128   (after WIDEN=2 TRUNKS=24x64)
     python results/e4_analyze.py --runs out/e4-ft1500 --out results/e4-ft1500 --trunks 24x64   (after FT_STEPS=1500)
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import probe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis import (finished_run, AnalysisError, command_line, correct_per_image, experiment_data, last_layer,  # noqa: E402
                      mcnemar_p, mean_std, plot_bands, probe_images, same_init, seed_bands)

SEEDS = (0, 1, 2)
TRUNKS = ("6x128", "12x92", "24x64")
METRICS = ("abs_cos_centered", "cos", "erank", "std", "update", "attn_entropy")


@torch.no_grad()
def analyze(runs, seed, trunk, test_data, samples):
    out = os.path.join(runs, f"s{seed}", trunk)
    models = {arm: finished_run(os.path.join(out, arm, "ckpt.pt")) for arm in ("cls", "mae", "ft")}
    right = {arm: correct_per_image(models[arm][0], test_data) for arm in ("cls", "ft")}
    configs = (models["cls"][1]["config"], models["mae"][1]["config"])
    return {"same_init": same_init(configs, seed, ("patch_embed", "blocks."))[0],
            "top1": {arm: 100 * r.double().mean().item() for arm, r in right.items()},
            "mcnemar_p": mcnemar_p(right["cls"], right["ft"]),
            "probe": {arm: probe.probe_model(models[arm][0].eval(), samples, 64) for arm in ("cls", "ft")}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Experiment 4's numbers and figure from its checkpoints.")
    p.add_argument("data", nargs="?", default="", help="folder holding cifar10-jpeg/ (default ../shared/data)")
    p.add_argument("--runs", default=os.path.join(ROOT, "out", "e4"), help="folder of s<seed>/<trunk>/{cls,mae,ft}")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "e4"), help="where <name>.json and .png go")
    p.add_argument("--trunks", nargs="+", default=list(TRUNKS), help="the trunks to analyse, as depth x width")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--image_size", type=int, default=16, help="the runs' image size")
    p.add_argument("--train_samples", type=int, default=5000, help="the runs' training subset (its statistics)")
    p.add_argument("--title", default="Experiment 4: three trunks of equal FLOPs, cls from scratch against MAE + "
                                      "fine-tuning, mean ± std over 3 seeds")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    data_dir, test_data = experiment_data([None, args.data], args.image_size, args.train_samples)
    paths = [os.path.join(args.runs, f"s{seed}", trunk, arm, "ckpt.pt")
             for seed in args.seeds for trunk in args.trunks for arm in ("cls", "mae", "ft")]
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        raise AnalysisError(f"{len(missing)} of {len(paths)} checkpoints missing, the first {missing[0]}; "
                            "run results/e4.sh first")
    samples = probe_images(data_dir, finished_run(paths[0])[0])
    per_seed = {trunk: {seed: analyze(args.runs, seed, trunk, test_data, samples) for seed in args.seeds}
                for trunk in args.trunks}
    summary, bands = {}, {}
    for trunk, runs in per_seed.items():
        summary[trunk] = {"same_init": all(r["same_init"] for r in runs.values()),
                          "mcnemar_p": [r["mcnemar_p"] for r in runs.values()],
                          "ft_minus_cls": mean_std([r["top1"]["ft"] - r["top1"]["cls"] for r in runs.values()])}
        summary[trunk].update({arm: mean_std([r["top1"][arm] for r in runs.values()]) for arm in ("cls", "ft")})
        for arm in ("cls", "ft"):
            bands[f"{trunk} {arm}"] = seed_bands([r["probe"][arm] for r in runs.values()], METRICS)
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(os.path.normpath(args.out))
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary, "probe": bands}, f, indent=1)
    labels = {arm: arm.replace(" ft", ", MAE + fine-tuning").replace(" cls", ", cls") for arm in bands}
    plot_bands(bands, labels, METRICS, args.title, os.path.join(args.out, f"{name}.png"), relative=True)
    for trunk, s in summary.items():
        print(f"{trunk}: cls {s['cls'][0]:.2f} ± {s['cls'][1]:.2f}, MAE+ft {s['ft'][0]:.2f} ± {s['ft'][1]:.2f}, "
              f"ft - cls {s['ft_minus_cls'][0]:+.2f} ± {s['ft_minus_cls'][1]:.2f}, same init {s['same_init']}, "
              f"McNemar p per seed (descriptive) {', '.join(f'{p:.2g}' for p in s['mcnemar_p'])}")
        for arm in ("cls", "ft"):
            print(f"  {arm} last layer", last_layer(bands[f"{trunk} {arm}"]))


if __name__ == "__main__":
    command_line(main)
