"""Experiment 1's numbers and figure from the checkpoints results/e1.sh wrote (out/e1/s<seed>/{cls,mae,ft}).

Per seed: checks that the cls and mae arms started from bit-identical trunks; scores every test image
with cls and with the fine-tuned MAE (accuracy, and McNemar's exact test on the paired per-image
outcomes); probes cls, fine-tuned MAE and the pre-trained encoder (all patches, and with --mask its
visible ones) on the first 256 test images; beta of the MAE checkpoints against cls. Then mean and std
over seeds, and of the same-seed differences (accuracy, late centred cosine, last-layer std), written to
results/e1/e1.json, and a figure with one band per arm. Each seed's numbers are also kept in
<out>/seed<N>.json, so seeds trained in separate sessions (the GPU runs) join one summary: a seed whose
checkpoints are gone is read back from there, and --read_back reads every seed from there.

Run: python results/e1_analyze.py [DATA]     (DATA defaults to ../shared/data)
     python results/e1_analyze.py DATA --runs /tmp/e1g --out results/e1-gpu --image_size 32 --train_samples 4000 \
         --device cuda --title "..."      (the GPU runs of results/e1_gpu.sh)
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
                      mcnemar_p, mean_std, median, paired_summary, plot_bands, probe_images, same_init, seed_bands)

SEEDS = (0, 1, 2)
METRICS = ("abs_cos_centered", "std", "cos", "erank", "hc_dc", "update", "attn_entropy")
ARMS = {"cls": "cls from scratch", "ft": "MAE fine-tuned", "mae": "MAE encoder, all patches",
        "mae_mask": "MAE encoder, visible patches (--mask)"}


@torch.no_grad()
def analyze_seed(seed, runs, data_dir, test_data):
    out = os.path.join(runs, f"s{seed}")
    models = {arm: finished_run(os.path.join(out, arm, "ckpt.pt")) for arm in ("cls", "mae", "ft")}
    for model, _ in models.values():
        model.to(test_data.test_x.device)
    configs = (models["cls"][1]["config"], models["mae"][1]["config"])
    result = {"same_init": same_init(configs, seed, ("patch_embed", "blocks."))[0]}
    right = {arm: correct_per_image(models[arm][0], test_data) for arm in ("cls", "ft")}
    result["top1"] = {arm: 100 * r.double().mean().item() for arm, r in right.items()}
    result["mcnemar_p"] = mcnemar_p(right["cls"], right["ft"])
    samples = probe_images(data_dir, models["cls"][0])
    result["probe"] = {arm: probe.probe_model(models[arm.split("_")[0]][0].eval(), samples, 64, mask=arm == "mae_mask")
                       for arm in ARMS}
    result["beta"] = {arm: dict(zip(("qk", "v"), probe.beta(models[arm][0], models["cls"][0])))
                      for arm in ("mae", "ft")}
    return result


def centred_cos(seed_result, arm):
    """One seed's abs_cos_centered of arm per layer (entry 0 is the stem)."""
    return seed_result["probe"][arm]["abs_cos_centered"]


