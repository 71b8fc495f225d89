"""Look at what a model does: text samples (as nanoGPT's sample.py), MAE reconstructions, attention
maps, training curves, and each layer's over-smoothing as training went (python look.py -h).

Run: python look.py sample out/ckpt.pt --prompt "The meaning of" --max_new_tokens 100
"""
import argparse
import math
import os
import sys
from functools import partial

import torch

from bamboo import patchify, unpatchify
from data import IMAGE_DATASETS, TEXT_DATASETS, first_samples, get_tokenizer
from probe import AXES, TOKEN_METRICS
from operations import runlog
from operations.checkpoint import data_settings, model_from_checkpoint
from operations.cli import check_output_path, one_line_errors
from operations.figures import least_visible_range, save_figure, subplots
from operations.streaming import held_out


def load(path, objective=None):
    """(model in eval mode, its training settings, its step); objective, if given, is required."""
    model, ckpt = model_from_checkpoint(path)
    if objective and model.config.objective != objective:
        raise ValueError(f"{path} holds a {model.config.objective} model; this command needs a "
                         f"{objective} model")
    return model.eval(), data_settings(ckpt), ckpt.get("step")


def sample(args):
    """Continue the prompt num_samples times, printing each continuation as it is generated."""
    model, train_cfg, _ = load(args.checkpoint, "next")
    tokenizer = get_tokenizer(train_cfg.get("tokenizer", "gpt2"))
    ids = tokenizer.encode_ordinary(args.prompt) or [tokenizer.encode_ordinary("\n")[0]]
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.num_samples):
        tokens, shown = torch.tensor([ids]), ""
        print(args.prompt, end="", flush=True)
        for _ in range(args.max_new_tokens):  # a token at a time, printed as it comes
            tokens = model.generate(tokens, 1, args.temperature, args.top_k or None, generator)
            text = tokenizer.decode(tokens[0, len(ids):].tolist())
            if not text.endswith("\ufffd"):  # a character split across tokens waits for its end
                print(text[len(shown):], end="", flush=True)
                shown = text
        print(text[len(shown):] + "\n---------------")


@torch.no_grad()
def mae_columns(model, images, seed=0):
    """(original, masked, reconstruction, reconstruction with the visible patches pasted back), each
    (N, C, H, W) as the inputs, and the pixels (N, 1, H, W) that MAE's masks (seeded) hid."""
    c = model.config
    noise = torch.rand(len(images), c.num_patches(), generator=torch.Generator().manual_seed(seed))
    latent, mask, ids_restore = model.forward_encoder(images, c.mask_ratio, noise)
    pred = model.forward_decoder(latent, ids_restore)  # (N, L, p*p*C)
    patches = patchify(images, c.patch_size)
    if c.norm_pix_loss:  # the model predicts normalised patches: give them each patch's statistics
        mean, var = patches.mean(-1, keepdim=True), patches.var(-1, keepdim=True)
        pred = pred * (var + 1e-6).sqrt() + mean
    hidden = mask[..., None]  # (N, L, 1), 1 = hidden
    image = partial(unpatchify, p=c.patch_size, channels=c.channels)
    visible = patches * (1 - hidden)
    hidden_pixels = image(hidden.expand_as(patches))[:, :1].bool()
    return images, image(visible), image(pred), image(visible + pred * hidden), hidden_pixels


def reconstruct(args):
    """A grid of held-out images, one per row, in the four columns of mae_columns."""
    model, train_cfg, step = load(args.checkpoint, "mae")
    c = model.config
    data = held_out(c, train_cfg, args.dataset, args.data_dir)
    *columns, hidden = mae_columns(model, first_samples(data, args.samples), args.seed)
    pixels = [(x * data.std + data.mean).clamp(0, 1) for x in columns]  # back to [0, 1]
    pixels[1] = pixels[1].masked_fill(hidden, 0.85)  # hidden patches in light grey, as MAE shows
    names = ("original", f"masked ({c.mask_ratio:.0%})", "reconstruction",
             "reconstruction + visible")
    rows = len(pixels[0])
    fig, axes = subplots(rows, 4, figsize=(8, 2 * rows), layout="tight")
    for column, name, batch in zip(axes.T, names, pixels):
        column[0].set_title(name, fontsize=9)
        for ax, image in zip(column, batch):
            ax.imshow(image.permute(1, 2, 0).squeeze(-1).numpy(),
                      cmap="gray" if c.channels == 1 else None, interpolation="nearest")
            ax.axis("off")
    fig.suptitle(f"MAE reconstructions of {rows} held-out images: {args.checkpoint}, step {step}",
                 fontsize=10)
    save_figure(fig, args.out)


