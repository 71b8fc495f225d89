"""Experiment 1's numbers and figure from the checkpoints results/e1.sh wrote (out/e1/s<seed>/{cls,mae,ft}).

Per seed: checks that the cls and mae arms started from bit-identical trunks; scores every test image
with cls and with the fine-tuned MAE (accuracy, and McNemar's exact test on the paired per-image
outcomes); probes cls, fine-tuned MAE and the pre-trained encoder (all patches, and with --mask its
visible ones) on the first 256 test images; beta of the MAE checkpoints against cls. Then mean and std
over seeds, written to results/e1/e1.json and e1.md, and a figure with one band per arm.

Run: python results/e1_analyze.py [DATA]     (DATA defaults to ../shared/data)
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import probe  # noqa: E402
from train import model_from_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis import (correct_per_image, experiment_data, last_layer, mcnemar_p, mean_std, plot_bands,  # noqa: E402
                      probe_images, same_init, seed_bands)

SEEDS = (0, 1, 2)
METRICS = ("abs_cos_centered", "std", "cos", "erank", "hc_dc", "update", "attn_entropy")
ARMS = {"cls": "cls from scratch", "ft": "MAE fine-tuned", "mae": "MAE encoder, all patches",
        "mae_mask": "MAE encoder, visible patches (--mask)"}


@torch.no_grad()
def analyze_seed(seed, data_dir, test_data):
    out = os.path.join(ROOT, "out", "e1", f"s{seed}")
    models = {arm: model_from_checkpoint(os.path.join(out, arm, "ckpt.pt")) for arm in ("cls", "mae", "ft")}
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


def summarize(per_seed):
    summary = {"same_init": all(s["same_init"] for s in per_seed.values()),
               "top1": {arm: mean_std([s["top1"][arm] for s in per_seed.values()]) for arm in ("cls", "ft")},
               "mcnemar_p": {seed: s["mcnemar_p"] for seed, s in per_seed.items()}, "probe": {}, "beta": {}}
    for arm in ARMS:
        summary["probe"][arm] = seed_bands([s["probe"][arm] for s in per_seed.values()], METRICS)
    for arm in ("mae", "ft"):
        for part in ("qk", "v"):
            rows = [s["beta"][arm][part] for s in per_seed.values()]
            summary["beta"][f"{arm}_{part}"] = {
                "above_1": [sum(v > 1 for v in row) for row in rows], "layers": len(rows[0]),
                "median": [sorted(row)[len(row) // 2] for row in rows]}
    return summary


def plot(summary, path):
    title = "Experiment 1: cls from scratch against MAE, 24x64, 16x16 CIFAR-10, mean ± std over 3 seeds"
    plot_bands(summary["probe"], ARMS, METRICS, title, path)


def main():
    data_dir, test_data = experiment_data(sys.argv)
    per_seed = {seed: analyze_seed(seed, data_dir, test_data) for seed in SEEDS}
    summary = summarize(per_seed)
    folder = os.path.join(ROOT, "results", "e1")
    with open(os.path.join(folder, "e1.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary}, f, indent=1)
    plot(summary, os.path.join(folder, "e1.png"))
    print(json.dumps({k: summary[k] for k in ("same_init", "top1", "mcnemar_p", "beta")}, indent=1))
    for arm in ARMS:
        print(arm, last_layer(summary["probe"][arm]))


if __name__ == "__main__":
    main()
