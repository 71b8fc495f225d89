"""Experiment 4's numbers from the checkpoints results/e4.sh wrote (out/e4/s<seed>/<depth>x<width>/{cls,mae,ft}).

Per seed and trunk: checks that the cls and mae arms started from bit-identical trunks, scores every test
image with cls from scratch and with the fine-tuned MAE (accuracy, McNemar's exact test on the paired
per-image outcomes), and probes both on the first 256 test images. Then mean ± std over seeds per trunk, written
to results/e4/e4.json, and a figure of the probes against relative depth with one band per trunk and arm.

Run: python results/e4_analyze.py [DATA]     (DATA defaults to ../shared/data)
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
from analysis import (command_line, correct_per_image, experiment_data, mcnemar_p, mean_std, plot_bands,  # noqa: E402
                      probe_images, same_init, seed_bands)

SEEDS = (0, 1, 2)
TRUNKS = ("6x128", "12x92", "24x64")
METRICS = ("abs_cos_centered", "cos", "erank", "std", "update", "attn_entropy")


@torch.no_grad()
def analyze(seed, trunk, test_data, samples):
    out = os.path.join(ROOT, "out", "e4", f"s{seed}", trunk)
    models = {arm: model_from_checkpoint(os.path.join(out, arm, "ckpt.pt")) for arm in ("cls", "mae", "ft")}
    right = {arm: correct_per_image(models[arm][0], test_data) for arm in ("cls", "ft")}
    configs = (models["cls"][1]["config"], models["mae"][1]["config"])
    return {"same_init": same_init(configs, seed, ("patch_embed", "blocks."))[0],
            "top1": {arm: 100 * r.double().mean().item() for arm, r in right.items()},
            "mcnemar_p": mcnemar_p(right["cls"], right["ft"]),
            "probe": {arm: probe.probe_model(models[arm][0].eval(), samples, 64) for arm in ("cls", "ft")}}


def main():
    data_dir, test_data = experiment_data(sys.argv)
    samples = probe_images(data_dir, model_from_checkpoint(os.path.join(ROOT, "out", "e4", "s0", TRUNKS[0], "cls",
                                                                        "ckpt.pt"))[0])
    per_seed = {trunk: {seed: analyze(seed, trunk, test_data, samples) for seed in SEEDS} for trunk in TRUNKS}
    summary, bands = {}, {}
    for trunk, runs in per_seed.items():
        summary[trunk] = {"same_init": all(r["same_init"] for r in runs.values()),
                          "mcnemar_p": [r["mcnemar_p"] for r in runs.values()],
                          "ft_minus_cls": mean_std([r["top1"]["ft"] - r["top1"]["cls"] for r in runs.values()])}
        summary[trunk].update({arm: mean_std([r["top1"][arm] for r in runs.values()]) for arm in ("cls", "ft")})
        for arm in ("cls", "ft"):
            bands[f"{trunk} {arm}"] = seed_bands([r["probe"][arm] for r in runs.values()], METRICS)
    with open(os.path.join(ROOT, "results", "e4", "e4.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary, "probe": bands}, f, indent=1)
    labels = {name: name.replace(" ft", ", MAE + fine-tuning").replace(" cls", ", cls") for name in bands}
    plot_bands(bands, labels, METRICS, "Experiment 4: three trunks of equal FLOPs, cls from scratch against MAE + "
               "fine-tuning, mean ± std over 3 seeds", os.path.join(ROOT, "results", "e4", "e4.png"), relative=True)
    for trunk, s in summary.items():
        print(f"{trunk}: cls {s['cls'][0]:.2f} ± {s['cls'][1]:.2f}, MAE+ft {s['ft'][0]:.2f} ± {s['ft'][1]:.2f}, "
              f"ft - cls {s['ft_minus_cls'][0]:+.2f} ± {s['ft_minus_cls'][1]:.2f}, same init {s['same_init']}, "
              f"McNemar p {', '.join(f'{p:.2g}' for p in s['mcnemar_p'])}")


if __name__ == "__main__":
    command_line(main)
