"""Shared by the experiment analyses: their test images, per-image scoring, McNemar's exact test, mean ± std,
figures with bands.

Run: python results/e1_analyze.py   (this module has no command of its own)
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bamboo import TRUNK  # noqa: E402 (the stem and the blocks, as runs hash them)


class AnalysisError(Exception):
    """A run or a record the analysis needs is missing: said in one line, never as a traceback."""


def command_line(main):
    """Run an analysis's main() as a command: a failure it can explain (missing data, runs or records, a bad
    checkpoint, an output it cannot write) is one line on stderr and exit code 2, as train.py and probe.py do."""
    sys.path.insert(0, ROOT)
    from operations.files import DataError
    from operations.checkpoint import CheckpointError

    try:
        main()
    except (AnalysisError, DataError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def keep_report(folder, name, result, text):
    """An analysis's outputs: NAME.json (the numbers) and NAME.txt (what it prints) in folder."""
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(folder, f"{name}.txt"), "w") as f:
        f.write(text + "\n")
    print(text)


def experiment_data(argv, image_size=16, train_samples=5000, device="cpu"):
    """(CIFAR-10 folder, its test split on device) as the experiments trained on it: by default the CPU
    experiments' 16x16 images, normalised as training's evaluation normalised them (statistics of the fixed
    5,000-image training subset). argv[1] names the data folder; it defaults to ../shared/data."""
    sys.path.insert(0, ROOT)
    from data import ImageData

    data_dir = os.path.join(argv[1] if len(argv) > 1 and argv[1] else os.path.join(ROOT, "..", "shared", "data"),
                            "cifar10-jpeg")
    return data_dir, ImageData("folder", data_dir, device, image_size=image_size, train_samples=train_samples)


def probe_images(data_dir, model, samples=256):
    """The first `samples` test images of the CIFAR-10 folder, loaded as probe.py loads them for this model."""
    sys.path.insert(0, ROOT)
    import probe

    args = argparse.Namespace(dataset="folder", data_dir=data_dir, samples=samples, tokenizer="", val_file="")
    return probe.load_samples(args, model, {})


@torch.no_grad()
def token_predictions(model, windows, batch_size=8):
    """(loss, argmax and target of every predicted token, each (N,)): next-token on every position, or MLM on
    the positions its corruption chose (torch.manual_seed(0): the same masks for every model). The logits are
    never kept: for 1,024 windows of next-token they would need 26 GB."""
    model.eval()
    torch.manual_seed(0)
    losses, guesses, all_targets = [], [], []
    for i in range(0, len(windows), batch_size):
        x = windows[i:i + batch_size]
        if model.config.objective == "mlm":
            inputs, targets = model.mask_tokens(x)
            logits, _ = model(inputs, targets)  # (N chosen, vocab)
            targets = targets[targets != -100]
        else:
            h, targets = model.next_token_features(x)
            logits = model.token_logits(h[:, :targets.shape[1]]).flatten(0, 1)  # positions with targets
            targets = targets.flatten()
        losses.append(F.cross_entropy(logits.float(), targets, reduction="none"))
        guesses.append(logits.argmax(-1))
        all_targets.append(targets)
    return torch.cat(losses), torch.cat(guesses), torch.cat(all_targets)


@torch.no_grad()
def correct_per_image(model, data):
    model.eval()
    return torch.cat([model(x)[0].argmax(-1) == y for x, y in data.eval_batches(500)])


def mcnemar_p(a, b):
    """Exact two-sided McNemar test of paired outcomes a, b (bool tensors): the sign test on the discordant pairs.
    Descriptive only: it measures the test-set noise of two fixed networks (one seed), not the method; a method's
    result is paired_summary across seeds."""
    return sign_test_p(int((a & ~b).sum()), int((~a & b).sum()))


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)) ** 0.5


