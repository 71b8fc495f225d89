"""Measure over-smoothing layer by layer, for checkpoints side by side, with the papers' metrics.

Token metrics, on each layer's hidden states h (T tokens of width D, hbar their mean):
  std               Bamboo eq. 1: per-channel std over tokens, sqrt(sum_t (h_t - hbar)^2 / (T-1)),
                    averaged over channels
  cos               NeuTRENO E.3: mean signed cosine similarity over token pairs i != j
  abs_cos_centered  Bamboo Fig. 1b after Gong et al. 2021: mean ABSOLUTE cosine over pairs i != j
                    of h - hbar. The absolute value is needed because centred tokens sum to zero,
                    so their signed mean cosine is pinned near -1/(T-1) whatever the model does.
  hc_dc             Wang et al.'s Fourier view: ||HC[h]||_F / ||DC[h]||_F
                    = ||h - hbar||_F / (sqrt(T) ||hbar||)
  erank             Roy & Vetterli: exp(entropy of the normalised singular values of h)
  update            ||h_l - h_(l-1)||_F / ||h_(l-1)||_F: how much block l still changes the stream
  attn_entropy      entropy of each query's attention distribution in nats, mean over heads and
                    queries; collapse drives it towards 0, and each model's ceiling is reported
                    (uniform attention: log T over T keys, causal the mean of log(i + 1))
  attn_sim          NeuTRENO G.2: cosine between successive layers' attention maps
Weight metrics, per block:
  vo_dominant   Dovonon et al.: sign of the real part of the dominant eigenvalue of each head's
                W_V W_O, LayerNorm gain folded in, averaged over heads (+1: all heads smooth)
  vo_positive   the fraction of those eigenvalues (all heads) with a positive real part
  beta_qk/v     Bamboo Fig. 2: ||W_Q W_K^T||_2 and ||W_V||_2 of each checkpoint over the first's

Collapsed tokens: a token (raw for cos, centred for abs_cos_centered) shorter than COLLAPSED * the
sample's RMS token norm is rounding noise; every pair it is in counts as cosine 1, so tokens that
have become identical read as fully smoothed, never as "diverse".

Every checkpoint sees the first N held-out samples, in order, un-augmented and normalised as its
training saw them: two runs give identical numbers, and the ones its run logged at evaluations.

Run: python probe.py init:cifar-deep,vo_param=smooth init:cifar-deep,vo_param=sharpen --samples 64 \
       --dataset folder --data_dir ../shared/data/cifar10-jpeg --json p.json --plot p.png
"""
import argparse
import json
import math
import sys
import textwrap

import torch

from bamboo import Bamboo
from data import IMAGE_DATASETS, TEXT_DATASETS, first_samples
from operations import checkpoint, cli, fast, figures, hub, streaming

TOKEN_METRICS = ("std", "cos", "abs_cos_centered", "hc_dc", "erank")
LAYER_METRICS = ("update", "attn_entropy", "attn_sim")  # from block 1 on (attn_sim: block 2)
WEIGHT_METRICS = ("vo_dominant", "vo_positive", "beta_qk", "beta_v")
COLLAPSED = 1e-5  # relative token norm below which a direction is float32 rounding noise


# ----------------------------------------------------------------------------- the metrics

def mean_pairwise_cos(h, scale, absolute=False):
    """Per sample, the mean (absolute) cosine over pairs i != j of (B, T, D) tokens; a token
    shorter than COLLAPSED * scale (B,) has collapsed: its pairs count as 1."""
    norms = h.norm(dim=-1)  # (B, T)
    collapsed = norms <= COLLAPSED * scale[:, None]
    n = h / norms.clamp_min(1e-300)[..., None]
    sims = n @ n.transpose(1, 2)  # (B, T, T)
    sims = sims.abs() if absolute else sims
    sims = sims.masked_fill(collapsed[:, :, None] | collapsed[:, None, :], 1.0)
    T = h.shape[1]
    return (sims.sum((1, 2)) - sims.diagonal(dim1=1, dim2=2).sum(-1)) / (T * (T - 1))


