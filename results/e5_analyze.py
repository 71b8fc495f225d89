"""Experiment 5's numbers and figure from the checkpoints results/e5.sh wrote (out/e5/s<seed>/{free,smooth,sharpen}).

Per seed: test accuracy of each arm on all 10,000 test images, McNemar's exact test of smooth against
sharpen on the paired per-image outcomes, the probe of each arm on the first 256 test images (with the
W_V W_O spectra), and whether the three arms' stems started identical. Mean and std over seeds go to
results/e5/e5.json and a figure with one band per arm.

Run: python results/e5_analyze.py [DATA]     (DATA defaults to ../shared/data)
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe  # noqa: E402
from analysis import (finished_run, command_line, correct_per_image, experiment_data, last_layer, mcnemar_p, mean_std,  # noqa: E402
                      plot_bands, probe_images, same_init, seed_bands)

SEEDS = (0, 1, 2)
ARMS = {"free": "free W_V W_O", "smooth": "smooth (every eigenvalue > 0)", "sharpen": "sharpen (in [-1, 0))"}
METRICS = ("cos", "abs_cos_centered", "hc_dc", "erank", "std", "update", "attn_entropy", "vo_positive")


def analyze_seed(seed, data_dir, test_data):
    out = os.path.join(ROOT, "out", "e5", f"s{seed}")
    models = {arm: finished_run(os.path.join(out, arm, "ckpt.pt")) for arm in ARMS}
    right = {arm: correct_per_image(models[arm][0], test_data) for arm in ARMS}
    samples = probe_images(data_dir, models["free"][0])
    return {"same_stem": same_init([m[1]["config"] for m in models.values()], seed, ("patch_embed", "pos_embed"))[0],
            "top1": {arm: 100 * r.double().mean().item() for arm, r in right.items()},
            "mcnemar_p_smooth_sharpen": mcnemar_p(right["smooth"], right["sharpen"]),
            "probe": {arm: probe.probe_model(models[arm][0].eval(), samples, 64) for arm in ARMS}}


def main():
    data_dir, test_data = experiment_data(sys.argv)
    per_seed = {seed: analyze_seed(seed, data_dir, test_data) for seed in SEEDS}
    summary = {"same_stem": all(s["same_stem"] for s in per_seed.values()),
               "top1": {arm: mean_std([s["top1"][arm] for s in per_seed.values()]) for arm in ARMS},
               "mcnemar_p_smooth_sharpen": {seed: s["mcnemar_p_smooth_sharpen"] for seed, s in per_seed.items()},
               "probe": {arm: seed_bands([s["probe"][arm] for s in per_seed.values()], METRICS) for arm in ARMS}}
    folder = os.path.join(ROOT, "results", "e5")
    with open(os.path.join(folder, "e5.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary}, f, indent=1)
    plot_bands(summary["probe"], ARMS, METRICS, "Experiment 5: smooth against sharpen against free W_V W_O, "
               "24x64, 16x16 CIFAR-10, 1,000 steps, mean ± std over 3 seeds", os.path.join(folder, "e5.png"))
    print(json.dumps({k: summary[k] for k in ("same_stem", "top1", "mcnemar_p_smooth_sharpen")}, indent=1))
    for arm in ARMS:
        print(arm, last_layer(summary["probe"][arm]))


if __name__ == "__main__":
    command_line(main)