def plot_bands(probe_summary, arms, metrics, title, path, relative=False):
    """One panel per metric, one line per arm (mean over seeds) with a band of ± one std; relative=True puts
    models of different depths on one axis (layer / depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.75 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for arm, label in arms.items():
            points = [(layer, m, s) for layer, (m, s) in enumerate(probe_summary[arm][metric]) if m is not None]
            layers, means, stds = zip(*points)
            if relative:
                layers = [layer / (len(probe_summary[arm][metric]) - 1) for layer in layers]
            ax.plot(layers, means, marker="o", markersize=2.5, label=label)
            ax.fill_between(layers, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                            alpha=0.2)
        ax.set_title(metric)
        ax.set_xlabel("layer / depth" if relative else "layer (0 = embedding)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)




def initial_model(config, seed):
    """The model a run with this config and seed started from (train.py seeds, then builds)."""
    sys.path.insert(0, ROOT)
    from bamboo import Bamboo, Config

    torch.manual_seed(seed)
    return Bamboo(Config.from_dict(config)).eval()


def same_init(configs, seed, prefixes=TRUNK):
    """Whether the runs with these configs and this seed started with bit-identical tensors under the given name
    prefixes; returns (equal, how many tensors were compared)."""
    states = [{k: v for k, v in initial_model(c, seed).state_dict().items() if k.startswith(prefixes)} for c in configs]
    shared = set.intersection(*(set(s) for s in states))
    return all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in shared), len(shared)


def sign_test_p(wins, losses):
    """Exact two-sided sign test: binomial(wins + losses, 1/2) on the pairs that differ."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2))
                            for i in range(k + 1)))


def finished_run(path):
    """(model, checkpoint) of a run that reached its planned step (--max_iters): an analysis never
    reads a run that stopped early."""
    sys.path.insert(0, ROOT)
    from operations.checkpoint import model_from_checkpoint

    model, ckpt = model_from_checkpoint(path)
    planned = ckpt.get("train", {}).get("max_iters")
    if planned is not None and ckpt["step"] != planned:
        raise AnalysisError(f"{path} stopped at step {ckpt['step']} of its planned {planned}; finish "
                            f"it with python train.py --resume --out_dir {os.path.dirname(path)}")
    return model, ckpt


def finished_log(path, planned):
    """The records of a run's log.jsonl, refused unless its last evaluation is at its planned step
    (a log copied from a run that stopped early, or a missing one, is one line)."""
    if not os.path.exists(path):
        raise AnalysisError(f"no log at {path}")
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except ValueError:
                raise AnalysisError(f"{path} line {n} is not JSON (a line cut short by a kill?); "
                                    "the run's log is damaged: run the arm again") from None
    steps = [r["step"] for r in records if r.get("eval")]
    if not steps or steps[-1] != planned:
        last = max((r.get("step", 0) for r in records), default=0)
        raise AnalysisError(f"{path} ends at step {last} (last evaluation: "
                            f"{steps[-1] if steps else 'none'}), not its planned {planned}: the "
                            "run did not finish")
    return records


def last_evaluation(path, planned):
    """The last evaluation record of a finished run's log (finished_log refuses any other)."""
    return [r for r in finished_log(path, planned) if r.get("eval")][-1]


def median(values):
    """The median: the middle value, or the mean of the two middle values."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def incomplete_beta(a, b, x):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below the mean
        return 1.0 - incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log1p(-x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            step = 1.0
        elif i % 2:
            step = -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            step = (m * (b - m) * x) / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + step * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + step / c
        c = c if abs(c) > 1e-300 else 1e-300
        f *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return front * (f - 1.0)


def t_quantile(p, df):
    """The p-quantile of Student's t with df degrees of freedom (p > 0.5), by bisection on its CDF."""
    def upper_tail(t):  # P(T > t) for t >= 0
        return 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))

    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upper_tail(mid) > 1 - p else (lo, mid)
    return (lo + hi) / 2


def paired_summary(differences):
    """The primary result of a comparison across seeds: the per-seed paired differences (arm A minus
    arm B, one seed each), their mean with its 95% t-interval, their standard deviation and median,
    and the exact two-sided sign test of their signs. Per-seed tests (McNemar) only describe."""
    n = len(differences)
    mean, sd = mean_std(differences)
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    wins, losses = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    return {"per_seed": list(differences), "n": n, "mean": mean, "sd": sd,
            "ci95": [mean - half, mean + half], "median": median(differences),
            "sign_test_p": sign_test_p(wins, losses)}


def detectable(sd, n):
    """The smallest true mean difference that n seeds detect with 80% power at a two-sided 5%
    level, given the paired differences' sd."""
    if n < 2:
        return math.inf
    return (t_quantile(0.975, n - 1) + t_quantile(0.8, n - 1)) * sd / math.sqrt(n)


def seed_bands(probes, metrics):
    """Per layer (mean, std) over seeds of each metric; probes is one probe_model result per seed."""
    layers = len(probes[0][metrics[0]])
    return {m: [mean_std([p[m][layer] for p in probes]) for layer in range(layers)] for m in metrics}


def last_layer(bands):
    """'mean ± std' of the last layer of every metric of seed_bands' result, for printing."""
    return {m: f"{v[-1][0]:.3f} ± {v[-1][1]:.3f}" for m, v in bands.items() if v[-1][0] is not None}