def singular_values(h):
    """The singular values (B, min(T, D)) of tokens h (B, T, D), ascending: square roots of the
    eigenvalues of the smaller Gram matrix, faster than an SVD and as precise for erank."""
    gram = h @ h.transpose(1, 2) if h.shape[1] <= h.shape[2] else h.transpose(1, 2) @ h
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()


def token_metrics_per_sample(h):
    """Each token metric for every sample of h (B, T, D): a dict of (B,) float64 tensors."""
    h = h.double()
    T = h.shape[1]
    mean = h.mean(dim=1, keepdim=True)
    centered = h - mean
    scale = h.pow(2).sum(-1).mean(-1).sqrt()  # (B,) RMS token norm
    s = singular_values(h)  # (B, min(T, D)), not centred (Roy & Vetterli)
    p = s / s.sum(-1, keepdim=True).clamp_min(1e-300)
    hc = centered.flatten(1).norm(dim=1)  # ||h - hbar||_F: everything but the token mean
    return {
        "std": centered.pow(2).sum(1).div(T - 1).sqrt().mean(-1),
        "cos": mean_pairwise_cos(h, scale),
        "abs_cos_centered": mean_pairwise_cos(centered, scale, absolute=True),
        "hc_dc": hc / (math.sqrt(T) * mean.flatten(1).norm(dim=1)).clamp_min(1e-300),
        "erank": torch.exp(-(p * p.clamp_min(1e-300).log()).sum(-1)),
    }


def token_metrics(h):
    """Token metrics of hidden states h (B, T, D), each a float averaged over the batch."""
    return {k: v.mean().item() for k, v in token_metrics_per_sample(h).items()}


def update_ratio(before, after):
    """Per sample, ||after - before||_F / ||before||_F of (B, T, D) hidden states: (B,) float64."""
    before, after = before.double(), after.double()
    return (after - before).flatten(1).norm(dim=1) / before.flatten(1).norm(dim=1).clamp_min(1e-300)


def attention_entropy(probs):
    """Per sample, the entropy in nats of attention rows (B, nh, T, T), mean over heads, queries."""
    p = probs.double()
    return -(p * p.clamp_min(1e-300).log()).sum(-1).mean((1, 2))


def attention_similarity(before, after):
    """Per sample, the cosine between two layers' (B, nh, T, T) attention maps, mean over heads."""
    return torch.nn.functional.cosine_similarity(before.flatten(2).double(),
                                                 after.flatten(2).double(), dim=-1).mean(1)


def layer_metrics_per_sample(hiddens, attns):
    """Every metric for depth + 1 hidden states and depth attention maps: a dict of (B,) tensors
    per layer (0: the stem's output), without update, attn_entropy at 0 and attn_sim before 2."""
    layers = []
    for i, h in enumerate(hiddens):
        metrics = token_metrics_per_sample(h)
        if i >= 1:
            metrics["update"] = update_ratio(hiddens[i - 1], h)
            metrics["attn_entropy"] = attention_entropy(attns[i - 1])
        if i >= 2:
            metrics["attn_sim"] = attention_similarity(attns[i - 2], attns[i - 1])
        layers.append(metrics)
    return layers


def head_value_output(block):
    """Per head, the (hs, hs) matrix W_O,h diag(g) W_V,h: it has the non-zero eigenvalues of
    diag(g) W_V,h W_O,h, the head's value-output product with the LayerNorm gain g folded in
    (eig(AB) = eig(BA) for the non-zero part), at a fraction of the cost."""
    w = block.attn.weights()
    gain = block.ln1.weight  # smooth/sharpen blocks have no LayerNorm gain: 1
    gain = gain.detach() if gain is not None else w["v"].new_ones(w["v"].shape[1])
    return w["o"].double() @ (gain.double()[None, :, None] * w["v"].double())  # (nh, hs, hs)