def parse_indices(text, count, what):
    """'0,2,-1' -> [0, 2, count - 1], each checked to be one of count."""
    try:
        return [range(count)[int(t)] for t in text.split(",")]
    except (ValueError, IndexError):
        raise ValueError(f"--{what} {text}: the model has {count} {what}; give whole numbers from "
                         f"{-count} to {count - 1}, separated by commas") from None


@torch.no_grad()
def attention(args):
    """Attention maps of chosen layers and heads for one held-out image or text window."""
    model, train_cfg, _ = load(args.checkpoint)
    c = model.config
    layers = parse_indices(args.layers, c.depth, "layers")
    heads = parse_indices(args.heads, c.heads, "heads")
    data = held_out(model.config, train_cfg, args.dataset, args.data_dir)
    first = first_samples(data, args.index + 1)
    if args.index >= len(first):
        raise ValueError(f"--index {args.index} is past the {len(first)} held-out samples; "
                         f"choose 0 to {len(first) - 1}")
    x = first[args.index:args.index + 1]
    _, attns = model.hidden_states(x, need_weights=True)
    maps = {(layer, head): attns[layer][0, head] for layer in layers for head in heads}
    if c.is_image:
        image = (x[0] * data.std[0] + data.mean[0]).clamp(0, 1).permute(1, 2, 0)
        fig = attention_over_image(image, maps, c.image_size // c.patch_size)
    else:
        fig = attention_over_tokens([data.tokenizer.decode([i]) for i in x[0].tolist()], maps)
    fig.suptitle(f"Attention, held-out {'image' if c.is_image else 'text window'} {args.index}")
    save_figure(fig, args.out)


def attention_over_image(image, maps, grid):
    """The image, then per (layer, head) the attention each patch receives (mean over queries;
    a CLS token's column left out) drawn over the image on its patch grid."""
    fig, axes = subplots(1, len(maps) + 1, figsize=(3 * (len(maps) + 1), 3.3), layout="tight")
    axes[0, 0].imshow(image.numpy())
    axes[0, 0].set_title("the image", fontsize=9)
    size = image.shape[0]
    for ax, ((layer, head), probs) in zip(axes[0, 1:], maps.items()):
        received = probs.mean(0)[-grid * grid:].reshape(grid, grid)
        ax.imshow(image.numpy())
        overlay = ax.imshow(received.numpy(), cmap="inferno", alpha=0.6, vmin=0,
                            extent=(-0.5, size - 0.5, size - 0.5, -0.5))  # on the pixel edges
        fig.colorbar(overlay, ax=ax, fraction=0.046, pad=0.04)
        for edge in range(0, size + 1, size // grid):  # the patch grid
            ax.axhline(edge - 0.5, color="white", linewidth=0.3)
            ax.axvline(edge - 0.5, color="white", linewidth=0.3)
        ax.set_title(f"block {layer}, head {head}: attention received", fontsize=8)
    for ax in axes[0]:
        ax.axis("off")
    return fig


def attention_over_tokens(tokens, maps, shown=24):
    """Per (layer, head) the queries x keys map of the first `shown` tokens, each labelled."""
    labels = [repr(t)[1:-1][:10] for t in tokens[:shown]]
    fig, axes = subplots(1, len(maps), figsize=(5.5 * len(maps), 5.5), layout="tight")
    for ax, ((layer, head), probs) in zip(axes[0], maps.items()):
        part = probs[:shown, :shown].numpy()
        fig.colorbar(ax.imshow(part, cmap="viridis", vmin=0), ax=ax, fraction=0.046, pad=0.04)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_title(f"block {layer}, head {head} (first {len(labels)} tokens)", fontsize=9)
        ax.set(xlabel="key token", ylabel="query token")
    return fig


def read_log(out_dir):
    """(training records, evaluation records) of out_dir/log.jsonl, or of a kept NAME.jsonl."""
    path = out_dir if str(out_dir).endswith(".jsonl") else os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"no log at {path}; give the --out_dir of a train.py run or its log")
    records = [r for r in runlog.read_log(path) if "run" not in r]  # not an invocation's first
    train, evals = [r for r in records if not r.get("eval")], [r for r in records if r.get("eval")]
    if not train and not evals:
        raise ValueError(f"{path} holds no step yet; look again once the run has logged")
    return train, evals


def run_label(out_dir):
    """A run's name in a legend: its folder's, or its kept log's without .jsonl."""
    return os.path.basename(os.path.normpath(out_dir)).removesuffix(".jsonl") or str(out_dir)


# Each panel of the curves: its log key and what its y-axis shows; a run draws the ones it has.
CURVES = {"loss": "training loss", "val_loss": "held-out loss", "top1": "held-out top-1 (%)",
          "ppl": "held-out perplexity", "mlm_acc": "held-out MLM accuracy (%)"}


def loss_kind(evals):
    """What a run's loss measures, from the metric its evaluations log beside it."""
    if not evals:
        return "not evaluated yet"
    metrics = {k for r in evals for k in r}
    return "cross-entropy" if metrics & {"top1", "ppl", "mlm_acc"} else "MAE, pixel MSE"


def curves_figure(logs):
    """One panel per metric (never two scales on one axis: MAE's pixel loss and a classifier's
    cross-entropy get a panel each), one line per run, one colour per run."""
    panels = list(dict.fromkeys(  # (key, loss kind or None), each once, in CURVES' order
        (key, loss_kind(evals) if key in ("loss", "val_loss") else None)
        for key in CURVES for train, evals in logs.values()
        if any(key in r for r in (train if key == "loss" else evals))))
    fig, axes = subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), layout="tight")
    for ax, (key, kind) in zip(axes[0], panels):
        for colour, (out_dir, (train, evals)) in enumerate(logs.items()):  # a run: one colour
            if kind is not None and loss_kind(evals) != kind:
                continue
            records = [r for r in (train if key == "loss" else evals) if key in r]
            points = [(r["step"], r[key]) for r in records if math.isfinite(r[key])]
            if records and not points:  # a diverged step has no point: said when none is left
                print(f"note: {run_label(out_dir)}: every {key} is non-finite (diverged); nothing "
                      "to draw for it", file=sys.stderr)
            if points:
                dense = key == "loss" and len(points) > 2  # a few points: marked, or unseen
                ax.plot(*zip(*points), label=run_label(out_dir), lw=1, ms=3,
                        marker="" if dense else "o", color=f"C{colour}")
        title = CURVES[key] + (f" ({kind})" if kind else "")
        ax.set(title=title, xlabel="step", ylabel=title, xlim=(0, None))  # one point: no sliver
        least_visible_range(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel whose runs all diverged has none
            ax.legend(fontsize=8)
    return fig


def curves(args):
    """Training loss and each held-out metric against steps, one line per out_dir."""
    save_figure(curves_figure({out_dir: read_log(out_dir) for out_dir in args.out_dirs}), args.out)


def smoothing(args):
    """Over-smoothing as it formed: a probe metric per layer at each evaluation, as one heatmap
    per run (layer against step, one colour scale for all) and the last layer against step."""
    runs = {}
    for out_dir in args.out_dirs:
        logged = read_log(out_dir)[1]
        evals = [r for r in logged if r.get("layers")]  # null: non-finite states
        if not logged:
            raise ValueError(f"{out_dir} has no evaluation yet (one comes every --eval_interval "
                             "steps, and at the end or a stop); look once it has")
        if not evals:
            raise ValueError(f"{out_dir}: its evaluations logged no per-layer metrics (trained "
                             "with --probe_samples 0, or non-finite states); train with N > 0")
        label = run_label(out_dir)
        runs[out_dir if label in runs else label] = (
            [r["step"] for r in evals],
            [[math.nan if v is None else v for v in r["layers"][args.metric]] for r in evals])
    values = [v for _, rows in runs.values() for row in rows for v in row if math.isfinite(v)]
    fig, axes = subplots(1, len(runs) + 1, figsize=(4 * (len(runs) + 1), 3.8), layout="constrained")
    for ax, (label, (steps, rows)) in zip(axes[0], runs.items()):
        by_layer = list(zip(*rows))
        image = ax.imshow(by_layer, origin="lower", aspect="auto", vmin=min(values),
                          vmax=max(values), extent=(0, len(steps), -0.5, len(by_layer) - 0.5))
        every = max(1, len(steps) // 8)  # at most about 8 labels: they never overlap
        ax.set_xticks([i + 0.5 for i in range(0, len(steps), every)],
                      [str(s) for s in steps[::every]], fontsize=7)
        ax.locator_params(axis="y", integer=True)
        ax.set(title=label, xlabel="step (each evaluation)", ylabel="layer (0 = embedding)")
    fig.colorbar(image, ax=axes[0][:len(runs)].tolist(), label=args.metric)
    last = axes[0][-1]
    for label, (steps, rows) in runs.items():
        last.plot(steps, [row[-1] for row in rows], marker="o", ms=3, label=label)
        print(f"{label}: {args.metric} of the last layer at steps {steps}: "
              + " ".join(f"{row[-1]:.4f}" for row in rows))  # nan where it was undefined
    last.set(title=f"the last layer's {args.metric}", xlabel="step")  # the colour bar names it
    least_visible_range(last)
    last.grid(alpha=0.3)
    last.legend(fontsize=8)
    fig.suptitle(f"{args.metric} per layer as training went ({AXES[args.metric]})", fontsize=11)
    save_figure(fig, args.out)


def build_parser():
    p = argparse.ArgumentParser(description="Look at what a model does.", allow_abbrev=False)
    commands = p.add_subparsers(dest="command", required=True,
                                parser_class=partial(argparse.ArgumentParser, allow_abbrev=False))
    s = commands.add_parser("sample", help="continue a prompt with a next-token model")
    s.add_argument("checkpoint")
    s.add_argument("--prompt", default="\n", help="text to continue (default: a new line)")
    s.add_argument("--num_samples", type=int, default=3, help="continuations (default: 3)")
    s.add_argument("--max_new_tokens", type=int, default=100, help="tokens each (default: 100)")
    s.add_argument("--temperature", type=float, default=0.8, help=">0; lower: surer (default: 0.8)")
    s.add_argument("--top_k", type=int, default=200, help="the k likeliest; 0: all (default: 200)")
    s.add_argument("--seed", type=int, default=1337, help="(default: 1337)")
    for name, what in (("reconstruct", "MAE reconstructions of held-out images as one grid"),
                       ("attention", "attention maps of chosen layers and heads")):
        q = commands.add_parser(name, help=what)
        q.add_argument("checkpoint")
        q.add_argument("--dataset", default="", choices=("",) + IMAGE_DATASETS + TEXT_DATASETS,
                       help="held-out data (default: the run's)")
        q.add_argument("--data_dir", default="", help="where it lives (default: the run's)")
        q.add_argument("--out", default=f"{name}.png", help=f"PNG to write (default: {name}.png)")
        if name == "reconstruct":
            q.add_argument("--samples", type=int, default=8, help="held-out images (default: 8)")
            q.add_argument("--seed", type=int, default=0, help="seed of the masks (default: 0)")
        else:
            q.add_argument("--layers", default="0,-1", help="blocks, e.g. 0,5,-1 (default: 0,-1)")
            q.add_argument("--heads", default="0", help="heads, e.g. 0,1 (default: 0)")
            q.add_argument("--index", type=int, default=0, help="held-out sample (default: 0)")
    c = commands.add_parser("curves", help="training curves of out_dirs")
    c.add_argument("out_dirs", nargs="+", help="train.py --out_dir folders")
    c.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    m = commands.add_parser("smoothing", help="per-layer probe metrics against step, of out_dirs")
    m.add_argument("out_dirs", nargs="+", help="train.py --out_dir folders, or their logs (.jsonl)")
    m.add_argument("--metric", default="abs_cos_centered", choices=(*TOKEN_METRICS, "attn_entropy"),
                   help="(default: abs_cos_centered)")
    m.add_argument("--out", default="smoothing.png", help="PNG (default: smoothing.png)")
    return p


def check_args(args):
    """One line for the first bad argument, before any model is loaded."""
    for name, least in (("num_samples", 1), ("max_new_tokens", 1), ("samples", 1), ("top_k", 0),
                        ("index", 0)):
        if getattr(args, name, least) < least:
            raise ValueError(f"--{name} must be at least {least}")
    if not 0 < getattr(args, "temperature", 1) < math.inf:
        raise ValueError("--temperature must be a finite number > 0")
    if getattr(args, "out", ""):
        check_output_path("--out", args.out)


def main(argv=None):
    args = build_parser().parse_args(argv)
    commands = {"sample": sample, "reconstruct": reconstruct, "attention": attention,
                "curves": curves, "smoothing": smoothing}
    with one_line_errors() as outcome:
        check_args(args)
        commands[args.command](args)
        if getattr(args, "out", ""):
            print(f"wrote {args.out}")
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
