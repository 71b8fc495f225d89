"""Experiment 2's numbers and figures from the checkpoints results/e1.sh and results/e2.sh wrote.

Vision, per seed: softmax (experiment 1's cls run, out/e1/s<seed>/cls) against NeuTRENO lambda 0.6
(out/e2/s<seed>/vision-neutreno): whether both started from identical weights, test top-1 on all 10,000
test images with McNemar's exact test, and the probe at init and after training on the first 256 test images.
Text, per seed: next-token softmax against lambda 0.4 (out/e2/s<seed>/next-{0,0.4}): the same checks, test
perplexity on the first 1,024 windows of test.txt with a sign test over the paired per-window losses, and the
probe at init and trained on the first 256 windows. Mean ± std over seeds go to results/e2/e2.json and two
figures with one band per arm.

Run: python results/e2_analyze.py [DATA]     (DATA defaults to ../shared/data)
"""
import argparse
import json
import math
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (finished_run, ROOT, command_line, correct_per_image, experiment_data, initial_model, last_layer,  # noqa: E402
                      mcnemar_p, mean_std, plot_bands, probe_images, same_init, seed_bands, sign_test_p,
                      token_predictions)

sys.path.insert(0, ROOT)
import probe  # noqa: E402

SEEDS = (0, 1, 2)
METRICS = ("cos", "abs_cos_centered", "hc_dc", "erank", "std", "update", "attn_entropy")
VISION = {"softmax": "e1/s{seed}/cls", "neutreno": "e2/s{seed}/vision-neutreno"}
TEXT = {"softmax": "e2/s{seed}/next-0", "neutreno": "e2/s{seed}/next-0.4"}
LABELS = {"softmax_init": "softmax, at init", "neutreno_init": "NeuTRENO, at init",
          "softmax": "softmax, trained", "neutreno": "NeuTRENO, trained"}
TEXT_WINDOWS = 1024


def load_arms(arms, seed):
    return {arm: finished_run(os.path.join(ROOT, "out", path.format(seed=seed), "ckpt.pt"))
            for arm, path in arms.items()}


def probe_arms(models, seed, samples):
    """The probe of both arms trained, and of the weights each started from."""
    result = {}
    for arm, (model, ckpt) in models.items():
        result[arm] = probe.probe_model(model.eval(), samples, 64)
        result[f"{arm}_init"] = probe.probe_model(initial_model(ckpt["config"], seed), samples, 64)
    return result


def window_losses(model, windows):
    """Mean next-token cross-entropy of every window (N,), in nats."""
    return token_predictions(model, windows)[0].view(len(windows), -1).mean(1)


def analyze_vision(seed, data_dir, test_data):
    models = load_arms(VISION, seed)
    right = {arm: correct_per_image(m, test_data) for arm, (m, _) in models.items()}
    samples = probe_images(data_dir, models["softmax"][0])
    return {"same_init": same_init([c["config"] for _, c in models.values()], seed, ("",)),
            "top1": {arm: 100 * r.double().mean().item() for arm, r in right.items()},
            "mcnemar_p": mcnemar_p(right["neutreno"], right["softmax"]),
            "probe": probe_arms(models, seed, samples)}


def analyze_text(seed, data_dir):
    models = load_arms(TEXT, seed)
    args = argparse.Namespace(dataset="text", data_dir=os.path.join(data_dir, "wikitext-2"), samples=TEXT_WINDOWS,
                              tokenizer="r50k_base", val_file="test.txt")
    windows = probe.load_samples(args, models["softmax"][0], models["softmax"][1]["train"])
    losses = {arm: window_losses(m, windows) for arm, (m, _) in models.items()}
    return {"same_init": same_init([c["config"] for _, c in models.values()], seed, ("",)),
            "ppl": {arm: math.exp(v.mean().item()) for arm, v in losses.items()},
            "windows_better": int((losses["neutreno"] < losses["softmax"]).sum()),
            "sign_test_p": sign_test_p(int((losses["neutreno"] < losses["softmax"]).sum()),
                                       int((losses["neutreno"] > losses["softmax"]).sum())),
            "probe": probe_arms(models, seed, windows[:256])}


def summarize(per_seed, score):
    runs = list(per_seed.values())
    return {"same_init": all(r["same_init"][0] for r in runs),
            score: {arm: mean_std([r[score][arm] for r in runs]) for arm in ("softmax", "neutreno")},
            "p": [r.get("mcnemar_p", r.get("sign_test_p")) for r in runs],
            "probe": {arm: seed_bands([r["probe"][arm] for r in runs], METRICS) for arm in LABELS}}


def main():
    data_dir, test_data = experiment_data(sys.argv)
    data_root = os.path.dirname(data_dir)
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(data_root, "tiktoken")  # GPT-2's BPE ranks, offline
    vision = {seed: analyze_vision(seed, data_dir, test_data) for seed in SEEDS}
    text = {seed: analyze_text(seed, data_root) for seed in SEEDS}
    summary = {"vision": summarize(vision, "top1"), "text": summarize(text, "ppl")}
    folder = os.path.join(ROOT, "results", "e2")
    with open(os.path.join(folder, "e2.json"), "w") as f:
        json.dump({"per_seed": {"vision": vision, "text": text}, "summary": summary}, f, indent=1)
    plot_bands(summary["vision"]["probe"], LABELS, METRICS, "Experiment 2, vision: softmax against NeuTRENO "
               "(lambda 0.6), 24x64, 16x16 CIFAR-10, 2,000 steps, mean ± std over 3 seeds",
               os.path.join(folder, "e2-vision.png"))
    plot_bands(summary["text"]["probe"], LABELS, METRICS, "Experiment 2, text: softmax against NeuTRENO "
               "(lambda 0.4), 24x128 next-token, WikiText-2, 400 steps, mean ± std over 3 seeds",
               os.path.join(folder, "e2-text.png"))
    for part in ("vision", "text"):
        print(part, json.dumps({k: v for k, v in summary[part].items() if k != "probe"}))
        for arm in LABELS:
            print(" ", arm, last_layer(summary[part]["probe"][arm]))


if __name__ == "__main__":
    command_line(main)