def vo_spectrum(model):
    """Per block: (mean over heads of the dominant eigenvalue's sign, share with real part > 0)."""
    dominant, positive = [], []
    for block in model.blocks:
        eigs = torch.linalg.eigvals(head_value_output(block))  # (nh, hs)
        top = eigs.gather(1, eigs.abs().argmax(1, keepdim=True))
        dominant.append(torch.sign(top.real).mean().item())
        positive.append((eigs.real > 0).double().mean().item())
    return dominant, positive


def attention_norms(model):
    """Per block: ||W_Q W_K^T||_2 and ||W_V||_2 (largest singular values), Bamboo section 2.3."""
    qk, v = [], []
    for block in model.blocks:
        w = block.attn.weights()
        nh, D, hs = w["v"].shape
        w_v = w["v"].transpose(0, 1).reshape(D, nh * hs).double()  # heads side by side, (D, D)
        qk.append(torch.linalg.matrix_norm(w["q"].double() @ w["k"].double().T, ord=2).item())
        v.append(torch.linalg.matrix_norm(w_v, ord=2).item())
    return qk, v


def beta(model, reference):
    """beta_qk and beta_v per block of model against reference (1 everywhere against itself)."""
    shapes = [(len(m.blocks), m.blocks[0].attn.weights()["v"].shape) for m in (model, reference)]
    if shapes[0] != shapes[1]:
        return None, None  # another depth or width: the layers do not pair up
    (qk, v), (qk0, v0) = attention_norms(model), attention_norms(reference)
    return [a / b for a, b in zip(qk, qk0)], [a / b for a, b in zip(v, v0)]


@torch.no_grad()
def probe_model(model, samples, batch_size, mask=False):
    """Every per-layer metric (embedding output, then every block), averaged over all samples."""
    mae = (model.config.objective == "mae" if isinstance(model, Bamboo)
           else bool(getattr(model.config, "mask_ratio", 0)))
    if mask and not (model.config.is_image and mae):
        raise ValueError("--mask probes MAE's visible patches; it needs an MAE model, ours or "
                         "Hugging Face's vit_mae (other models are probed unmasked)")
    sums = {}  # (metric, layer) -> sum over samples
    noise_gen = torch.Generator().manual_seed(0)  # --mask: the same visible patches every run
    device = next(model.parameters()).device
    for i in range(0, len(samples), batch_size):
        x = samples[i:i + batch_size].to(device)
        noise = torch.rand(len(x), model.config.num_patches(),
                           generator=noise_gen).to(device) if mask else None
        hiddens, attns = model.hidden_states(x, need_weights=True, noise=noise,
                                             mask_ratio=model.config.mask_ratio if mask else 0.0)
        if hiddens[0].shape[1] < 2:  # std and every cosine compare a sample's tokens
            raise ValueError("each sample reaches the blocks as one token, and the metrics compare "
                             "tokens: probe more patches (a larger image, or drop --mask)")
        finite = torch.stack([h.isfinite().all() for h in hiddens])  # one host sync per batch
        if not finite.all():
            bad = finite.logical_not().nonzero()[0].item()
            raise ValueError(f"layer {bad}'s hidden states are not finite on samples {i} to "
                             f"{i + len(x) - 1}; check the data (a channel or token that breaks "
                             "normalisation) or the checkpoint")
        for layer, metrics in enumerate(layer_metrics_per_sample(hiddens, attns)):
            for name, values in metrics.items():  # summed on the device, read once at the end
                sums[name, layer] = sums.get((name, layer), 0.0) + values.sum()
    layers = model.config.depth + 1
    result = {name: [sums[name, layer].item() / len(samples) if (name, layer) in sums else None
                     for layer in range(layers)] for name in TOKEN_METRICS + LAYER_METRICS}
    dominant, positive = vo_spectrum(model)
    result["vo_dominant"], result["vo_positive"] = [None] + dominant, [None] + positive
    causal = getattr(model, "causal", model.config.objective == "next")
    ceiling = entropy_ceiling(attns[0].shape[-1], causal)  # the same for every block
    result["attn_entropy_ceiling"] = [None] + [ceiling] * model.config.depth
    return result