def late_cos_gap(seed_result):
    """Centred (absolute) cosine, cls minus fine-tuned MAE, averaged over the second half of the blocks."""
    cls, ft = centred_cos(seed_result, "cls"), centred_cos(seed_result, "ft")
    late = range(len(cls) // 2 + 1, len(cls))  # blocks depth/2 + 1 to depth: 13 to 24 of 24
    return sum(cls[i] - ft[i] for i in late) / len(late)


PAIRED = {  # the same-seed differences that results/README.md's paired comparisons cite
    "top1_ft_minus_cls": lambda s: s["top1"]["ft"] - s["top1"]["cls"],
    "abs_cos_centered_late_cls_minus_ft": late_cos_gap,
    "abs_cos_centered_rise_cls": lambda s: centred_cos(s, "cls")[-1] - centred_cos(s, "cls")[0],
    "std_last_ft_minus_cls": lambda s: s["probe"]["ft"]["std"][-1] - s["probe"]["cls"]["std"][-1],
}


def paired(per_seed):
    """Each PAIRED difference per seed, then across seeds: its mean with the 95% t-interval, the sign
    test (analysis.paired_summary: the primary result), and mean_std as before."""
    rows = {name: [difference(s) for s in per_seed.values()] for name, difference in PAIRED.items()}
    return {name: {**paired_summary(row), "mean_std": mean_std(row)} for name, row in rows.items()}


def summarize(per_seed):
    summary = {"same_init": all(s["same_init"] for s in per_seed.values()),
               "top1": {arm: mean_std([s["top1"][arm] for s in per_seed.values()]) for arm in ("cls", "ft")},
               "mcnemar_p": {seed: s["mcnemar_p"] for seed, s in per_seed.items()}, "paired": paired(per_seed),
               "probe": {}, "beta": {}}
    for arm in ARMS:
        summary["probe"][arm] = seed_bands([s["probe"][arm] for s in per_seed.values()], METRICS)
    for arm in ("mae", "ft"):
        for part in ("qk", "v"):
            rows = [s["beta"][arm][part] for s in per_seed.values()]
            summary["beta"][f"{arm}_{part}"] = {
                "above_1": [sum(v > 1 for v in row) for row in rows], "layers": len(rows[0]),
                "median": [median(row) for row in rows]}
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Experiment 1's numbers and figure from its checkpoints.")
    p.add_argument("data", nargs="?", default="", help="folder holding cifar10-jpeg/ (default ../shared/data)")
    p.add_argument("--runs", default=os.path.join(ROOT, "out", "e1"), help="folder of s<seed>/{cls,mae,ft}/ckpt.pt")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "e1"), help="where e1.json, e1.png go")
    p.add_argument("--image_size", type=int, default=16, help="the runs' image size")
    p.add_argument("--train_samples", type=int, default=5000, help="the runs' training subset (its statistics)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--device", default="cpu", help="where the models score the test set")
    p.add_argument("--read_back", action="store_true",
                   help="summarise from <out>/seed<N>.json only, even where the checkpoints are still there")
    p.add_argument("--title", default="Experiment 1: cls from scratch against MAE, 24x64, 16x16 CIFAR-10, "
                                      "mean ± std over 3 seeds")
    return p.parse_args(argv)


def seed_result(seed, args, data_dir, test_data):
    """This seed's numbers: measured when its checkpoints exist (and kept), else read back from an earlier run."""
    path = os.path.join(args.out, f"seed{seed}.json")
    if not args.read_back and os.path.exists(os.path.join(args.runs, f"s{seed}", "ft", "ckpt.pt")):
        result = analyze_seed(seed, args.runs, data_dir, test_data)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        return result
    if not os.path.exists(path):
        raise AnalysisError(f"seed {seed}: no checkpoints under {args.runs}/s{seed} and no {path}; "
                            "train it first")
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    data_dir, test_data = ((None, None) if args.read_back else
                           experiment_data([None, args.data], args.image_size, args.train_samples, args.device))
    per_seed = {seed: seed_result(seed, args, data_dir, test_data) for seed in args.seeds}
    summary = summarize(per_seed)
    name = os.path.basename(os.path.normpath(args.out))
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary}, f, indent=1)
    plot_bands(summary["probe"], ARMS, METRICS, args.title, os.path.join(args.out, f"{name}.png"))
    print(json.dumps({k: summary[k] for k in ("same_init", "top1", "mcnemar_p", "beta")}, indent=1))
    for arm in ARMS:
        print(arm, last_layer(summary["probe"][arm]))
    for name, d in summary["paired"].items():
        print(f"{name}: {' '.join(f'{v:+.3f}' for v in d['per_seed'])} -> {d['mean']:+.3f}, 95% "
              f"interval [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}], sign test p {d['sign_test_p']:.3g}")


if __name__ == "__main__":
    command_line(main)