def entropy_ceiling(T, causal):
    """The attention entropy of uniform attention: log T over T keys; causal, query i sees i + 1
    keys, so the mean over queries of log(i + 1) (about log T - 1 for large T)."""
    return sum(math.log(i + 1) for i in range(T)) / T if causal else math.log(T)


def logged_metrics(model, samples, batch_size):
    """What train.py logs at each evaluation: the token metrics and attention entropy per layer
    (0: the stem's output), unmasked and eager; the numbers probe.py gives that checkpoint."""
    was_training = model.training
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            probed = probe_model(model, samples, batch_size)
    except ValueError as e:  # non-finite hidden states: the run goes on, the note says why
        print(f"note: no per-layer metrics at this evaluation ({e})", flush=True)
        return None
    finally:
        model.train(was_training)
    return {name: rounded(probed[name]) for name in (*TOKEN_METRICS, "attn_entropy")}


def rounded(values, layers=0):
    """A metric's per-layer values as reported: 6 decimals, None where undefined, up to `layers`."""
    values = list(values) + [None] * (layers - len(values))
    return [None if v is None else round(v, 6) for v in values]


# ----------------------------------------------------------------------------- models and data

def load_model(spec, dataset):
    """A checkpoint path, init:PRESET[,key=value,...] for a fresh model (seed 0, so equal specs
    are equal), or timm:NAME / hf:NAME[,key=value,...] for a foreign one (operations/hub.py)."""
    if spec.startswith(("timm:", "hf:")):  # a pretrained timm or Hugging Face transformer
        model = hub.load(spec)
        return model, {"tokenizer": model.tokenizer} if model.tokenizer else {}
    if not spec.startswith("init:"):
        model, ckpt = checkpoint.model_from_checkpoint(spec)
        return model.eval(), checkpoint.data_settings(ckpt)
    config = cli.config_from_spec(spec[len("init:"):],
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
    data = streaming.held_out(model.config, train_cfg, args.dataset, args.data_dir,
                              args.tokenizer, args.val_file)
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

def print_table(report):
    """Per checkpoint, one table per block of metrics, layers as rows."""
    for label in report["labels"]:
        print(f"\n{label}  ({report['source'][label]})")
        for names in (TOKEN_METRICS, LAYER_METRICS + WEIGHT_METRICS):  # each under 100 columns
            widths = [max(12, len(n)) for n in names]
            print("layer " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
            for layer in range(report["depth"][label] + 1):
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
        raise ValueError(f"--labels needs {len(args.checkpoints)} distinct names, one each")
    report = {"labels": labels, "layers": [], "samples": args.samples, "depth": {}, "source": {},
              "metrics": {}, "absent": {}, "attn_entropy_ceiling": {}}
    reference, raw, sample_sets = None, {}, {}
    for i, (label, spec) in enumerate(zip(labels, args.checkpoints), 1):
        print(f"probing {label} ({i} of {len(labels)}) ...", flush=True)
        model, train_cfg = load_model(spec, args.dataset or "cifar10")
        model.to(fast.pick_device(args.device, 0))
        key = samples_key(model, train_cfg)  # each dataset decoded once for the models alike
        if key not in sample_sets:
            sample_sets[key] = load_samples(args, model, train_cfg)
        raw[label] = probe_model(model, sample_sets[key], args.batch_size, args.mask)
        reference = model if reference is None else reference
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
    report["metrics"] = {name: {label: rounded(raw[label][name], layers) for label in labels}
                         for name in TOKEN_METRICS + LAYER_METRICS + WEIGHT_METRICS}
    print_table(report)
    if args.json:
        checkpoint.atomic_write(args.json, lambda f: f.write(json.dumps(report, indent=1).encode()))
    if args.plot:
        figures.save_figure(probe_figure(report, args.relative), args.plot)
    print("".join(f"wrote {path}\n" for path in (args.json, args.plot) if path), end="")
    return report


def build_parser():
    p = argparse.ArgumentParser(description="Measure over-smoothing per layer.", allow_abbrev=False)
    add = p.add_argument
    add("checkpoints", nargs="+", help="checkpoints; init:PRESET[,key=value,...]: a fresh model")
    add("--labels", default="", help="comma-separated names for the checkpoints (default: paths)")
    add("--dataset", default="", choices=("",) + IMAGE_DATASETS + TEXT_DATASETS,
        help="data to probe with (default: each checkpoint's own training data)")
    add("--data_dir", default="", help="where the dataset lives (default: the checkpoint's)")
    add("--tokenizer", default="",
        help="text: tiktoken encoding, bytes or hf:NAME (default: the checkpoint's or model's)")
    add("--val_file", default="",
        help="--dataset text: held-out file in data_dir (default: the checkpoint's, or val.txt)")
    add("--samples", type=int, default=256, help="the first N held-out samples (default: 256)")
    add("--batch_size", type=int, default=32, help="samples per forward pass (default: 32)")
    add("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default: cpu)")
    add("--threads", type=int, default=0, help="CPU threads; busy CPU: try 1 (default: 0, all)")
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
            cli.check_output_path(flag, path)


def main(argv=None):
    """The command line: checkpoints side by side, a table per model, JSON and a figure."""
    args = build_parser().parse_args(argv)
    with cli.one_line_errors() as outcome:  # a user's mistake: one line
        check_args(args)
        run(args)
    return outcome.code


# ----------------------------------------------------------------------------- the figure

# What each panel's y-axis shows, and which way is "more smoothed" (tokens more alike).
AXES = {
    "std": "std over tokens; lower: more smoothed",
    "cos": "mean cosine; higher: more smoothed",
    "abs_cos_centered": "mean |cosine| of h - hbar; higher: more smoothed",
    "hc_dc": "HC / DC energy; lower: more smoothed",
    "erank": "effective rank; lower: more smoothed",
    "update": "||h_l - h_(l-1)|| / ||h_(l-1)||; lower: the block does less",
    "attn_entropy": "nats; higher: more smoothing (dashed: uniform)",
    "attn_sim": "cosine to the previous map; higher: alike",
    "vo_dominant": "mean sign; +1 every head smooths, -1 sharpens",
    "vo_positive": "share of eigenvalues > 0; higher: more smoothing",
    "beta_qk": "ratio to {reference}; above 1: larger",
    "beta_v": "ratio to {reference}; above 1: larger",
}


def probe_figure(report, relative):
    """The probe's figure: a panel per metric, every checkpoint a line, each y-axis labelled with
    the way that means "more smoothed"."""
    from matplotlib.ticker import MaxNLocator

    def drawn(name):  # a panel with something to show: beta needs a checkpoint beside the first
        lines = sum(any(v is not None for v in vs) for vs in report["metrics"][name].values())
        return lines > (1 if name.startswith("beta") else 0)  # the first is 1 against itself

    names = [n for n in report["metrics"] if drawn(n)]
    cols, rows = 3, math.ceil(len(names) / 3)
    fig, axes = figures.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows))
    for ax, name in zip(axes.flat, names):
        for label in report["labels"]:
            depth = report["depth"][label]
            values = report["metrics"][name][label][: depth + 1]
            pairs = [(layer / depth if relative else layer, v)
                     for layer, v in enumerate(values) if v is not None]
            if pairs:
                line, = ax.plot(*zip(*pairs), marker="o", markersize=3, label=label)
                if name == "attn_entropy":  # uniform attention: log T, causal mean log(i + 1)
                    ax.axhline(report["attn_entropy_ceiling"][label], color=line.get_color(),
                               linestyle="--", linewidth=0.8)
        ax.set_title(name)
        ax.set_ylabel("\n".join(textwrap.wrap(AXES[name].format(reference=report["labels"][0]),
                                              32)), fontsize=8)
        figures.least_visible_range(ax)
        ax.set_xlabel("relative depth (layer / depth)" if relative else "layer (0 = embedding)")
        if not relative:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)  # plain values, no "1e-5 + 0.9998" offsets
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Over-smoothing per layer ({report['samples']} held-out samples)", fontsize=14)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


if __name__ == "__main__":
    sys.exit(main())
