"""The reference's tests: the specification of its behaviour, one section per file in the
README's order, each with its bad input and faults; the shared helpers first.

  0. shared helpers       1. bamboo.py     2. neutreno.py    3. data.py       4. train.py
  5. probe.py             6. operations/fast.py              7. operations/adapters.py, export.py
  8. look.py              9. bench.py      10. the code itself
  11. CUDA (defined only where a GPU is; results/gpu.sh runs them)

The lab's own tests (of the scripts in results/) are in results/test_results.py.
Run: python -m pytest -q -n auto --dist worksteal test_all.py results   (one worker per core)
"""
import argparse
import ast
import errno
import inspect
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
import zipfile
from contextlib import chdir, nullcontext, redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
import torch.nn.functional as F
# transformers binds its log handler to the stderr of its first import: here, not to a test's
# capsys stream, which closes after the test
import transformers.utils.logging
from PIL import Image
from torch._dynamo.utils import counters

import bamboo
import bench
import look
import neutreno
import probe
import train
from bamboo import (PRESETS, TRUNK, Bamboo, Block, ChunkedCrossEntropy, Config, patchify,
                    random_masking, take_tokens, training_flops, unpatchify)
from data import (ImageData, TextData, channel_statistics, first_samples, get_tokenizer,
                  normalisation, shard, to_device)
from neutreno import Attention, explicit_attention
from operations import (adapters, checkpoint, checks, cli, export, fast, figures, files, hub,
                        progress, runlog)
from operations.checkpoint import model_from_checkpoint
from operations.cli import RUN_FILES, TrainingError, one_line_errors
from operations.files import _decode, list_folder
from operations.out_dir import out_dir_claimed
from operations.streaming import ImageStream, eval_view, held_out, standardised, train_view
from probe import (attention_entropy, beta, head_value_output, singular_values, token_metrics,
                   update_ratio, vo_spectrum)

# The suite's models are tiny: one thread each costs less in hand-offs and leaves the other core
# to the subprocesses of the tests.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


# ==================================================================================================
# 0. Shared helpers: tiny configs and batches, the tiny data, the training CLI as users run it
# ==================================================================================================

def tiny(objective, **overrides):
    """A config small enough to train in a second on CPU."""
    base = dict(objective=objective, depth=2, width=32, heads=2, image_size=16, patch_size=4,
                vocab_size=64, seq_len=16, decoder_depth=1, decoder_width=32, decoder_heads=2)
    return Config(**{**base, **overrides})


def batch(config, B=4, seed=0):
    """Smooth images in [0, 1] (2x2 random colours blown up, so visible patches predict hidden
    ones) with labels, or token windows."""
    g = torch.Generator().manual_seed(seed)
    if config.is_image:
        corners = torch.rand(B, config.channels, 2, 2, generator=g)
        x = F.interpolate(corners, size=config.image_size, mode="bilinear", align_corners=True)
        return x, torch.randint(0, config.num_classes, (B,), generator=g)
    return torch.randint(0, config.vocab_size, (B, config.seq_len), generator=g), None


def mean_cos(h):
    """Mean pairwise cosine over i != j of (B, T, D) tokens (the probe's `cos`, kept local here)."""
    h = F.normalize(h, dim=-1)
    T = h.shape[1]
    return ((h @ h.transpose(1, 2)).sum((1, 2)) - T).div(T * (T - 1)).mean().item()


REPO = os.path.dirname(os.path.abspath(__file__))
# decoded image folders are cached outside the clone: the suite writes only temporary files
IMAGE_CACHE = os.path.join(tempfile.gettempdir(), "bamboo-tests-cache")
TINY_IMAGE_FLAGS = ["--depth", "2", "--width", "32", "--heads", "2", "--image_size", "16",
                    "--patch_size", "4", "--cache_dir", IMAGE_CACHE,
                    "--decoder_depth", "1", "--decoder_width", "32", "--decoder_heads", "2"]
TINY_TEXT_FLAGS = ["--depth", "2", "--width", "32", "--heads", "2", "--seq_len", "32",
                   "--tokenizer", "bytes", "--cache_dir", IMAGE_CACHE]
# what may change in the clone while the suite runs: Python's and the tools' own caches
CLONE_CACHES = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}


def clone_files():
    """{path: (size, mtime)} of every file in the clone outside CLONE_CACHES."""
    found = {}
    for folder, subfolders, names in os.walk(REPO):
        subfolders[:] = [d for d in subfolders if d not in CLONE_CACHES]
        for path in (os.path.join(folder, name) for name in names):
            found[os.path.relpath(path, REPO)] = os.stat(path).st_size, os.stat(path).st_mtime_ns
    return found


@pytest.fixture(scope="session", autouse=True)
def the_suite_leaves_the_clone_unchanged():
    """Every test writes under temporary folders only: no file of the clone changes."""
    before = clone_files()
    yield
    after = clone_files()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert changed == [], f"the suite wrote into the clone: {changed[:10]}"


def run_train(*flags, out_dir):
    """train.py's command line run in this process as main(argv); returns (exit code, everything
    printed, the log.jsonl records)."""
    printed = io.StringIO()
    with redirect_stdout(printed), redirect_stderr(printed):
        code = train.main([*map(str, flags), "--out_dir", str(out_dir), "--log_interval", "1"])
    return code, printed.getvalue(), log_records(out_dir)


def log_records(folder):
    """The records of folder/log.jsonl, read as look.py and a resume read them ([]: none)."""
    log = Path(folder) / "log.jsonl"
    return runlog.read_log(log) if log.exists() else []


def train_losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def image_flags(tiny_data, objective, *extra):
    lr = "1e-2" if objective == "mae" else "3e-3"  # the tiny MAE learns in 40 steps at 1e-2
    return ["--objective", objective, "--dataset", "folder", "--data_dir",
            str(tiny_data / "images"), *TINY_IMAGE_FLAGS, "--batch_size", "16", "--lr", lr,
            "--warmup", "2", *extra]


def text_flags(tiny_data, objective, *extra):
    return ["--objective", objective, "--dataset", "text", "--data_dir", str(tiny_data / "text"),
            "--cache_dir", str(tiny_data / "cache"), *TINY_TEXT_FLAGS, "--batch_size", "16",
            "--lr", "3e-3", "--warmup", "2", *extra]


def train_run(tiny_data, objective, out_dir, steps, *extra):
    """A tiny `objective` run of `steps` steps in out_dir, evaluated and saved at the last (unless
    extra says otherwise); returns its ckpt.pt."""
    flags = (image_flags if objective in ("mae", "cls") else text_flags)(
        tiny_data, objective, "--max_iters", str(steps), "--eval_interval", str(steps), *extra)
    code, out, _ = run_train(*flags, out_dir=out_dir)
    assert code == 0, out
    return out_dir / "ckpt.pt"


@pytest.fixture(scope="session")
def trained(tiny_data, tmp_path_factory):
    """trained(objective, out_dir): a tiny run of 2 steps (evaluated and saved at step 2), trained
    once a session and copied into out_dir; returns the copy's ckpt.pt."""
    runs = {}

    def copy(objective, out_dir):
        if objective not in runs:
            runs[objective] = tmp_path_factory.mktemp("trained") / objective
            train_run(tiny_data, objective, runs[objective], 2)
        shutil.copytree(runs[objective], out_dir, dirs_exist_ok=True)
        return out_dir / "ckpt.pt"
    return copy


@pytest.fixture
def table_row(tiny_data, trained, tmp_path, monkeypatch, request):
    """row(setup, argv, says): a refusal table's row with its set-up done and {tmp}, {run},
    {images}, {text}, @OBJECTIVE filled in (set-ups: see TRAIN_REFUSALS); returns argv, pieces."""
    c = types.SimpleNamespace(tmp=tmp_path, run=tmp_path / "run", data=tiny_data, trained=trained,
                              monkeypatch=monkeypatch, request=request)
    where = {"{tmp}": str(tmp_path), "{run}": str(c.run), "{images}": str(tiny_data / "images"),
             "{text}": str(tiny_data / "text")}
    flags = {f"@{o}": (image_flags if o in ("mae", "cls") else text_flags)(tiny_data, o)
             for o in ("mae", "cls", "next")}

    def fill(text):
        for key, value in where.items():
            text = text.replace(key, value)
        return text

    def row(setup, argv, says):
        for step in setup if isinstance(setup, list) else [setup] if setup else []:
            if isinstance(step, str):
                objective, _, folder = step.partition(":")
                trained(objective, tmp_path / folder if folder else c.run)
            else:
                extra = step(c)
                where.update(extra if isinstance(extra, dict) else {})
        argv = [f for a in argv for f in flags.get(a, [fill(str(a))])]
        return argv, [fill(piece) for piece in ((says,) if isinstance(says, str) else says)]
    return row


def tree(folder):
    """{path: bytes} of every file under folder."""
    return {p: p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def run_torchrun(*flags, out_dir):
    """train.py under a 2-process gloo DDP group; returns (exit code, output, log records)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "train.py", "--log_interval", "1", *flags,
                           "--out_dir", str(out_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr, log_records(out_dir)


def stopped_run(flags, out_dir, stop):
    """train.py run as a process of its own session, stop(process) once it logged a loss; returns
    (the process, everything it printed)."""
    proc = subprocess.Popen([sys.executable, "train.py", *map(str, flags), "--out_dir",
                             str(out_dir), "--log_interval", "1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, deadline = out_dir / "log.jsonl", time.time() + 60
    while time.time() < deadline and '"loss"' not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    stop(proc)
    return proc, proc.communicate(timeout=60)[0]


def cli_error(capsys, *argv):
    """Run train.main in-process; it must return 2 and print exactly one line, no traceback."""
    assert train.main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """An ImageFolder of two colour classes (a colour plus a smooth wave and light noise, so that
    hidden patches are predictable), and a train/val pair of text files."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("test", 16)):
        for label, colour in (("red", (200, 40, 40)), ("blue", (40, 40, 200))):
            folder = root / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                wave = 60 * np.sin(np.arange(16)[:, None] / 3 + rng.uniform(0, 6.3))[..., None]
                noise = rng.normal(0, 5, (16, 16, 3))
                pixels = np.clip(np.array(colour) + wave + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    text = root / "text"
    text.mkdir()
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"
    words = words.split()
    for name, n in (("train.txt", 3000), ("val.txt", 600)):
        (text / name).write_text(" ".join(words[i % len(words)] for i in range(n)))
    return root


def trunk_state(model):
    return {k: v for k, v in model.state_dict().items()
            if k.startswith(("blocks.", "patch_embed", "tok_embed", "pos_embed"))}


def assert_spectra(model, mode):
    for block in model.blocks:
        eigs = torch.linalg.eigvals(head_value_output(block))
        assert eigs.imag.abs().max() < 1e-6  # symmetric by construction: real eigenvalues
        if mode == "smooth":
            assert (eigs.real > 0).all()
        else:
            assert (eigs.real >= -1 - 1e-6).all() and (eigs.real < 0).all()


def write_folder(root, classes_per_split, n=4, blue=True):
    """An ImageFolder tree of 16x16 noise images, {split: [class names]}; blue=False: no blue."""
    rng = np.random.default_rng(0)
    for split, classes in classes_per_split.items():
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                pixels[..., 2] *= blue
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


@pytest.fixture(scope="session")
def mixed_jpegs(tmp_path_factory):
    """225 JPEGs of mixed sizes (12 to 96 px a side), three classes, train/ and val/."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    for split, n in (("train", 60), ("val", 15)):
        for label in ("cat", "dog", "fox"):
            (root / split / label).mkdir(parents=True)
            for i in range(n):
                w, h = rng.integers(12, 97, 2)
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{i}.jpg", quality=90)
    return root


STREAM_FLAGS = [*TINY_IMAGE_FLAGS, "--batch_size", "8", "--lr", "1e-2", "--warmup", "2",
                "--dtype", "float32", "--stream", "on"]


def attention_stack(x, depth, residual, seed=0):
    """Hidden states of softmax attention with identity values: x <- x + softmax(..) LN(x), or
    with residual=False x <- softmax(..) x (Dong et al. 2021's pure attention)."""
    g = torch.Generator().manual_seed(seed)
    d = x.shape[-1]
    hiddens = [x]
    for _ in range(depth):
        w_q, w_k = (torch.randn(d, d, generator=g, dtype=x.dtype) * 2 / math.sqrt(d)
                    for _ in range(2))
        z = F.layer_norm(x, (d,)) if residual else x
        probs = torch.softmax((z @ w_q) @ (z @ w_k).transpose(1, 2) / math.sqrt(d), dim=-1)
        x = x + probs @ z if residual else probs @ z
        hiddens.append(x)
    return hiddens


def per_layer(hiddens):
    layers = [token_metrics(h) for h in hiddens]
    return {name: [m[name] for m in layers] for name in layers[0]}


def hand_built_block(gain):
    """A width-8, 2-head block whose per-head W_V W_O (gain folded in) is diag(eigs_h * gain_h)."""
    block = Block(8, 2)
    eigs = torch.tensor([[3.0, -1.0, 0.5, 0.2], [-2.0, 1.0, 1.0, 1.0]])
    with torch.no_grad():
        block.attn.qkv.weight[16:] = torch.eye(8)  # W_V: head h reads channels 4h..4h+3
        block.attn.proj.weight.copy_(torch.diag(eigs.flatten()))  # W_O: writes them back, scaled
        block.ln1.weight.copy_(gain)
    return block, eigs


@pytest.fixture(autouse=True)
def bench_without_settling(monkeypatch):
    """bench.py's seconds of untimed steps before its rounds, left out of the suite's tiny runs."""
    monkeypatch.setattr("bench.WARM_S", 0.0)


def probe_cli(capsys, *argv):
    """probe.py's command line in a scratch folder (a foreign model caches text in ./data/cache)."""
    with chdir(tempfile.mkdtemp()):
        code = probe.main([str(a) for a in argv])
    return code, capsys.readouterr()


TIMM_VIT = ("timm:vit_tiny_patch16_224,pretrained=0,img_size=16,patch_size=4,depth=3,embed_dim=48,"
            "num_heads=3")


HF_TINY = {  # random weights from a configuration: no network
    "gpt2": "hf:gpt2,pretrained=0,n_layer=2,n_embd=32,n_head=2,vocab_size=300,n_positions=64",
    "bert": "hf:bert,pretrained=0,num_hidden_layers=2,hidden_size=32,num_attention_heads=2,"
            "intermediate_size=64,vocab_size=300,max_position_embeddings=64",
    "opt": "hf:opt,pretrained=0,num_hidden_layers=2,hidden_size=32,num_attention_heads=2,"
           "ffn_dim=64,vocab_size=300,max_position_embeddings=64,word_embed_proj_dim=32"}


HF_MAE = ("hf:vit_mae,pretrained=0,num_hidden_layers=2,hidden_size=32,num_attention_heads=2,"
          "intermediate_size=64,image_size=16,patch_size=4")


def byte_level_tokenizer(folder):
    """A Hugging Face tokenizer saved to a folder, made offline: one id per byte, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return folder


def look_cli(capsys, *argv):
    code = look.main([str(a) for a in argv])
    return code, capsys.readouterr()


def png_size(path):
    with Image.open(path) as image:
        return image.size


def readme_commands(*pages):
    """The train.py, torchrun, look.py, probe.py and mkdir commands of the pages' bash blocks, in
    order, as argument lists."""
    commands = []
    for page in pages:
        text = open(os.path.join(REPO, page)).read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                argv = line.split("#")[0].split()
                if "train.py" in argv or argv[:2] in (["python", "look.py"], ["python", "probe.py"],
                                                      ["mkdir", "-p"]):
                    commands.append(argv)
    return commands


def source_spans(path):
    """{name: (first line, last line)} of a file's functions, classes, 'Class.method's, module
    names, "NAME's docstring"s, '' (its docstring) and (train.py) TRAIN_PARTS."""
    source = open(os.path.join(REPO, path)).read()
    tree, lines = ast.parse(source), source.splitlines()
    spans = {}
    if ast.get_docstring(tree) is not None:
        spans[""] = (tree.body[0].lineno, tree.body[0].end_lineno)

    def visit(body, prefix):
        for node in body:
            names = [prefix + node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
                prefix + t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                if isinstance(t, ast.Name)]
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            spans.update(dict.fromkeys(names, (first, node.end_lineno)))
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node):
                spans[f"{names[0]}'s docstring"] = (node.body[0].lineno, node.body[0].end_lineno)
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for text, (function, *openings) in TRAIN_PARTS.items() if path == "train.py" else ():
        begun = [next((n for n in ast.walk(functions[function]) if isinstance(n, ast.stmt)
                       and lines[n.lineno - 1].strip().startswith(o)), None) for o in openings]
        spans[text] = None if None in begun else (begun[0].lineno, begun[-1].end_lineno)
    return spans


# README links into train.py's functions: their text -> the function, and how the first (and the
# last) statement they mark begin
TRAIN_PARTS = {"its set-up": ("train", "def train", "if step >= cfg.max_iters"),
               "the step itself": ("train", "clock = progress.Clock", "step += 1"),
               "the rest of its loop": ("train", "bar.update(1)", "if stopping:"),
               "the same generator on every rank": ("train", "generator = torch.Generator()",
                                                    "torch.manual_seed(cfg.seed + 1 + rank)"),
               "the checkpoint's dict": ("train", "state = {", "if improved:"),
               "each group's rate set": ("train", "lr = get_lr(step, cfg)",
                                         "for group in optimizer.param_groups"),
               "the global batch drawn, then this rank's slice": ("train", "draws = data.sample",
                                                                  "part = shard"),
               "every rank's random state": ("train", "if not evaluating:",
                                             "rng = checkpoint.random_states"),
               "a resumed run's state put back": ("train", "if resumed is not None"),
               "under `torch.random.fork_rng`": ("evaluate", "with torch.random.fork_rng",
                                                 "torch.manual_seed(seed)")}
README_LINK = r"\[([^\[\]]+)\]\(((?:operations/)?\w+\.py)#L(\d+)-L(\d+)\)"
POINTER = r"`((?:operations/)?\w+\.py):([\w.]+)`"


def linked_name(text, path):
    """What a README link's text names in the file it links to (as source_spans names it), or
    None."""
    named = re.fullmatch(POINTER + "('s docstring)?", text)
    if named:
        return named[2] + (named[3] or "") if named[1] == path else None
    known = {f"`{path}`'s docstring": ""}
    if path == "train.py":
        known.update({part: part for part in TRAIN_PARTS})
    return known.get(text)


def readme_links(text):
    """Each README link (its match) with the lines its name has now (None: it names nothing)."""
    spans = {}
    for link in re.finditer(README_LINK, text):
        if link[2] not in spans:
            spans[link[2]] = source_spans(link[2]) if link[2] in REFERENCE_FILES else {}
        yield link, spans[link[2]].get(linked_name(link[1], link[2]))


def relink_readme(path=os.path.join(REPO, "README.md")):
    """README.md's links set to the lines their names have now, after an edit moved code:
    python -c "import test_all; test_all.relink_readme()" """
    text, parts, end = open(path).read(), [], 0
    for link, span in readme_links(text):
        if span is None:
            raise ValueError(f"README.md's link {link[0]} names nothing in {link[2]}; mend it")
        parts += [text[end:link.start()], f"[{link[1]}]({link[2]}#L{span[0]}-L{span[1]})"]
        end = link.end()
    open(path, "w").write("".join(parts) + text[end:])


REFERENCE_FILES = ("bamboo.py", "neutreno.py", "probe.py", "data.py", "train.py", "test_all.py",
                   "bench.py", "look.py", *sorted(f"operations/{name}" for name in
                                                  os.listdir(os.path.join(REPO, "operations"))
                                                  if name.endswith(".py")))


def instance_attributes(model):
    """Every module's own attributes (its __dict__, less PyTorch's registries), by module name."""
    registries = {"_parameters", "_buffers", "_modules"}
    return {name: {key: value for key, value in vars(module).items() if key not in registries}
            for name, module in model.named_modules()}


TUTORIAL = ("bamboo.py", "neutreno.py", "data.py", "train.py", "probe.py")


# PIL: torchvision's reader; matplotlib: the probe's figure (probe.py --plot)
PACKAGES = {"torch", "torchvision", "numpy", "tiktoken", "tqdm", "PIL", "matplotlib"}


# The import order, lowest first: a module imports only modules before it (operations/__init__.py)
LAYERS = ("neutreno", "bamboo", "operations.cli", "operations.checkpoint", "operations.fast",
          "operations.figures", "operations.files", "operations.adapters", "operations.hub", "data",
          "operations.streaming", "operations.checks", "operations.out_dir", "operations.runlog",
          "operations.progress", "probe", "operations.export", "train", "look", "bench")


# ==================================================================================================
# 1. bamboo.py: the trunk, the four objectives, configs and presets, one init for every arm
# ==================================================================================================

@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_objective_shapes_loss_and_gradients(objective):
    torch.manual_seed(0)
    c = tiny(objective, pool="cls" if objective == "cls" else "mean")
    model = Bamboo(c)
    x, y = batch(c)
    out, loss = model(x, y)  # next: the last position's logits, what follows x
    expected = {"mae": (4, c.num_patches(), c.patch_size ** 2 * c.channels),
                "cls": (4, c.num_classes),
                "mlm": (4 * c.num_chosen(c.seq_len), c.vocab_size),  # the chosen positions
                "next": (4, 1, c.vocab_size)}[objective]
    assert out.shape == expected and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None
               or not p.grad.abs().sum() > 0]
    # positions beyond the window and the [MASK] row may get nothing
    if objective in ("mlm", "next"):
        missing = [n for n in missing if n not in ("pos_embed", "tok_embed.weight")]
    assert missing == []


def test_hidden_states_cover_every_layer_and_token_match_the_forward_pass_and_weigh_on_request():
    for objective in ("mae", "cls", "mlm", "next"):
        c = tiny(objective, depth=3)
        x, _ = batch(c)
        hs = Bamboo(c).hidden_states(x)
        T = c.num_patches() if c.is_image else c.seq_len
        assert len(hs) == c.depth + 1 and all(h.shape == (4, T, c.width) for h in hs)
    torch.manual_seed(0)
    model = Bamboo(tiny("cls")).eval()
    x, y = batch(model.config)
    logits, _ = model(x, y)
    last = model.hidden_states(x)[-1]
    assert torch.allclose(model.head(model.fc_norm(last.mean(1))), logits, atol=1e-6)
    c = tiny("next", depth=3)  # the attention probabilities, on request
    hs, attns = Bamboo(c).hidden_states(batch(c)[0], need_weights=True)
    assert len(attns) == 3 and attns[0].shape == (4, c.heads, c.seq_len, c.seq_len)
    assert torch.allclose(attns[1].sum(-1), torch.ones(4, c.heads, c.seq_len), atol=1e-5)
    assert attns[2][0, 0].triu(1).abs().max() == 0  # causal: no weight on the future


def test_sdpa_path_equals_explicit_softmax_path():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 10, 8).unbind(0)
    for causal in (False, True):
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(fused, explicit_attention(q, k, v, causal)[0], atol=1e-5)
    c = tiny("mlm", neutreno=0.6, depth=3)
    model = Bamboo(c).eval()
    x, _ = batch(c)
    with_probs, _ = model.hidden_states(x, need_weights=True)
    for a, b in zip(with_probs, model.hidden_states(x)):
        assert torch.allclose(a, b, atol=1e-5)


def test_auto_picks_explicit_attention_only_for_cpu_half_precision_and_bench_may_ask_for_either():
    def explicit(config, device, dtype, asked="auto"):
        chosen = fast.use_explicit_attention(asked, torch.device(device), dtype, config)
        return {m.explicit for m in Bamboo(config, explicit_attention=chosen).modules()
                if isinstance(m, Attention)}

    assert explicit(tiny("mae"), "cpu", torch.bfloat16) == {True}  # the decoder's blocks too
    assert explicit(tiny("cls"), "cpu", torch.float32) == {False}  # fp32: the fused kernel wins
    assert explicit(tiny("next", seq_len=257), "cpu", torch.bfloat16) == {False}  # long: memory
    assert explicit(tiny("cls"), "meta", torch.bfloat16) == {False}  # not a CPU
    # bench.py asks for either, where auto would pick the other
    assert explicit(tiny("cls"), "cpu", torch.bfloat16, "sdpa") == {False}
    assert explicit(tiny("cls"), "meta", torch.float32, "explicit") == {True}


def test_explicit_attention_in_bf16_is_as_accurate_as_the_fused_kernel(monkeypatch):
    fused_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(neutreno.F, "scaled_dot_product_attention",
                        lambda *a, **k: fused_calls.append(1) or sdpa(*a, **k))
    torch.manual_seed(0)
    for causal in (False, True):
        attns = {path: Attention(128, 2, causal=causal, neutreno=0.6, explicit=path == "explicit")
                 for path in ("fused", "explicit")}
        attns["explicit"].load_state_dict(attns["fused"].state_dict())
        x, v0 = torch.randn(4, 64, 128, requires_grad=True), torch.randn(4, 2, 64, 64)
        reference = attns["fused"](x, v0)[0]  # fp32: the fused kernel
        grad_ref, = torch.autograd.grad(reference.sum(), x)
        errors = {}
        for path, attn in attns.items():
            fused_calls.clear()
            with torch.autocast("cpu", torch.bfloat16):
                out = attn(x, v0)[0].float()
            grad, = torch.autograd.grad(out.sum(), x)
            assert len(fused_calls) == (1 if path == "fused" else 0)
            errors[path] = [((a - b).norm() / b.norm()).item()
                            for a, b in ((out, reference), (grad, grad_ref))]
        for explicit, fused in zip(errors["explicit"], errors["fused"]):
            # bf16 rounding, no worse than the fused kernel's
            assert explicit < 0.01 and explicit < 1.5 * fused


def test_causal_outputs_ignore_the_future():
    for lam in (0.0, 0.4):
        torch.manual_seed(0)
        model = Bamboo(tiny("next", neutreno=lam, depth=3)).eval()
        x, _ = batch(model.config)
        t = 7
        changed = x.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 5) % 64
        a, b = model.hidden_states(x), model.hidden_states(changed)
        for ha, hb in zip(a, b):
            assert torch.equal(ha[:, : t + 1], hb[:, : t + 1])
        assert not torch.equal(a[-1][:, t + 1:], b[-1][:, t + 1:])  # later tokens did change


def test_mae_masking_keeps_the_right_number_restores_order_and_patchify_round_trips():
    torch.manual_seed(0)
    x = torch.randn(3, 64, 8)
    for ratio in (0.75, 0.5, 0.9):
        ids_keep, mask, ids_restore = random_masking(3, 64, ratio)
        visible = take_tokens(x, ids_keep)
        keep = round(64 * (1 - ratio))
        assert visible.shape == (3, keep, 8) and (mask.sum(1) == 64 - keep).all()
        # gathering the shuffled sequence with ids_restore gives back the original order
        ids_shuffle = ids_restore.argsort(1)
        shuffled = x.gather(1, ids_shuffle[..., None].expand(-1, -1, 8))
        assert torch.equal(shuffled.gather(1, ids_restore[..., None].expand(-1, -1, 8)), x)
        assert torch.equal(shuffled[:, :keep], visible)
        kept = (mask == 0)
        assert torch.equal(x[kept].reshape(3, keep, 8).sort(1).values, visible.sort(1).values)
    imgs = torch.randn(2, 3, 16, 16)  # patches, row-major, and back
    p = patchify(imgs, 4)
    assert p.shape == (2, 16, 48) and torch.equal(unpatchify(p, 4, 3), imgs)
    assert torch.equal(p[0, 1], imgs[0, :, 0:4, 4:8].permute(1, 2, 0).reshape(-1))
    # the stem embeds only the visible patches: as embedding all, then masking (to 1e-6)
    model = Bamboo(tiny("mae")).eval()
    imgs, _ = batch(model.config)
    noise = torch.rand(4, model.config.num_patches())
    h, mask, ids_restore = model.embed(imgs, 0.75, noise)
    ids_keep = noise.argsort(1)[:, : h.shape[1]]
    assert h.shape[1] == round(0.25 * model.config.num_patches())
    assert torch.allclose(h, take_tokens(model.embed(imgs)[0], ids_keep), atol=1e-6)


def test_mae_loss_covers_masked_patches_only_and_encoder_sees_visible_only():
    torch.manual_seed(0)
    for norm_pix in (False, True):
        model = Bamboo(tiny("mae", norm_pix_loss=norm_pix)).eval()
        imgs, _ = batch(model.config)
        noise = torch.rand(4, model.config.num_patches())
        latent, mask, ids_restore = model.forward_encoder(imgs, 0.75, noise)
        pred = model.forward_decoder(latent, ids_restore)
        loss = model.forward_loss(imgs, pred, mask)
        pixel_mask = unpatchify(mask[..., None].expand(-1, -1, 48), 4, 3)  # 1 on hidden pixels
        # the loss ignores the visible patches' targets
        visible_changed = imgs + (1 - pixel_mask) * torch.randn_like(imgs)
        assert torch.allclose(model.forward_loss(visible_changed, pred, mask), loss)
        # the encoder never sees hidden patches: changing them leaves the prediction as it is
        hidden_changed = imgs + pixel_mask * torch.randn_like(imgs)
        pred2, loss2 = model.forward_mae(hidden_changed, noise=noise)
        assert torch.allclose(pred2, pred, atol=1e-6) and not torch.allclose(loss2, loss)
        # ...while changing a visible patch does reach it
        assert not torch.allclose(model.forward_mae(visible_changed, noise=noise)[0], pred)


def test_mlm_chooses_berts_exact_count_per_window_and_corrupts_80_10_10():
    torch.manual_seed(0)
    model = Bamboo(tiny("mlm", vocab_size=1000))
    tokens = torch.randint(0, 1000, (64, 1024))  # 65,536 positions
    inputs, targets = model.mask_tokens(tokens)
    chosen = targets != -100
    assert (chosen.sum(1) == round(0.15 * 1024)).all()  # exactly k in every window, not about k
    n = chosen.sum().item()
    # Binomial standard errors of the splits: about 0.4%; allow ~5 sigma.
    masked = (inputs == model.mask_id) & chosen
    unchanged = (inputs == tokens) & chosen
    assert abs(masked.sum().item() / n - 0.80) < 0.02
    # "random" can land on the original id with probability 1/1000; it counts as unchanged here
    assert abs(unchanged.sum().item() / n - 0.10) < 0.015
    assert abs((chosen & ~masked & ~unchanged).sum().item() / n - 0.10) < 0.015
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    assert torch.equal(targets[chosen], tokens[chosen])
    # positions anywhere in the window are as likely (about 4,900 chosen per half: ~5 sigma is 0.01)
    first, second = chosen[:, :512].float().mean().item(), chosen[:, 512:].float().mean().item()
    assert abs(first - second) < 0.01 and chosen.any(0).float().mean() > 0.99
    # a window too short for 15% still gets one position, as BERT's max(1, round(...))
    assert ((model.mask_tokens(tokens[:, :3])[1] != -100).sum(1) == 1).all()


def test_table1_comparable_compute_and_training_flops_count_the_mlm_head_only_where_it_runs():
    def size(name):
        with torch.device("meta"):  # shapes only: no memory, no init time
            model = Bamboo(Config.from_preset(name, image_size=224, patch_size=16,
                                              num_classes=1000))
        return model.num_params(trunk_only=True), training_flops(model.config)

    (p_base, f_base), (p_bam, f_bam) = size("base-12x768"), size("bamboo-b")
    assert abs(p_bam / p_base - 1) < 0.05 and abs(f_bam / f_base - 1) < 0.05 and 80e6 < p_bam < 90e6
    # Table 1's 0.9x rows hold within 5% as well
    assert abs(size("base-24x512")[0] / p_base - 0.9) < 0.05
    assert abs(size("large-48x768")[0] / size("large-24x1024")[0] - 1.1) < 0.05
    shape = dict(depth=2, width=64, heads=1, vocab_size=1000, seq_len=32)  # MLM's head: where run
    trunk = training_flops(Config(objective="next", **shape)) - 3 * 2 * 32 * 64 * 1000  # no head
    head = 3 * 5 * (2 * 64 * 64 + 2 * 64 * 1000)  # transform + vocabulary at round(15% of 32) = 5
    assert training_flops(Config(objective="mlm", mlm_prob=0.15, **shape)) == pytest.approx(
        trunk + head)


@pytest.mark.parametrize("objective", ["mae", "next"])  # the image and the text path; every head
def test_bamboo_b_runs_forward_and_backward_on_cpu(objective):  # at small scale: section 1's start
    torch.manual_seed(0)
    # the trunk is the point
    model = Bamboo(Config.from_preset("bamboo-b", objective=objective, vocab_size=1000))
    assert 84e6 < model.num_params(trunk_only=True) < 86e6
    # small: 48 blocks
    x = torch.rand(2, 3, 32, 32) if model.config.is_image else torch.randint(0, 1000, (2, 64))
    y = torch.randint(0, 10, (2,)) if objective == "cls" else None
    _, loss = model(x, y)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[-1].mlp.fc.weight.grad is not None


def test_every_preset_builds_a_valid_config_and_the_papers_is_maes_224_pixels():
    for name in PRESETS:
        c = Config.from_preset(name)
        assert c.width % c.heads == 0 and c.width // c.heads in (32, 64, 80, 96)
    c = Config.from_preset("bamboo-b-224", objective="mae")  # in 16-pixel patches
    assert (c.depth, c.width, c.heads, c.image_size, c.patch_size) == (48, 384, 6, 224, 16)
    assert c.num_patches() == 196 and (c.decoder_depth, c.decoder_width) == (8, 512)
    assert c.norm_pix_loss
    with pytest.raises(ValueError, match="unknown preset"):
        Config.from_preset("bamboo-xl")
    with pytest.raises(ValueError, match="unknown config fields"):
        Config.from_preset("bamboo-b", widht=3)


@pytest.mark.parametrize("field,value", [
    ("objective", "gan"), ("depth", 0), ("heads", 5), ("mlp_ratio", 0), ("dropout", 1.0),
    ("drop_path", -0.1), ("patch_size", 5), ("pool", "max"), ("num_classes", 1), ("vocab_size", 1),
    ("seq_len", 1), ("mask_ratio", 0.0), ("mask_ratio", 1.0), ("mask_ratio", 0.999),
    ("decoder_heads", 5), ("decoder_width", 30), ("mlm_prob", 1.5), ("neutreno", -0.1),
    ("channels", 0)])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Config\.{field}="):
        Config(**{field: value})


def test_wrong_input_shape_is_a_clear_error():
    model = Bamboo(tiny("cls"))
    with pytest.raises(ValueError, match="expected images"):
        model(torch.rand(2, 3, 32, 32))
    text = Bamboo(tiny("next"))  # seq_len 16: 16 inputs, and a 17th token that is only a target
    for wrong in (torch.randint(0, 64, (2, 18)), torch.rand(2, 9), torch.randint(0, 64, (2, 1))):
        shape = re.escape(str(tuple(wrong.shape)))
        with pytest.raises(ValueError, match=r"T <= seq_len \+ 1 = 17 .*got " + shape):
            text(wrong)  # the shape the caller passed, not the shifted inputs
    assert text.next_token_features(torch.randint(0, 64, (2, 17)))[0].shape == (2, 16, 32)


@pytest.mark.parametrize("objective,steps,lr", [("cls", 150, 3e-3), ("mae", 400, 2e-3),
                                                ("mlm", 800, 2e-3), ("next", 150, 3e-3)])
def test_tiny_model_overfits_one_batch(objective, steps, lr):
    torch.manual_seed(0)
    c = tiny(objective, width=64, depth=2, decoder_width=64, vocab_size=32)
    model = Bamboo(c)
    x, y = batch(c, B=8)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1 - it / steps)  # settles, not hovers
    first = None
    for _ in range(steps):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    model.eval()  # measure without the random corruption of this step's draw
    torch.manual_seed(1)
    final = sum(model(x, y)[1].item() for _ in range(5)) / 5
    assert final < 0.1 * first, f"{objective}: loss {first:.3f} -> {final:.3f}"


def test_load_mae_encoder_into_cls_takes_the_trunk_and_leaves_the_head_fresh():
    torch.manual_seed(0)
    mae = Bamboo(tiny("mae"))
    cls = Bamboo(tiny("cls"))
    loaded, skipped = cls.load_encoder(mae.state_dict())
    assert loaded and all(n.startswith(("blocks.", "patch_embed")) for n in loaded)
    assert {"ln_f.weight", "ln_f.bias"} <= set(skipped)
    assert any(n.startswith("decoder_") for n in skipped)
    own = cls.state_dict()
    assert all(torch.equal(own[n], mae.state_dict()[n]) for n in loaded)
    assert sorted(n for n in own if n not in loaded) == ["fc_norm.bias", "fc_norm.weight",
                                                         "head.bias", "head.weight"]


def test_the_classifier_pools_normalises_and_classifies_as_mae_fine_tuning_and_smooths_labels():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls"))
    assert not hasattr(model, "ln_f") and model.head.weight.std().item() < 1e-4  # std 2e-5
    with torch.no_grad():
        model.fc_norm.weight.normal_()
        model.head.weight.normal_()
        x, _ = batch(model.config)
        expected = model.head(model.fc_norm(model.hidden_states(x)[-1].mean(dim=1)))
        assert torch.allclose(model(x)[0], expected, atol=1e-6)
    model = Bamboo(tiny("cls", num_classes=4, label_smoothing=0.1))
    x, y = batch(model.config)
    logits, loss = model(x, y)  # the cross-entropy against smoothed targets
    targets = F.one_hot(y, 4).float() * 0.9 + 0.1 / 4
    assert torch.allclose(loss, -(targets * logits.log_softmax(-1)).sum(-1).mean(), atol=1e-6)
    plain = Bamboo(tiny("cls", num_classes=4))
    plain.load_state_dict(model.state_dict())
    plain_loss = plain(x, y)[1]
    assert torch.allclose(plain_loss, F.cross_entropy(logits, y), atol=1e-6) and loss != plain_loss
    with pytest.raises(ValueError, match="Config.label_smoothing=1.0 must be in"):
        tiny("cls", label_smoothing=1.0)


@pytest.mark.parametrize("pair", [("cls", "mae"), ("next", "mlm")])
@pytest.mark.parametrize("options", [{}, {"pool": "cls", "decoder_depth": 3, "num_classes": 7},
                                     {"neutreno": 0.6}])
def test_same_seed_gives_bit_identical_trunks_whatever_the_objective(pair, options):
    states = []
    for i, objective in enumerate(pair):
        torch.manual_seed(3)
        states.append(trunk_state(Bamboo(tiny(objective, **(options if i else {})))))
    assert states[0].keys() == states[1].keys() and len(states[0]) > 10
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_vo_param_changes_the_blocks_but_not_the_stem():
    """smooth and sharpen build every block's W_V W_O from an eigenbasis (no learned gain before
    attention); the stem is the same for all three."""
    stems, blocks = [], []
    for mode in ("free", "smooth", "sharpen"):
        torch.manual_seed(0)
        model = Bamboo(tiny("cls", vo_param=mode))
        stems.append(model.patch_embed.weight)
        blocks.append({(type(b.attn).__name__, b.attn.vo.mode if mode != "free" else None,
                        b.ln1.weight is None) for b in model.blocks})
    assert torch.equal(stems[0], stems[1]) and torch.equal(stems[0], stems[2])
    assert blocks == [{("Attention", None, False)}, {("EigenAttention", "smooth", True)},
                      {("EigenAttention", "sharpen", True)}]


def test_residual_projections_get_the_depth_scaled_init_and_one_seed_gives_beta_one():
    torch.manual_seed(0)
    model = Bamboo(tiny("mae", depth=8, width=64, decoder_depth=2, decoder_width=64))
    encoder, decoder = (torch.cat([p.flatten() for n, p in blocks.named_parameters()
                                   if n.endswith("proj.weight")])
                        for blocks in (model.blocks, model.decoder_blocks))
    assert encoder.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert decoder.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for first, second in (("cls", "mae"), ("next", "mlm")):  # one seed: beta exactly one
        models = []
        for objective in (first, second):
            torch.manual_seed(0)
            models.append(Bamboo(tiny(objective, depth=4)))
        qk, v = beta(models[1], models[0])
        assert qk == [1.0] * 4 and v == [1.0] * 4


def test_mae_masks_and_mlm_corruption_differ_from_step_to_step():
    torch.manual_seed(0)
    for objective in ("mae", "mlm"):
        model = Bamboo(tiny(objective))
        x, y = batch(model.config)
        losses = {model(x, y)[1].item() for _ in range(4)}
        assert len(losses) == 4, objective  # a fresh mask every call, from the (per-rank) torch RNG


# ==================================================================================================
# 2. neutreno.py: attention, the NeuTRENO term, the W_V W_O eigen-parameterization
# ==================================================================================================

def test_neutreno_leaves_layer_zero_changes_later_layers_and_matches_the_formula():
    torch.manual_seed(0)
    plain = Bamboo(tiny("cls", depth=3))
    torch.manual_seed(0)
    neu = Bamboo(tiny("cls", depth=3, neutreno=0.6))
    x, _ = batch(plain.config)
    hp, hn = plain.hidden_states(x), neu.hidden_states(x)
    assert torch.equal(hp[0], hn[0]) and torch.equal(hp[1], hn[1])  # stem and block 0
    assert not torch.allclose(hp[2], hn[2]) and not torch.allclose(hp[3], hn[3])
    attn = Attention(32, 2, neutreno=0.6)
    x, v0 = torch.randn(2, 5, 32), torch.randn(2, 2, 5, 16)
    q, k, v = (t.view(2, 5, 2, 16).transpose(1, 2) for t in attn.qkv(x).split(32, dim=2))
    o = explicit_attention(q, k, v)[0] + 0.6 * (v0 - v)
    expected = attn.proj(o.transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(attn(x, v0)[0], expected, atol=1e-6)
    attn = Attention(32, 2, neutreno=0.0)  # lambda 0: plain attention, exactly
    assert torch.equal(attn(x, v0)[0], attn(x)[0])


def test_neutreno_gradient_reaches_layer_zero_values_through_v0():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=3, neutreno=0.6))
    x, _ = batch(model.config)
    model.hidden_states(x)[-1].pow(2).sum().backward()
    width, c = model.config.width, model.config
    with_term = model.blocks[0].attn.qkv.weight.grad[2 * width:].clone()  # W_V rows of layer 0
    model.zero_grad()
    # The same loss with the later layers' V0 cut off from layer 0: layer 0's W_V gradient changes.
    h, v0, _ = model.blocks[0](model.embed(x)[0])
    for block in model.blocks[1:]:
        h, v, _ = block(h, v0.detach())
        assert v is None  # only layer 0 hands its values on
    h.pow(2).sum().backward()
    assert v0.shape == (4, c.heads, c.num_patches(), width // c.heads)  # (B, nh, T, hs)
    plain = Bamboo(tiny("cls", depth=3))
    assert plain.blocks[0](plain.embed(x)[0])[1] is None  # without NeuTRENO: no values handed on
    assert not torch.allclose(with_term, model.blocks[0].attn.qkv.weight.grad[2 * width:])


def test_neutreno_detach_keeps_the_forward_and_cuts_only_the_gradient_path_to_v0():
    """neutreno_detach: the same outputs and loss; the same gradients in every block after layer 0
    and in the head; other gradients in layer 0 and the stem, which V0's path no longer reaches."""
    x, y = batch(tiny("cls"))
    grads, losses = [], []
    for detach in (False, True):
        torch.manual_seed(0)
        model = Bamboo(tiny("cls", depth=3, neutreno=0.6, neutreno_detach=detach))
        out, loss = model(x, y)
        loss.backward()
        losses.append((out.detach(), loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])
    same = {n for n in grads[0] if torch.equal(grads[0][n], grads[1][n])}
    assert {n for n in grads[0] if n.startswith(("blocks.1.", "blocks.2.", "head."))} <= same
    assert "blocks.0.attn.qkv.weight" not in same and "patch_embed.proj.weight" not in same
    with pytest.raises(ValueError, match="neutreno_detach=True applies to NeuTRENO only"):
        tiny("cls", neutreno_detach=True)


@pytest.mark.parametrize("objective", ["cls", "mlm"])
def test_neutreno_lowers_last_layer_cosine_at_init(objective):
    """NeuTRENO G.3: a randomly initialised 24-layer model smooths less with the term on."""
    cos = {}
    for lam in (0.0, 0.6):
        torch.manual_seed(0)
        model = Bamboo(Config(objective=objective, depth=24, width=64, heads=1, neutreno=lam,
                              vocab_size=256, seq_len=64)).eval()
        x, _ = batch(model.config, B=8, seed=1)
        with torch.no_grad():
            cos[lam] = mean_cos(model.hidden_states(x)[-1])
    assert cos[0.6] < cos[0.0]


@pytest.mark.parametrize("mode", ["smooth", "sharpen"])
@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_vo_param_spectra_hold_at_init_and_after_training(mode, objective):
    torch.manual_seed(0)
    c = tiny(objective, vo_param=mode, neutreno=0.6, decoder_width=32)
    model = Bamboo(c)
    assert_spectra(model, mode)
    dominant, positive = vo_spectrum(model)
    assert dominant == [1.0 if mode == "smooth" else -1.0] * c.depth
    assert positive == [1.0 if mode == "smooth" else 0.0] * c.depth
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # large steps: push psi past the clip
    x, y = batch(c)
    for _ in range(5):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert_spectra(model, mode)


def test_vo_param_gradients_reach_psi_and_the_qr_input_and_its_eigenvalues_are_the_probes():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", vo_param="sharpen"))
    x, y = batch(model.config)
    model(x, y)[1].backward()
    for block in model.blocks:
        assert block.attn.vo.psi.grad.abs().sum() > 0 and block.attn.vo.basis.grad.abs().sum() > 0
    assert not hasattr(model.blocks[0].attn, "qkv") and model.blocks[0].ln1.weight is None
    block = model.blocks[0]
    eigs = torch.linalg.eigvalsh(head_value_output(block))  # symmetric (hs, hs) per head
    assert torch.allclose(eigs, block.attn.vo.eigenvalues().double().sort(-1).values, atol=1e-6)


def test_smooth_model_reads_smoother_than_sharpen_at_init_on_cos_hc_dc_and_erank():
    """At init a smooth trunk's last layer is more alike than a sharpen one's by cos, HC/DC and
    effective rank (abs_cos_centered barely tells them apart there: 0.363 against 0.367)."""
    last = {}
    for mode in ("smooth", "sharpen"):
        model, _ = probe.load_model(f"init:cifar-deep,vo_param={mode}", "folder")
        x, _ = batch(model.config, B=8, seed=1)
        last[mode] = {k: v[-1] for k, v in probe.probe_model(model, x, 8).items()}
    assert last["smooth"]["cos"] > last["sharpen"]["cos"]
    assert last["smooth"]["hc_dc"] < last["sharpen"]["hc_dc"]
    assert last["smooth"]["erank"] < last["sharpen"]["erank"]


# ==================================================================================================
# 3. data.py: images and text to the device, image folders (streamed too), downloads
# ==================================================================================================

def test_a_decoded_folder_is_cached_and_a_changed_folder_decoded_again(tiny_data, tmp_path,
                                                                        monkeypatch, capsys):
    folder, cache = tmp_path / "images", tmp_path / "cache"
    shutil.copytree(tiny_data / "images", folder)
    decoded = ImageData("folder", str(folder), "cpu", 16)  # no cache_dir: nothing kept
    capsys.readouterr()
    first = ImageData("folder", str(folder), "cpu", 16, cache_dir=str(cache))
    assert len(list(cache.glob("images.*.npy"))) == 2  # train and test
    assert "decoded 96 images in " in capsys.readouterr().out  # how many, how long, where kept
    decodes = []
    real_decode = files._decode
    monkeypatch.setattr(files, "_decode", lambda *a: decodes.append(a) or real_decode(*a))
    cached = ImageData("folder", str(folder), "cpu", 16, cache_dir=str(cache))
    (tmp_path / "link").symlink_to(folder)  # the same files through a link: the same cache
    ImageData("folder", str(tmp_path / "link"), "cpu", 16, cache_dir=str(cache))
    assert decodes == []  # loaded, not decoded
    for got in (first, cached):
        assert torch.equal(got.train_x, decoded.train_x) and torch.equal(got.test_x, decoded.test_x)
        assert torch.equal(got.train_y, decoded.train_y) and torch.equal(got.mean, decoded.mean)
    changed = sorted((folder / "test" / "red").iterdir())[0]  # one test image repainted
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(changed)
    again = ImageData("folder", str(folder), "cpu", 16, cache_dir=str(cache))
    assert len(decodes) == 32 and len(list(cache.glob("images.*.npy"))) == 3  # test split only
    where = [str(p) for p, _ in files.list_folder(str(folder))[0]["test"]].index(str(changed))
    assert again.test_x[where].max() == 0 and torch.equal(again.train_x, decoded.train_x)
    Image.fromarray(np.full((16, 16, 3), 7, np.uint8)).save(changed)
    ImageData("folder", str(folder), "cpu", 16, cache_dir=str(cache))
    kept = os.stat(changed)  # painted again at the same size, its time set back: decoded again
    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(changed)
    assert os.path.getsize(changed) == kept.st_size
    os.utime(changed, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    repainted = ImageData("folder", str(folder), "cpu", 16, cache_dir=str(cache))
    assert repainted.test_x[where].min() == 128 and len(decodes) == 96
    for damaged in cache.glob("images.*.npy"):  # a damaged cache is decoded again and replaced
        damaged.write_bytes(b"not an array")
    assert torch.equal(ImageData("folder", str(folder), "cpu", 16,
                                      cache_dir=str(cache)).train_x, decoded.train_x)
    assert len(decodes) == 32 * 4 + 96
    listing = files.list_folder(str(folder))[0]  # the two files in use now hold arrays again
    keys = [files.folder_key(listing[s], 16) for s in ("train", "test")]
    assert [np.load(cache / key).shape[0] for key in keys] == [96, 32]
    capsys.readouterr()
    (tmp_path / "file").write_text("")  # a cache_dir that cannot be made: decoded, said, goes on
    unwritable = ImageData("folder", str(folder), "cpu", 16, cache_dir=str(tmp_path / "file"))
    assert torch.equal(unwritable.train_x, decoded.train_x)
    note = capsys.readouterr().out
    assert note.count("note: decoded images not cached") == 2, note
    assert "decoded 96 images in " in note and "kept in" not in note  # said, and not kept


def test_train_samples_keeps_one_fixed_subset_and_image_size_is_honoured(tiny_data):
    first = ImageData("folder", str(tiny_data / "images"), "cpu", image_size=8, train_samples=10)
    again = ImageData("folder", str(tiny_data / "images"), "cpu", image_size=8, train_samples=10)
    assert first.num_train() == 10 and torch.equal(first.train_x, again.train_x)
    # the test split stays whole
    assert first.train_x.shape[1:] == (3, 8, 8) and len(first.test_x) == 32
    assert set(first.train_y.tolist()) == {0, 1}


def test_held_out_data_is_normalised_as_the_checkpoints_training_saw_it(tiny_data, tmp_path):
    """A checkpoint keeps its pixel statistics: held_out with them gives the samples the run itself
    probed and evaluated; an older checkpoint without them falls back to the test split's own."""
    images = ImageData("folder", str(tiny_data / "images"), "cpu", 16)
    cfg = {"dataset": "folder", "data_dir": str(tiny_data / "images")}
    ckpt = {"train": cfg, "statistics": (images.mean, images.std)}
    loaded = held_out(Config(image_size=16), checkpoint.data_settings(ckpt))
    assert torch.equal(first_samples(images, 8), first_samples(loaded, 8))
    older = held_out(Config(image_size=16), checkpoint.data_settings({"train": cfg}))
    assert not torch.equal(first_samples(images, 8), first_samples(older, 8))  # test statistics
    cfg = {"dataset": "text", "data_dir": str(tiny_data / "text"), "tokenizer": "bytes",
           "val_file": "val.txt", "cache_dir": str(tmp_path)}
    text = TextData("text", cfg["data_dir"], "bytes", "train.txt", "val.txt", str(tmp_path), 32,
                    next_token=True)  # as train.py reads a next-token run's text
    loaded = held_out(Config(objective="next", vocab_size=256, seq_len=32), cfg)
    assert torch.equal(first_samples(text, 8), first_samples(loaded, 8))


def test_next_token_windows_train_every_position_and_predict_each_held_out_token_once(tiny_data,
                                                                                      tmp_path):
    """As nanoGPT's block_size + 1: a window holds seq_len inputs and one more token that is only
    a target, so the last position embedding trains too; held-out windows overlap by that token."""
    text = TextData("text", str(tiny_data / "text"), "bytes", "train.txt", "val.txt",
                    str(tmp_path), 32, next_token=True)
    x, _ = text.train_batch(text.sample(4, torch.Generator().manual_seed(0)))
    assert x.shape == (4, 33) and first_samples(text, 2).shape == (2, 32)
    model = Bamboo(tiny("next", seq_len=32, vocab_size=256))
    model(x)[1].backward()
    assert model.pos_embed.grad[0, -1].abs().sum() > 0  # the last position learns
    (a, _), = text.eval_batches(2, 2)
    assert torch.equal(a[0, -1], a[1, 0]) and torch.equal(a[0, 1:], torch.from_numpy(
        text.val[1:33].astype(np.int64)))
    mlm = TextData("text", str(tiny_data / "text"), "bytes", "train.txt", "val.txt",
                   str(tmp_path), 32)
    assert mlm.train_batch(mlm.sample(4, torch.Generator()))[0].shape == (4, 32)


def test_the_token_cache_follows_every_edit_and_an_unwritable_one_is_a_note(tmp_path, capsys):
    """An edit that keeps a text file's size and mtime is tokenized again (ctime is in the key);
    a --cache_dir that cannot be written leaves the tokens in memory, with a note."""
    (tmp_path / "text").mkdir()
    for name in ("train.txt", "val.txt"):
        (tmp_path / "text" / name).write_text("abcdefgh" * 40)
    cache = str(tmp_path / "cache")
    first = TextData("text", str(tmp_path / "text"), "bytes", "train.txt", "val.txt", cache, 16)
    edited = tmp_path / "text" / "train.txt"
    kept = os.stat(edited)
    edited.write_text("zyxwvuts" * 40)  # the same size, its times set back
    os.utime(edited, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    again = TextData("text", str(tmp_path / "text"), "bytes", "train.txt", "val.txt", cache, 16)
    assert first.train[0] == ord("a") and again.train[0] == ord("z")
    (tmp_path / "a-file").write_text("not a folder")
    capsys.readouterr()
    text = TextData("text", str(tmp_path / "text"), "bytes", "train.txt", "val.txt",
                    str(tmp_path / "a-file"), 16)
    assert text.train[0] == ord("z") and "note: tokens not cached (" in capsys.readouterr().out
    assert (tmp_path / "a-file").read_text() == "not a folder"


def test_pixel_statistics_see_every_class_and_need_no_float_copy_of_all_the_images():
    images = torch.cat([torch.zeros(6000, 3, 2, 2), torch.full((6000, 3, 2, 2), 255.)])
    mean, std = normalisation(images.to(torch.uint8))  # 10,000 of them, from both classes
    assert mean.flatten().tolist() == pytest.approx([0.5] * 3, abs=0.02)
    images = (torch.rand(450, 3, 24, 24) * 255).to(torch.uint8)
    one_pass = channel_statistics(images)
    chunked = channel_statistics(images, one_pass_bytes=0)  # as for ImageNet-sized images
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one_pass, chunked))


def test_an_image_over_pils_size_limit_is_one_line_naming_it(tiny_data, monkeypatch):
    """PIL refuses an image over twice its pixel limit (a decompression bomb) with an error of its
    own; here the limit is lowered so that a 16x16 image is one."""
    path = next((tiny_data / "images" / "test").glob("*/*.png"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(files.DataError, match="DecompressionBombError") as e:
        files.read_rgb(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_folder_with_a_constant_channel_trains_and_probes_and_mae_takes_one_class(
        capsys, tiny_data, tmp_path):
    """Images with no blue at all (std 0 in that channel) are centred, never divided by zero into
    NaN inputs; MAE, self-supervised, takes an unlabelled folder of one class."""
    images = write_folder(tmp_path / "images", {"train": ["a", "b"], "test": ["a", "b"]},
                          blue=False)
    x, _ = next(ImageData("folder", str(images), torch.device("cpu"), image_size=16)
                .eval_batches(8))
    assert x.isfinite().all() and x[:, 2].eq(0).all()
    code, out, records = run_train(*image_flags(tiny_data, "cls"), "--data_dir", images,
                                   "--max_iters", "3", out_dir=tmp_path / "o")
    assert code == 0 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records
                             if "loss" in r), out
    assert probe.main(["init:cifar-tiny,image_size=16", "--dataset", "folder", "--data_dir",
                       str(images), "--samples", "8"]) == 0, capsys.readouterr().err
    single = write_folder(tmp_path / "single", {"train": ["all"], "test": ["all"]})
    train_run(tiny_data, "mae", tmp_path / "c", 1, "--data_dir", single)


def test_wikitext_download_checks_the_archive_and_never_deletes_files_it_did_not_write(
        capsys, tmp_path, monkeypatch):
    """A download writes only the splits missing (a user's own files stay); an archive without its
    test split, or no network, leaves nothing behind and says which files would do instead."""
    def fake_zip(members):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for name in members:
                z.writestr(f"wikitext-2-raw/wiki.{name}.raw", f" = {name} = \n" + "word " * 30000)
        return buffer.getvalue()

    seen = []
    monkeypatch.setattr(files, "_fetch",
                        lambda url: seen.append(url) or fake_zip(["train", "valid", "test"]))
    target = files.download_wikitext("wikitext2", str(tmp_path / "ok"))
    assert sorted(os.listdir(target)) == ["test.txt", "train.txt", "valid.txt"]
    assert open(os.path.join(target, "valid.txt")).read().startswith(" = valid = ")
    assert seen == ["https://wikitext.smerity.com/wikitext-2-raw-v1.zip"]
    own = tmp_path / "own" / "wikitext-2-raw"  # a user's train.txt and test.txt: only valid.txt
    own.mkdir(parents=True)
    for split in ("train", "test"):
        (own / f"{split}.txt").write_text(f"the user's own {split}")
    files.download_wikitext("wikitext2", str(tmp_path / "own"))
    assert [(own / f"{s}.txt").read_text()[:20] for s in ("train", "valid", "test")] == [
        "the user's own train", " = valid = \nword wor", "the user's own test"]
    monkeypatch.setattr(files, "_fetch", lambda url: fake_zip(["train", "valid"]))  # no test
    with pytest.raises(files.DataError, match="could not download wikitext2"):
        files.download_wikitext("wikitext2", str(tmp_path / "bad"))
    assert not [p for p in (tmp_path / "bad").rglob("*") if p.is_file()]

    def offline(url, timeout=30):
        raise OSError("no network")

    monkeypatch.setattr(files, "_fetch", offline)
    target = tmp_path / "d" / "wikitext-2-raw"
    target.mkdir(parents=True)
    (target / "train.txt").write_text("the user's own file")  # half of what the message asks for
    wikitext = ["--objective", "next", "--dataset", "wikitext2", "--data_dir", str(tmp_path / "d"),
                "--tokenizer", "bytes"]
    err = cli_error(capsys, *wikitext, "--out_dir", str(tmp_path / "o"))
    assert str(target / "train.txt") in err and str(target / "valid.txt") in err
    assert (target / "train.txt").read_text() == "the user's own file"
    (target / "valid.txt").write_text("word " * 5000)  # following the message: it trains, offline
    code, out, _ = run_train(*wikitext, "--cache_dir", str(tmp_path / "cache"),
                             *TINY_TEXT_FLAGS[:6], "--seq_len", "16", "--max_iters", "1",
                             "--eval_interval", "1", "--batch_size", "2", out_dir=tmp_path / "o")
    assert code == 0, out


def test_streaming_and_decoding_whole_read_the_same_images_and_a_view_is_decided_by_its_seed(
        mixed_jpegs):
    """The same splits, classes and order; the workers replay MAE's training view from each image's
    seed alone, and drawing it never moves the caller's random state (the masks draw from it)."""
    whole = ImageData("folder", str(mixed_jpegs), "cpu", 16, train_samples=100)
    listing = list_folder(str(mixed_jpegs), train_samples=100)
    stream = ImageStream(listing, "cpu", 16)
    paths = stream.files
    assert stream.classes == whole.classes == ["cat", "dog", "fox"]
    assert stream.num_train() == whole.num_train() == 100
    assert stream.num_held_out() == whole.num_held_out() == 45
    assert whole.train_y.tolist() == [label for _, label in paths["train"]]
    assert torch.equal(whole.train_x[7], torch.tensor(_decode(paths["train"][7][0], 16))
                       .permute(2, 0, 1))
    labels = torch.cat([y for _, y in stream.eval_batches(10)])
    assert labels.tolist() == whole.test_y.tolist()
    assert sorted(labels.tolist()) != labels.tolist()  # the fixed shuffle, not class by class
    for i, (path, _) in enumerate(paths["test"][:5]):  # the same images, in the same order
        assert torch.equal(whole.test_x[i], torch.tensor(_decode(path, 16)).permute(2, 0, 1))
    path = str(sorted((mixed_jpegs / "train" / "dog").glob("*.jpg"))[0])
    state = torch.get_rng_state()
    views = [train_view(path, 16, 0.2, seed) for seed in (0, 0, 1)]
    assert torch.equal(torch.get_rng_state(), state)
    assert np.array_equal(views[0], views[1]) and not np.array_equal(views[0], views[2])
    assert views[0].shape == (16, 16, 3) and eval_view(path, 24).shape == (24, 24, 3)


def test_streamed_batches_are_the_same_for_any_worker_count_and_each_rank_decodes_its_slice(
        mixed_jpegs):
    """The draws decide every pixel: no workers, two workers, and two ranks of two micro-batches
    each (their slices put together) give the same global batches, step after step."""
    listing = list_folder(str(mixed_jpegs))

    def batches(workers, rank=0, world=1, accum=1, steps=3):
        stream = ImageStream(listing, "cpu", 16, workers=workers, rank=rank, world=world,
                             grad_accum=accum)
        generator, out = torch.Generator().manual_seed(5), []
        for _ in range(steps):
            draws = stream.sample(8, generator)
            out += [stream.train_batch(shard(draws, rank, world, accum, k)) for k in range(accum)]
        return out

    alone = batches(0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(alone, batches(2)))
    ranks = [batches(2, rank, 2, 2) for rank in (0, 1)]
    for step in range(3):
        parts = [ranks[r][2 * step + k][0] for r in (0, 1) for k in (0, 1)]
        assert torch.equal(torch.cat(parts), alone[step][0])
    assert not torch.equal(alone[0][0], alone[1][0])
    x = alone[0][0]
    assert x.dtype == torch.float32 and x.shape == (8, 3, 16, 16) and -3 < x.mean() < 3


def test_when_stopped_workers_leave_a_micro_batch_this_process_decodes_it_and_restarts_them(
        mixed_jpegs):
    """Workers ended by a signal before handing over a micro-batch: the same pixels, decoded here;
    the next step starts new workers where the data order stands; an evaluation reads on here."""
    def workers_that_exited():
        raise RuntimeError("DataLoader worker (pid(s) 1) exited unexpectedly")
        yield

    listing = list_folder(str(mixed_jpegs))
    steady, stopped = (ImageStream(listing, "cpu", 16, workers=1) for _ in range(2))
    g_steady, g_stopped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for step in range(3):
        expected = steady.train_batch(steady.sample(8, g_steady))
        draws = stopped.sample(8, g_stopped)
        if step == 1:
            stopped.batches = workers_that_exited()
        got = stopped.train_batch(draws)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert (stopped.batches is None) == (step == 1)

    def loader_that_stops_after_one(dataset):
        yield dataset[0]
        raise ConnectionResetError(104, "Connection reset by peer")  # fetching a dead worker's fd

    stopped.loader = loader_that_stops_after_one
    got, expected = list(stopped.eval_batches(10)), list(steady.eval_batches(10))
    assert len(got) == len(expected) == 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


def test_a_worker_killed_mid_run_is_replaced_and_the_batches_stay_the_same(mixed_jpegs):
    """A worker SIGKILLed mid-run (the OOM killer): its batch is decoded here, new workers start,
    every batch is the one a run without the kill reads; torch's error never leaks into the step."""
    listing = list_folder(str(mixed_jpegs))
    steady, killed = ImageStream(listing, "cpu", 16, workers=0), ImageStream(listing, "cpu", 16,
                                                                              workers=2)
    g_steady, g_killed = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for step in range(5):
        expected = steady.train_batch(steady.sample(8, g_steady))
        draws = killed.sample(8, g_killed)
        if step == 2:
            os.kill(killed.batches._workers[0].pid, signal.SIGKILL)
            time.sleep(0.5)  # the SIGCHLD has arrived: nothing may raise outside the read
        got = killed.train_batch(draws)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    killed.batches = None  # no worker left behind


def test_a_streamed_run_resumes_bit_exactly_and_keeps_how_it_read(mixed_jpegs, tmp_path):
    flags = ["--objective", "mae", "--dataset", "folder", "--data_dir", mixed_jpegs,
             *STREAM_FLAGS, "--max_iters", "4", "--eval_interval", "2", "--workers", "2"]
    code, out, whole = run_train(*flags, out_dir=tmp_path / "whole")
    assert code == 0 and "streaming 180 training images from disk, 2 decoding processes" in out
    code, out, _ = run_train(*flags, "--time_limit", "1e-9", out_dir=tmp_path / "parts")
    assert code == 0 and "time limit reached at step 1" in out, out
    code, out, parts = run_train("--resume", "--workers", "1", out_dir=tmp_path / "parts")
    assert code == 0 and "resumed from" in out, out
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True) for d in ("whole", "parts"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert train_losses(parts) == train_losses(whole) and len(train_losses(whole)) == 4
    assert a["train"]["stream"] == "on" and a["train"]["crop_scale"] == 0.2
    images = tmp_path / "images"  # an image added: a stream's resume refuses it too
    shutil.copytree(mixed_jpegs, images)
    flags[flags.index("--data_dir") + 1] = images
    assert run_train(*flags, "--max_iters", "2", out_dir=tmp_path / "added")[0] == 0
    added = sorted((images / "train").rglob("*.jpg"))[0]
    shutil.copy(added, added.with_name("added.jpg"))
    code, out, _ = run_train("--resume", "--max_iters", "3", out_dir=tmp_path / "added")
    assert code == 2 and f"the data in {images} are not those the run was trained on" in out, out


def test_ddp_ranks_stream_their_slices_and_match_one_process(mixed_jpegs, tmp_path):
    flags = ["--objective", "cls", "--dataset", "folder", "--data_dir", mixed_jpegs, *STREAM_FLAGS,
             "--max_iters", "3", "--eval_interval", "3", "--grad_accum", "2", "--workers", "1"]
    code, out, ddp = run_torchrun(*flags, out_dir=tmp_path / "ddp")
    assert code == 0 and "= 2 process(es) x 2 accumulated x 2" in out, out
    code, out, single = run_train(*flags, out_dir=tmp_path / "one")
    assert code == 0, out
    a, b = train_losses(ddp), train_losses(single)
    assert len(a) == 3 and all(abs(a[k] - b[k]) < 1e-4 * max(1, abs(b[k])) for k in b), (a, b)


def test_stream_auto_streams_only_a_folder_over_the_memory_budget(mixed_jpegs, tmp_path):
    """225 images at 16 px decode to 0.17 MB: within 0.1 GB decoded whole, over 0.0001 GB
    streamed; what ran is what the checkpoint says."""
    flags = ["--objective", "cls", "--dataset", "folder", "--data_dir", mixed_jpegs,
             *TINY_IMAGE_FLAGS, "--max_iters", "1", "--batch_size", "8"]
    for budget, streamed in (("0.1", False), ("0.0001", True)):
        code, out, _ = run_train(*flags, "--memory_gb", budget, out_dir=tmp_path / budget)
        assert code == 0 and ("streaming 180 training images" in out) == streamed, out
        saved = torch.load(tmp_path / budget / "ckpt.pt", weights_only=True)["train"]
        assert saved["stream"] == ("on" if streamed else "off")
        assert saved["crop_scale"] == 0.08  # fine-tuning's, for cls
    # a run that decoded its images whole resumes so, whatever the budget now
    code, out, _ = run_train("--resume", "--max_iters", "2", "--memory_gb", "0.0001",
                             out_dir=tmp_path / "0.1")
    assert code == 0 and "resumed from" in out and "streaming" not in out, out


def test_a_streamed_checkpoint_is_probed_in_its_own_evaluation_view(mixed_jpegs, tmp_path):
    flags = ["--objective", "cls", "--dataset", "folder", "--data_dir", mixed_jpegs,
             *STREAM_FLAGS, "--max_iters", "1", "--workers", "0"]
    assert run_train(*flags, out_dir=tmp_path / "run")[0] == 0
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    data = held_out(Config.from_dict(ckpt["config"]), ckpt["train"])
    assert isinstance(data, ImageStream) and data.device.type == "cpu"
    first = torch.tensor(eval_view(data.files["test"][0][0], 16)).permute(2, 0, 1)[None]
    assert torch.equal(first_samples(data, 1), standardised(first, data.mean, data.std))
    logged = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    ckpt = str(tmp_path / "run" / "ckpt.pt")  # the probe sees what the evaluation saw
    assert probe.main([ckpt, "--samples", "64", "--json", str(tmp_path / "p.json")]) == 0
    probed = json.loads((tmp_path / "p.json").read_text())["metrics"]
    for name in ("std", "cos", "abs_cos_centered", "hc_dc", "erank"):
        assert logged["layers"][name] == pytest.approx(probed[name][ckpt], rel=1e-5), name


def test_an_unreadable_image_met_by_a_streaming_worker_is_one_line_naming_it(capsys, mixed_jpegs,
                                                                              tmp_path):
    """Found mid-run, by a worker: its line comes back whole (an empty or mislaid streamed folder
    is found before any work: train.py's refusals' table)."""
    root = tmp_path / "data"
    shutil.copytree(mixed_jpegs, root)
    for path in (root / "train" / "cat").glob("*.jpg"):
        path.write_bytes(b"not a jpeg")
    err = cli_error(capsys, "--objective", "mae", "--dataset", "folder", "--data_dir", str(root),
                    *STREAM_FLAGS, "--max_iters", "2", "--workers", "1", "--out_dir",
                    str(tmp_path / "o"))
    assert "cannot read image" in err and str(root / "train" / "cat") in err
    assert "remove or replace" in err


def test_a_signal_to_every_process_of_a_streamed_run_saves_it_and_leaves_no_worker(
        mixed_jpegs, tmp_path):
    """A scheduler's SIGTERM (Ctrl-C's handler too) reaches the workers: the main process finishes
    its step and saves, with no traceback, and no worker outlives it."""
    flags = ["--objective", "cls", "--dataset", "folder", "--data_dir", mixed_jpegs, *STREAM_FLAGS,
             "--max_iters", "100000", "--eval_interval", "100000", "--workers", "2"]
    proc, out = stopped_run(flags, tmp_path, lambda proc: os.killpg(proc.pid, signal.SIGTERM))
    assert proc.returncode == 130 and "interrupted at step" in out and "Traceback" not in out, out
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] >= 1
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the whole process group is gone
        os.killpg(proc.pid, 0)


# ==================================================================================================
# 4. train.py: training as users run it, resume, fine-tuning, DDP, and what goes wrong
# ==================================================================================================

# --- 4a. Training: every objective learns; schedule, optimizer, fine-tuning, DDP; what a run says

@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_cli_trains_every_objective_and_the_loss_falls(tiny_data, tmp_path, objective):
    flags = (image_flags if objective in ("mae", "cls") else text_flags)(tiny_data, objective)
    steps = 120 if objective == "mae" else 40  # the tiny MAE needs more steps to fall by a fifth
    code, out, records = run_train(*flags, "--max_iters", str(steps), "--eval_interval",
                                   str(steps // 2), out_dir=tmp_path)
    assert code == 0, out
    losses = list(train_losses(records).values())
    assert len(losses) == steps and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in evals] == [steps // 2, steps]
    headline = {"mae": "val_loss", "cls": "top1", "mlm": "mlm_acc", "next": "ppl"}[objective]
    assert all(math.isfinite(r[headline]) for r in evals) and "done: " in out
    # not a terminal: no progress bar, one line per evaluation
    assert "it/s" not in out and "s/it" not in out
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == steps and isinstance(ckpt["config"], dict)
    assert ckpt["config"]["objective"] == objective


def test_ms_per_step_counts_the_wait_for_the_device_at_each_loss_read(tiny_data, tmp_path,
                                                                      monkeypatch):
    """The speed must count the device's queued steps the loss read waits for (a 50 ms sleep in
    every read stands in for that here; run_train reads every step)."""
    read_loss = progress.read_loss

    def waiting_read(*args):
        time.sleep(0.05)
        return read_loss(*args)

    monkeypatch.setattr(progress, "read_loss", waiting_read)
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "3", "--eval_interval",
                                          "3"), out_dir=tmp_path)
    assert code == 0 and float(re.search(r"([\d.]+) ms/step", out).group(1)) >= 50, out


@pytest.mark.parametrize("preset", ["cifar-tiny", "cifar-small", "cifar-deep", "base-12x768",
                                    "bamboo-b", "base-96x256", "wikitext-deep"])
def test_default_schedule_scales_the_rate_with_the_batch_and_the_warmup_with_depth(preset):
    depth = PRESETS[preset]["depth"]
    for batch_size in (64, 256, 1024):
        cfg = train.schedule_defaults(train.TrainConfig(batch_size=batch_size), depth)
        assert cfg.lr == pytest.approx(3e-4 * batch_size / 256)
        assert cfg.warmup == max(100, 10 * depth)
    given = train.schedule_defaults(train.TrainConfig(lr=0.0, min_lr=0.0, warmup=0), depth)
    assert (given.lr, given.min_lr, given.warmup) == (0.0, 0.0, 0)  # given values kept, 0 included
    tiny_batch = train.schedule_defaults(train.TrainConfig(batch_size=2), depth)
    assert tiny_batch.min_lr == tiny_batch.lr < train.TrainConfig.min_lr  # the cosine never rises


def test_get_lr_warms_up_then_decays_and_a_preset_carries_its_recipe_that_flags_override(tmp_path):
    cfg = train.TrainConfig(lr=1.0, min_lr=0.1, warmup=10, max_iters=110)
    lrs = [train.get_lr(i, cfg) for i in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    folder = ["--dataset", "folder", "--data_dir", str(tmp_path)]

    def settings(*argv):
        return train.resolve_settings(train.build_parser().parse_args([*argv, *folder]))[0]

    cfg = settings("--preset", "cifar-small")
    assert (cfg.lr, cfg.warmup, cfg.max_iters, cfg.batch_size) == (2e-3, 200, 3600, 128)
    cfg = settings("--preset", "cifar-small", "--lr", "1e-3")
    assert cfg.lr == 1e-3 and cfg.max_iters == 3600
    cfg = settings("--objective", "mae", "--depth", "48", "--width", "384")
    assert cfg.lr == 3e-4 * 128 / 256 and cfg.warmup == 480  # no preset: the scaled defaults
    said = re.search(r"= ([\d.e-]+) over (\d+) warmup steps, so ([\d.e-]+) at the first step",
                     " ".join(open(os.path.join(REPO, "README.md")).read().split()))
    assert said and [float(v) for v in said.groups()] == pytest.approx([cfg.lr, cfg.warmup,
                                                                        train.get_lr(0, cfg)], 0.01)


def test_the_defaults_keep_a_full_depth_trunk_finite_and_learning(tiny_data, tmp_path):
    """bamboo-b's 48 blocks (width 16) through the CLI with the defaults' rate and warmup for a
    batch of 256, on batches of 8, 80 steps past the peak; float32 (bf16 is 1.7x slower on CPU)."""
    cfg = train.schedule_defaults(train.TrainConfig(batch_size=256), PRESETS["bamboo-b"]["depth"])
    steps = cfg.warmup + 80
    code, out, records = run_train(
        "--preset", "bamboo-b", "--objective", "cls", "--width", "16", "--heads", "1",
        "--image_size", "32", "--patch_size", "8", "--dataset", "folder", "--data_dir",
        tiny_data / "images", "--batch_size", "8", "--cache_dir", IMAGE_CACHE, "--max_iters", steps,
        "--eval_interval", steps, "--dtype", "float32", "--lr", cfg.lr, "--warmup", cfg.warmup,
        out_dir=tmp_path)
    assert code == 0, out
    losses = list(train_losses(records).values())
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    assert sum(losses[-50:]) / 50 < 0.5 * sum(losses[:50]) / 50, losses[::25]


def test_gradient_clipping_bounds_the_whole_models_gradient(tiny_data, tmp_path, monkeypatch):
    models, norms, clip = [], [], torch.nn.utils.clip_grad_norm_

    class Kept(train.Bamboo):  # the model the run builds
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            models.append(self)

    def clip_then_measure(params, max_norm, *args, **kwargs):
        before = clip(params, max_norm, *args, **kwargs)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm()
                                                      for p in models[0].parameters()]))
        norms.append((before.item(), after.item()))
        return before

    monkeypatch.setattr(train, "Bamboo", Kept)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_measure)
    train_run(tiny_data, "cls", tmp_path, 3, "--grad_clip", "0.01", "--dtype", "float32")
    assert len(norms) == 3 and all(before > 0.01 and after < 0.01 * 1.001
                                   for before, after in norms), norms


def test_the_optimizer_scales_each_layer_decays_only_weights_and_is_the_reference_adamw():
    model = Bamboo(tiny("cls", depth=3))
    cfg = train.schedule_defaults(train.TrainConfig(layer_decay=0.5), depth=3)
    groups = model.configure_optimizer(cfg.lr, cfg.weight_decay, cfg.beta2,
                                       cfg.layer_decay).param_groups
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert scale[id(model.head.weight)] == 1.0 and scale[id(model.blocks[2].mlp.fc.weight)] == 0.5
    assert scale[id(model.blocks[0].mlp.fc.weight)] == 0.125
    assert scale[id(model.patch_embed.weight)] == 0.0625
    decays = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decays[id(model.blocks[0].ln1.weight)] == decays[id(model.blocks[0].mlp.fc.bias)] == 0
    assert decays[id(model.blocks[0].mlp.fc.weight)] == cfg.weight_decay
    smooth = Bamboo(tiny("cls", vo_param="smooth"))
    groups = smooth.configure_optimizer(cfg.lr, cfg.weight_decay, cfg.beta2,
                                        cfg.layer_decay).param_groups
    decays = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decays[id(smooth.blocks[0].attn.vo.psi)] == 0
    assert decays[id(smooth.blocks[0].attn.vo.basis)] == 0
    torch.manual_seed(0)
    model, reference = Bamboo(tiny("cls", depth=2)), Bamboo(tiny("cls", depth=2))
    reference.load_state_dict(model.state_dict())
    start = model.head.weight.detach().clone()
    cfg = train.schedule_defaults(train.TrainConfig(), depth=2)
    fused = model.configure_optimizer(cfg.lr, cfg.weight_decay, cfg.beta2)  # on the CPU: fused
    assert fused.defaults["fused"] and len(fused.param_groups) == 2  # decay / no decay, no more
    twin = dict(zip(map(id, model.parameters()), reference.parameters()))
    plain = torch.optim.AdamW([{"params": [twin[id(p)] for p in g["params"]],
                                "weight_decay": g["weight_decay"]} for g in fused.param_groups],
                              lr=cfg.lr, betas=(0.9, cfg.beta2), foreach=False)
    x, y = batch(model.config)
    for _ in range(5):
        for m, opt in ((model, fused), (reference, plain)):
            m(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert not torch.allclose(model.head.weight, start)


def test_init_from_mae_loads_the_encoder_or_its_first_blocks_and_resumes_without_it(
        tiny_data, trained, tmp_path):
    mae = trained("mae", tmp_path / "mae")
    cls = image_flags(tiny_data, "cls", "--max_iters", "1", "--eval_interval", "1")
    code, out, _ = run_train(*cls, "--init_from", mae, "--lr", "0", "--min_lr", "0",
                             "--layer_decay", "0.65", out_dir=tmp_path / "cls")  # lr 0: as loaded
    assert code == 0, out
    match = re.search(r"loaded (\d+) tensors, skipped (\d+)", out)
    assert match and int(match.group(1)) > 0 and int(match.group(2)) > 0, out
    pretrained = torch.load(mae, weights_only=True)["model"]
    tuned = torch.load(tmp_path / "cls" / "ckpt.pt", weights_only=True)["model"]
    shared = [k for k in tuned if k in pretrained and not k.startswith("head")]
    assert len(shared) == int(match.group(1))
    assert all(torch.equal(tuned[k], pretrained[k]) for k in shared)
    code, out, _ = run_train(*cls, "--init_from", mae, "--depth", "1", out_dir=tmp_path / "c")
    trunk = [k for k in torch.load(tmp_path / "c" / "ckpt.pt", weights_only=True)["model"]
             if k.startswith(TRUNK)]  # fewer blocks than pretrained: the first ones, all loaded
    assert code == 0 and f"loaded {len(trunk)} tensors" in out and "blocks," in out, out
    mae.unlink()  # a fine-tuning run resumes without its --init_from file
    code, out, _ = run_train("--resume", "--max_iters", "2", out_dir=tmp_path / "cls")
    assert code == 0 and "resumed" in out, out


def test_fine_tuning_keeps_the_pretrained_trunks_vo_param(tiny_data, tmp_path):
    """A smooth (or sharpen) MAE trunk fine-tunes as one: vo_param is part of the trunk's shape."""
    mae = train_run(tiny_data, "mae", tmp_path / "mae", 1, "--vo_param", "smooth")
    ft = train_run(tiny_data, "cls", tmp_path / "ft", 1, "--init_from", mae)
    assert torch.load(ft, weights_only=True)["config"]["vo_param"] == "smooth"


def test_a_text_trunk_is_tuned_with_its_tokens_and_a_preset_checked_on_the_data_scored(
        tiny_data, trained, tmp_path):
    """Fine-tuning a text trunk reads its text with the trunk's tokenizer; --eval_only --init_from
    --preset checks the preset against the checkpoint's data, not the default cifar10."""
    mlm = trained("mlm", tmp_path / "mlm")  # --tokenizer bytes
    code, out, _ = run_train("--objective", "next", "--dataset", "text", "--data_dir",
                             tiny_data / "text", "--cache_dir", IMAGE_CACHE, "--batch_size", "16",
                             "--max_iters", "1", "--init_from", mlm, out_dir=tmp_path / "next")
    assert code == 0 and "tokenizer=bytes" in out, out
    code, out, _ = run_train("--eval_only", "--init_from", mlm, "--preset", "wikitext-small",
                             out_dir=tmp_path / "score")
    assert code == 0 and f"evaluated {mlm} as trained: " in out, out


def test_ddp_with_gradient_accumulation_matches_one_process(tiny_data, tmp_path):
    """2 processes x 2 micro-batches agree with 1 process x 2 to 1e-4 (fp32: bf16's rounding alone
    moves the losses by as much)."""
    flags = image_flags(tiny_data, "cls", "--max_iters", "4", "--eval_interval", "4",
                        "--batch_size", "8", "--dtype", "float32", "--grad_accum", "2")
    code, out, ddp = run_torchrun(*flags, out_dir=tmp_path / "ddp")
    assert code == 0 and "= 2 process(es) x 2 accumulated x 2" in out, out
    code, out, single = run_train(*flags, out_dir=tmp_path / "one")
    assert code == 0, out
    a, b = train_losses(ddp), train_losses(single)
    assert len(a) == 4 and all(abs(a[k] - b[k]) < 1e-4 * max(1, abs(b[k])) for k in b), (a, b)


def test_the_best_evaluation_is_kept_as_weights_only_beside_the_last_checkpoint(tiny_data,
                                                                               tmp_path):
    """best.pt: the weights of the best evaluation so far, without optimizer or random states,
    loadable wherever a checkpoint is; --overwrite replaces it with the rest of the old run."""
    out = tmp_path / "run"
    train_run(tiny_data, "next", out, 4, "--eval_interval", "2", "--lr", "1e-1")
    evals = [r for r in log_records(out) if r.get("eval")]
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["step"] == min(evals, key=lambda r: r["val_loss"])["step"]
    assert best["best"] == pytest.approx(min(r["ppl"] for r in evals))
    assert not {"optimizer", "scaler", "rng"} & set(best) and "made_by" in best
    assert (out / "best.pt").stat().st_size < (out / "ckpt.pt").stat().st_size / 2
    assert best["step"] == 2 < evals[-1]["step"]  # the rate too high: step 4 evaluates worse
    model, _ = model_from_checkpoint(out / "best.pt")
    last = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    assert not all(torch.equal(v, last[k]) for k, v in model.state_dict().items())
    train_run(tiny_data, "next", out, 1, "--eval_interval", "5", "--overwrite")
    assert torch.load(out / "best.pt", weights_only=True)["step"] == 1  # the new
    (tmp_path / "copy").mkdir()  # best.pt copied to ckpt.pt is no run to resume: said so
    shutil.copy(out / "best.pt", tmp_path / "copy" / "ckpt.pt")
    code, printed, _ = run_train("--resume", "--max_iters", "2", out_dir=tmp_path / "copy")
    assert code == 2 and "holds weights only (as best.pt does)" in printed, printed


def test_eval_only_judges_the_weights_as_set_up_and_saves_nothing(tiny_data, trained, tmp_path):
    """--resume --eval_only: the checkpoint's own held-out metric, nothing written; a fresh model
    leaves no out_dir behind."""
    out = tmp_path / "run"
    trained("cls", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    logged = [r for r in log_records(out) if r.get("eval")][-1]
    code, printed, _ = run_train("--resume", "--eval_only", out_dir=out)
    assert code == 0 and f"evaluated at step 2: val_loss {logged['val_loss']:.4g}" in printed
    assert not any(word in printed for word in ("peak lr", "warmup", "compile:"))  # no training
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    out.chmod(0o555)  # a read-only folder: no lock taken, nothing written
    try:
        code, printed, _ = run_train("--resume", "--eval_only", out_dir=out)
    finally:
        out.chmod(0o755)
    assert code == 0 and "evaluated at step 2" in printed, printed
    code, printed, _ = run_train(*image_flags(tiny_data, "cls", "--eval_only"),
                                 out_dir=tmp_path / "fresh")
    assert code == 0 and "evaluated at step 0" in printed and not (tmp_path / "fresh").exists()
    # any checkpoint, best.pt too, scored as it was trained: its head, its data, its metric
    code, printed, _ = run_train("--eval_only", "--init_from", out / "best.pt",
                                 out_dir=tmp_path / "score")
    best = max(r["top1"] for r in log_records(out) if r.get("eval"))
    assert code == 0 and f"evaluated {out / 'best.pt'} as trained: " in printed, printed
    assert f"top1 {best:.4g}" in printed and not (tmp_path / "score").exists()
    subset = tmp_path / "subset"  # trained on a subset and a seed of its own: scored on them too
    train_run(tiny_data, "cls", subset, 2, "--train_samples", "10", "--seed", "7")
    code, printed, _ = run_train("--eval_only", "--init_from", subset / "best.pt",
                                 out_dir=tmp_path / "score")
    logged = [r for r in log_records(subset) if r.get("eval")][-1]
    assert code == 0 and f"val_loss {logged['val_loss']:.4g}" in printed, printed


def test_eval_only_scores_a_text_runs_best_pt_on_its_own_windows_files_and_masks(tiny_data,
                                                                                  tmp_path):
    """A next-token run on files named its own way is scored on its windows of seq_len + 1 and
    its files; an MLM run with its masks."""
    text = tmp_path / "text"
    text.mkdir()
    for name, source in (("tr.txt", "train.txt"), ("va.txt", "val.txt")):
        (text / name).write_text((tiny_data / "text" / source).read_text())
    runs = {"next": ("val_loss", "--data_dir", text, "--train_file", "tr.txt", "--val_file",
                     "va.txt"), "mlm": ("mlm_acc", "--batch_size", "4")}
    for objective, (metric, *flags) in runs.items():  # trained: the windows and masks tell
        ckpt = train_run(tiny_data, objective, tmp_path / objective, 20, *flags, "--lr", "1e-2")
        assert torch.load(ckpt, weights_only=True)["window"] == (33 if objective == "next" else 32)
        code, printed, _ = run_train("--eval_only", "--init_from", tmp_path / objective / "best.pt",
                                     out_dir=tmp_path / "score")
        logged = [r for r in log_records(tmp_path / objective) if r.get("eval")][-1]
        assert code == 0 and f"{metric} {logged[metric]:.4g}" in printed, (printed, logged)


def test_runs_record_their_initial_trunk_and_each_images_correctness(tiny_data, tmp_path):
    """The cls and MAE arms of one seed record that they started from the same trunk; a
    classifier's last evaluation is kept image by image (paired tests from files)."""
    hashes = {}
    for name, objective, seed in (("cls", "cls", "1"), ("mae", "mae", "1"), ("other", "cls", "2")):
        ckpt = train_run(tiny_data, objective, tmp_path / name, 2, "--seed", seed)
        logged = log_records(tmp_path / name)
        hashes[name] = torch.load(ckpt, weights_only=True)["init_hash"]
        assert [r["init_trunk_sha256"] for r in logged if r.get("eval")] == [hashes[name]["trunk"]]
    assert hashes["cls"]["trunk"] == hashes["mae"]["trunk"] != hashes["other"]["trunk"]
    assert hashes["cls"]["model"] != hashes["mae"]["model"]  # the heads differ
    correct = np.load(tmp_path / "cls" / "eval_correct.npy")
    top1 = [r for r in logged if r.get("eval")][-1]["top1"]  # "other": the same data, seed 2
    other = np.load(tmp_path / "other" / "eval_correct.npy")
    assert len(correct) == 32 and 100 * other.mean() == pytest.approx(top1)
    assert not (tmp_path / "mae" / "eval_correct.npy").exists()
    code, out, _ = run_train("--resume", "--max_iters", "3", out_dir=tmp_path / "cls")
    resumed = torch.load(tmp_path / "cls" / "ckpt.pt", weights_only=True)
    assert code == 0 and resumed["step"] == 3 and resumed["init_hash"] == hashes["cls"], out


def test_each_run_records_the_commit_command_torch_machine_and_dtype_that_made_it(
        tiny_data, tmp_path, monkeypatch):
    """The first record of log.jsonl and the checkpoint say what made the run; a resume adds its
    own record, so that every invocation of a run is on file."""
    flags = [*image_flags(tiny_data, "cls", "--max_iters", "2", "--eval_interval", "2")]
    monkeypatch.setattr(sys, "argv", ["train.py", *flags])
    code, out, records = run_train(*flags, out_dir=tmp_path)
    assert code == 0, out
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    made = records[0]["run"]
    assert made["commit"] == (head or None) and records[0]["from_step"] == 0
    assert isinstance(made["uncommitted_changes"], bool) == bool(head)
    assert made["command"] == " ".join([os.path.basename(sys.executable), "train.py", *flags])
    assert made["torch"] == torch.__version__ and made["device"] == "cpu"
    assert made["cpu"] == fast.cpu_model() and made["cpu"]  # a pooled analysis can name both
    assert made["dtype"] == str(fast.pick_dtype("auto", torch.device("cpu"))).split(".")[1]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["made_by"] == made
    code, out, records = run_train("--resume", "--max_iters", "3", out_dir=tmp_path)
    resumes = [r for r in records if "run" in r]
    assert code == 0 and len(resumes) == 2 and resumes[1]["from_step"] == 2, out


def test_the_log_reaches_the_disk_line_by_line_while_the_run_goes(tiny_data, tmp_path, monkeypatch):
    """`tail -f log.jsonl` follows a run, and a run killed outright (SIGKILL, a lost node) keeps
    what it logged."""
    lines_on_disk = []
    get_lr = train.get_lr  # called once at the start of every step

    def look_then_step(it, cfg):
        lines_on_disk.append((tmp_path / "log.jsonl").read_text().count("\n"))
        return get_lr(it, cfg)

    monkeypatch.setattr(train, "get_lr", look_then_step)
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "3"), out_dir=tmp_path)
    # the run's first record (what made it) is on disk before step 1, then one line per step
    assert code == 0 and lines_on_disk == [1, 2, 3], (lines_on_disk, out)


def test_a_run_prints_each_setting_with_where_it_came_from(tiny_data, tmp_path):
    flags = ["--objective", "cls", "--dataset", "folder", "--data_dir", str(tiny_data / "images"),
             "--preset", "cifar-tiny", "--image_size", "16", "--depth", "2", "--max_iters", "1",
             "--batch_size", "16", "--cache_dir", IMAGE_CACHE]
    code, out, _ = run_train(*flags, out_dir=tmp_path)
    lines = out.replace("\n    ", " ").splitlines()  # a group's continuation lines joined
    assert code == 0 and any(line.startswith("from the data: channels=3 num_classes=")
                             for line in lines), out
    preset = next(line for line in lines if line.startswith("from the cifar-tiny preset:"))
    assert "width=64" in preset and " depth=" not in preset  # --depth is a flag here
    assert any(line.startswith("from flags:") and "max_iters=1" in line for line in lines)
    code, out, _ = run_train("--resume", "--max_iters", "2", out_dir=tmp_path)
    assert code == 0 and "from the resumed run: " in out, out
    assert "from flags: max_iters=2" in out
    assert "every other setting: its default, where this run reads it (train.py --help)" in out
    assert "cifar-small: batch_size=128, max_iters=3600" in train.build_parser().format_help()
    looks = look.build_parser()._subparsers._group_actions[0].choices.values()
    for parser in (probe.build_parser(), bench.build_parser(), *looks):  # every default said
        for a in parser._actions:
            if a.option_strings and a.nargs != 0 and a.default not in ("", None, argparse.SUPPRESS):
                assert "(default: " in a.help, (parser.prog, a.option_strings)


def test_every_flag_given_where_it_does_nothing_is_named_from_one_table(tiny_data, tmp_path):
    """One table says where each setting applies, a row for every training setting; a flag given
    where it does nothing is named, never silent."""
    from dataclasses import fields

    rows = checks.where_flags_apply(train.TrainConfig(), Config(), False, set())
    assert {f.name for f in fields(train.TrainConfig)} <= set(rows)
    code, out, _ = run_train(*text_flags(tiny_data, "next", "--max_iters", "1", "--crop_scale",
                                         "0.5", "--workers", "2", "--memory_gb", "4", "--stream",
                                         "off", "--num_classes", "7", "--base_lr", "1e-3", "--lr",
                                         "1e-3", "--label_smoothing", "0.1"),
                       out_dir=tmp_path / "text")
    assert code == 0, out
    for line in ("--crop_scale --workers (read only for a streamed image folder)",
                 "--stream (read only for an image folder)", "--num_classes (read only for images)",
                 "--memory_gb (read only for an image folder under --stream auto)",
                 "--base_lr (read only for --lr -1 (peak rate base_lr x batch / 256))",
                 "--label_smoothing (read only for --objective cls)"):
        assert "note: this run ignores " + line in out, [n for n in out.splitlines() if "ig" in n]
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--eval_only", "--stream", "off",
                                          "--memory_gb", "4", "--vocab_size", "100", "--max_iters",
                                          "5", "--probe_samples", "3", "--lr", "0.1", "--warmup",
                                          "3"), out_dir=tmp_path / "image")
    assert code == 0 and "crop_scale" not in out, out  # the stream's own, not listed here
    for line in ("--memory_gb (read only for an image folder under --stream auto)",
                 "--vocab_size (read only for text)", "--max_iters --lr --warmup --log_interval "
                 "--probe_samples (read only for training, not --eval_only)"):
        assert "note: this run ignores " + line in out, [n for n in out.splitlines() if "ig" in n]


def test_silent_flag_mixups_and_a_busy_cpu_are_said(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "2", "--warmup", "5"),
                             "--device", "cpu", out_dir=tmp_path / "w")
    assert code == 0 and "--warmup 5 is not shorter than --max_iters 2" in out
    assert "note: this CPU is busy (load 99.0 on" in out  # --threads 1 may be faster
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "1", "--threads", "1"),
                             "--device", "cpu", out_dir=tmp_path / "one")
    assert code == 0 and "this CPU is busy" not in out  # chosen already
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "1", "--probe_samples",
                                          "100000", "--train_samples", "100000", "--mlm_prob",
                                          "0.3", "--seq_len", "64", "--num_classes", "7"),
                             "--device", "cpu", out_dir=tmp_path / "p")
    assert code == 0 and "--probe_samples 100000 is more than the " in out, out
    assert "--train_samples 100000 is more than the 96 training images" in out, out
    assert "note: this run ignores --mlm_prob (read only for --objective mlm)" in out
    assert ("note: this run ignores --decoder_depth --decoder_width --decoder_heads (read only "
            "for --objective mae)") in out
    assert "note: this run ignores --seq_len (read only for text)" in out
    assert "--num_classes is the data's 2 here: the data sets it" in out
    assert "this CPU is busy" not in out  # not busy
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--eval_only"), out_dir=tmp_path / "p")
    assert code == 0 and "--eval_only without --resume or --init_from scores freshly" in out


# --- 4b. What --resume guarantees: the same run, exactly, on the same data, or one line

def test_resume_continues_exactly(tiny_data, tmp_path):
    """MAE draws random masks every step, so this also checks that the RNG states are restored."""
    flags = image_flags(tiny_data, "mae", "--max_iters", "8", "--eval_interval", "4")
    code, out, whole = run_train(*flags, out_dir=tmp_path / "whole")
    assert code == 0, out
    code, out, _ = run_train(*flags, "--time_limit", "1e-9", out_dir=tmp_path / "parts")
    assert code == 0 and "time limit reached at step 1" in out, out
    code, out, parts = run_train("--resume", out_dir=tmp_path / "parts")
    assert code == 0 and "resumed" in out, out
    assert train_losses(parts) == train_losses(whole) and len(train_losses(whole)) == 8
    final = [r for r in parts if r.get("eval")][-1]
    assert final["val_loss"] == [r for r in whole if r.get("eval")][-1]["val_loss"]
    assert "raises the learning rate" not in out  # the same schedule, resumed at step 1
    code, out, _ = run_train("--resume", "--max_iters", "16", out_dir=tmp_path / "parts")
    assert code == 0 and "raises the learning rate at step 8 from 0.00068 to 0.0061" in out, out


def test_ddp_resume_is_exact_on_every_rank(tiny_data, tmp_path):
    """Each rank's MAE masks repeat exactly after a resume; the ranks stop only at steps that log
    the loss (a host sync each): a time limit met at step 1 stops at step 2."""
    flags = image_flags(tiny_data, "mae", "--eval_interval", "4", "--batch_size", "8", "--dtype",
                        "float32", "--grad_accum", "2", "--max_iters", "4")
    code, out, whole = run_torchrun(*flags, out_dir=tmp_path / "whole")
    assert code == 0, out
    code, out, _ = run_torchrun(*flags, "--time_limit", "1e-9", "--log_interval", "2",
                                out_dir=tmp_path / "parts")
    assert code == 0 and "time limit reached at step 2" in out, out
    assert len(torch.load(tmp_path / "parts" / "ckpt.pt", weights_only=True)["rng"]["ranks"]) == 2
    code, out, parts = run_torchrun("--resume", out_dir=tmp_path / "parts")
    assert code == 0 and "resumed" in out, out
    assert train_losses(parts) == {k: v for k, v in train_losses(whole).items() if k != 1}
    assert len(train_losses(whole)) == 4


def test_a_resume_says_only_when_a_longer_cosine_raises_the_rate_over_where_it_stopped():
    saved = dict(max_iters=16, lr=1e-3, min_lr=1e-4, warmup=2)
    cfg = train.TrainConfig(**saved)
    for step, now in ((8, cfg), (8, replace(cfg, lr=1e-2)), (1, replace(cfg, max_iters=32)),
                      (8, replace(cfg, max_iters=12)), (16, replace(cfg, max_iters=32,
                                                                    eval_only=True))):
        assert checks.schedule_note(saved, now, step, train.get_lr) == "", (step, now)
    note = checks.schedule_note(saved, replace(cfg, max_iters=32), 16, train.get_lr)
    assert note == ("note: the new schedule raises the learning rate at step 16 from 0.00011 to "
                    "0.0006 (the cosine now ends at step 32); to go on at 0.00011, pass --lr "
                    "0.00011 --min_lr 0.00011"), note


def test_resume_takes_new_iterations_the_data_location_and_this_invocations_threads(
        tiny_data, trained, tmp_path):
    """A log of whole records that lost its last newline resumes; a resume on another held-out set
    says that 'best' now compares across sets; a finished run says so instead of silence."""
    out, moved = tmp_path / "run", Path(shutil.copytree(tiny_data / "images", tmp_path / "moved"))
    log = trained("cls", out).with_name("log.jsonl")
    log.write_text(log.read_text().rstrip("\n"))
    try:  # --threads is the invocation's own: a resume on another machine sets its own
        code, printed, records = run_train("--resume", "--max_iters", "4", "--data_dir", moved,
                                           "--threads", "2", out_dir=out)
        assert code == 0 and "resumed" in printed and torch.get_num_threads() == 2, printed
    finally:
        torch.set_num_threads(1)
    assert [r.get("step") for r in records][-5:] == [2, None, 3, 4, 4]  # eval, run, steps, eval
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 4 and ckpt["train"]["data_dir"] == str(moved)
    assert "different held-out sets" not in printed
    code, printed, _ = run_train("--resume", "--eval_samples", "16", out_dir=out)
    assert code == 0 and "'best' now compares evaluations on different held-out sets" in printed
    code, printed, _ = run_train("--resume", out_dir=out)
    assert code == 0 and "nothing to train" in printed and "--max_iters" in printed, printed
    assert "different held-out sets" not in printed


@pytest.mark.parametrize("change", ["moved", "class renamed", "file added", "text edited"])
def test_a_resume_must_find_the_data_it_was_trained_on(capsys, tiny_data, tmp_path, monkeypatch,
                                                       change):
    """The same files with the same labels (a folder moved elsewhere is the same data), or the same
    text: renamed class folders would permute the labels, an added file change the data order."""
    kind = "text" if change == "text edited" else "images"
    data = tmp_path / kind
    shutil.copytree(tiny_data / kind, data)
    objective = "next" if kind == "text" else "cls"
    train_run(tiny_data, objective, tmp_path / "run", 1, "--data_dir", data)
    if change == "moved":
        data = data.rename(tmp_path / "moved")
    for split in ("train", "test") if change == "class renamed" else ():  # the labels would swap
        (data / split / "blue").rename(data / split / "zblue")
    if change == "file added":
        shutil.copy(sorted((data / "train" / "red").iterdir())[0], data / "train" / "red" / "a.png")
    if change == "text edited":
        (data / "val.txt").write_text((data / "val.txt").read_text()[::-1])
    resume = ["--resume", "--max_iters", "2", "--data_dir", str(data)]
    if change == "moved":
        code, out, _ = run_train(*resume, out_dir=tmp_path / "run")
        assert code == 0 and "resumed from" in out, out
        monkeypatch.chdir(tmp_path)  # however its path is written: one fingerprint
        listed = [files.list_folder(d)[0]["test"] for d in ("moved", "./moved", str(data))]
        assert len({files.listing_fingerprint(samples) for samples in listed}) == 1
    else:
        err = cli_error(capsys, *resume, "--out_dir", str(tmp_path / "run"))
        assert f"--resume: the data in {data} are not those the run was trained on" in err, err


def test_a_resumed_run_logs_each_step_once_after_a_kill(tiny_data, tmp_path, monkeypatch):
    flags = image_flags(tiny_data, "cls", "--max_iters", "6", "--eval_interval", "2")
    get_lr = train.get_lr

    def killed_at_step_4(it, cfg):
        if it == 3:
            raise SystemExit(137)  # steps 1 to 3 logged, the checkpoint holds step 2
        return get_lr(it, cfg)

    monkeypatch.setattr(train, "get_lr", killed_at_step_4)
    with pytest.raises(SystemExit):
        run_train(*flags, out_dir=tmp_path)
    monkeypatch.undo()
    with open(tmp_path / "log.jsonl", "a") as log:
        log.write('{"step": 4, "lo')  # a line the kill cut short
    code, out, records = run_train("--resume", out_dir=tmp_path)
    steps = [r["step"] for r in records if "loss" in r]
    assert code == 0 and steps == [1, 2, 3, 4, 5, 6], (steps, out)
    assert [r["step"] for r in records if r.get("eval")] == [2, 4, 6]


def test_the_resume_hint_names_the_launcher(monkeypatch):
    assert cli.resume_command("o", 1) == "python train.py --resume --out_dir o"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cli.resume_command("o", 2) == "torchrun --nproc_per_node=2 train.py --resume --out_dir o"
    assert cli.resume_command("o", 4).startswith("torchrun --nnodes=2 --nproc_per_node=2 train.py")
    line = progress.how_to_resume("time limit reached", 7, 2, "o")
    assert line == ("time limit reached at step 7; checkpoint saved to o/ckpt.pt; continue with: "
                    "torchrun --nproc_per_node=2 train.py --resume --out_dir o")


# --- 4c. The out_dir: one run at a time, written whole, nothing of another run lost

def test_overwrite_replaces_all_of_a_run_and_nothing_else(tiny_data, trained, tmp_path):
    """A replacement removes every file the old run wrote (its per-image correctness too), and
    nothing else; its log is its own (a mistyped --overwrite costs nothing: the refusals' table)."""
    trained("cls", tmp_path)
    assert {"ckpt.pt", "log.jsonl", "eval_correct.npy"} <= {p.name for p in tmp_path.iterdir()}
    (tmp_path / "notes.txt").write_text("the user's own")
    mae = image_flags(tiny_data, "mae", "--max_iters", "2", "--eval_interval", "1", "--seed", "7")
    code, out, records = run_train(*mae, "--overwrite", out_dir=tmp_path)
    assert code == 0 and "--overwrite: removed the old run's ckpt.pt best.pt log.jsonl" in out
    assert not (tmp_path / "eval_correct.npy").exists()  # the classifier's, not this run's
    assert [r.get("step") for r in records] == [None, 1, 1, 2, 2]  # its run, steps and evaluations
    assert records[0]["from_step"] == 0  # its own log, not appended to the other run's
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["train"]["seed"] == 7
    assert (tmp_path / "notes.txt").read_text() == "the user's own"


def test_a_second_run_into_a_busy_out_dir_stops_at_once_and_the_lock_ends_with_its_run(
        capsys, tiny_data, tmp_path):
    """A second run into an out_dir in use stops at once and writes nothing; the lock ends with the
    process that took it, even where a forked child (a DataLoader worker) outlives it."""
    script = (f"import os, sys, time; sys.path.insert(0, {REPO!r})\n"
              "from operations import out_dir\n"
              "claimed = out_dir.out_dir_claimed(sys.argv[1], False, False)\n"
              "claimed.__enter__()\n" "if os.fork() == 0:\n" "    os.close(1)\n"
              "    time.sleep(10)\n" "    os._exit(0)\n" "print('claimed', flush=True)\n"
              "sys.stdin.read()\n" "os._exit(0)  # killed: no clean-up\n")
    run = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert run.stdout.readline() == "claimed\n"
    err = cli_error(capsys, *image_flags(tiny_data, "cls", "--max_iters", "1"), "--out_dir",
                    str(tmp_path))
    assert "another train.py is running in --out_dir" in err
    assert os.listdir(tmp_path) == [".lock"]  # nothing written or lost
    run.communicate("", timeout=60)
    with out_dir_claimed(str(tmp_path), resume=False, overwrite=False):  # its child still sleeps
        pass


def test_a_lock_is_never_a_hang_or_a_link_and_a_failed_write_shows_its_own_error(tmp_path,
                                                                                monkeypatch):
    """out_dir/.lock planted as a FIFO would block the open for ever; as a link it would lock (or
    create) a file outside out_dir: both refused. A write that fails mid-run shows its error."""
    for plant in (os.mkfifo, lambda lock: lock.symlink_to(tmp_path.parent / "elsewhere.lock")):
        plant(tmp_path / ".lock")
        with pytest.raises(TrainingError, match=r"cannot open .*\.lock \(.*\); remove it"):
            with out_dir_claimed(str(tmp_path), resume=False, overwrite=False):
                pass
        (tmp_path / ".lock").unlink()
    assert not (tmp_path.parent / "elsewhere.lock").exists()

    def read_only(path):
        raise PermissionError(13, "Permission denied", path)

    with pytest.raises(OSError, match="No space left"):  # the folder made read-only mid-run
        with out_dir_claimed(str(tmp_path / "run"), resume=False, overwrite=False):
            (tmp_path / "run" / "ckpt.pt").write_bytes(b"x")
            monkeypatch.setattr(os, "remove", read_only)
            raise OSError(28, "No space left on device", "ckpt.pt")  # the write's error
    # the write's error is shown (the lock file's removal failed quietly); the lock is let go
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "ckpt.pt"]
    with out_dir_claimed(str(tmp_path / "run"), resume=True, overwrite=False):
        pass


def test_a_start_removes_what_a_killed_run_left_and_no_file_of_the_users(trained, tmp_path):
    """Only atomic_write's temporary names are cleaned up, and .lock is removed only while empty
    (as a run leaves it): a user's .lock, or .tmp files of other names, stay as they are."""
    trained("cls", tmp_path)
    left = [".ckpt.pt.k1l2m3n4.tmp", ".log.jsonl.a1b2c3d_.tmp", ".eval_correct.npy.b2c3d4e5.tmp"]
    mine = {".lock": "mine", ".notes.x.tmp": "x", "ckpt.pt.tmp": "x", ".ckpt.pt.mine.tmp": "mine",
            ".log.jsonl.draft.tmp": "mine", ".ckpt.pt.MyDraft1.tmp": "mine"}  # not atomic_write's
    for name in left:
        (tmp_path / name).write_bytes(b"x" * 100)
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    code, out, _ = run_train("--resume", "--max_iters", "3", out_dir=tmp_path)
    assert code == 0 and not [n for n in left if (tmp_path / n).exists()], out
    assert {name: (tmp_path / name).read_text() for name in mine} == mine
    (tmp_path / ".lock").write_text("")  # left by a run killed before its end
    with out_dir_claimed(str(tmp_path), resume=True, overwrite=False):
        pass
    assert not (tmp_path / ".lock").exists()


def test_checkpoints_use_a_temp_file_unique_to_the_process_and_survive_a_failed_write(
        tmp_path, monkeypatch):
    """A full disk, or torch's stream writer failing (a RuntimeError), is one line: the last
    checkpoint stays, no temporary file is left, and the old fixed temp name is never touched."""
    (tmp_path / "ckpt.pt.tmp").write_text("someone else's")
    umask = os.umask(0o027)  # the mode a plain open() would give, not mkstemp's 0o600
    try:
        checkpoint.save(str(tmp_path / "ckpt.pt"), {"step": 1})
    finally:
        os.umask(umask)
    assert (tmp_path / "ckpt.pt").stat().st_mode & 0o777 == 0o640

    def no_modes(*args):  # a file system that refuses chmod: the file keeps the mode it has
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(checkpoint.os, "chmod", no_modes)
    checkpoint.save(str(tmp_path / "ckpt.pt"), {"step": 1})
    for error, says in ((OSError(errno.ENOSPC, "No space left on device"),
                         "No space left on device.*--resume"),
                        (RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos "
                                      "64 vs 0"), "could not write .*unexpected pos")):
        def failing(obj, f, error=error):
            f.write(b"partial")
            raise error

        monkeypatch.setattr(checkpoint.torch, "save", failing)
        with pytest.raises(checkpoint.CheckpointError, match=says):
            checkpoint.save(str(tmp_path / "ckpt.pt"), {"step": 2})
        monkeypatch.undo()
        assert torch.load(tmp_path / "ckpt.pt", weights_only=True) == {"step": 1}
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.tmp"]


# --- 4d. Stopping: Ctrl-C and SIGTERM, the time limit, a non-finite loss, progress on the way

def test_ctrl_c_and_sigterm_save_a_checkpoint_and_exit(tiny_data, tmp_path):
    """Ctrl-C here; SIGTERM, the same handler, in the streamed run's test."""
    flags = image_flags(tiny_data, "cls", "--max_iters", "100000", "--eval_interval", "100000")
    proc, out = stopped_run(flags, tmp_path, lambda proc: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 130 and "interrupted at step" in out and "Traceback" not in out, out
    assert "stop requested: finishing this step, then evaluating and saving" in out
    assert any(line.startswith("interrupted at step") for line in out.splitlines())
    assert "stopped: top1" in out  # the summary line, on a stop too
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] >= 1


def test_a_time_limit_keeps_time_for_the_final_evaluation_and_the_progress_line_says_so(
        capsys, monkeypatch):
    """Training stops while the evaluation and the checkpoint still fit (their last time, or before
    the first, its parts as timed at the start); a limit that cannot hold one says so at the start
    and its stop scores what fits."""
    from tqdm import tqdm

    monkeypatch.setattr(progress, "EXIT_S", 0.0)  # the time kept for the process's exit
    cfg = train.TrainConfig(time_limit=10, batch_size=16, eval_samples=0)
    clock = progress.Clock(time.time() - 7.5, cfg, held_out_batches=1)  # 2.5 s left
    clock.step_times, clock.batch_s = [1.0, 1.0], 1.0  # 1 s per step, 1 s per held-out batch
    assert not clock.out_of_time(10) and clock.limit_note() == ""  # 1 s step + 1 s batch fit
    clock.steps_per_check = 2  # under DDP, the ranks agree to stop every log_interval steps
    assert clock.out_of_time(10)
    clock.steps_per_check, clock.probe_s = 1, 1.0  # with the probe: 2 s, 2.5 s with the margin
    assert clock.out_of_time(10) and not clock.short_of_time()  # a step does not fit; 2 s do
    clock.eval_s = 0.5  # once an evaluation is timed, its time counts
    assert not clock.out_of_time(10)
    clock.eval_s, clock.save_s = 1.0, 0.6  # the step, the evaluation and the save: 2.6 s
    assert clock.out_of_time(10)
    assert not clock.out_of_time(cfg.max_iters)  # at the last step there is nothing to stop
    clock.step_times = [1.6]  # before a second step, the first counts (compilation included)
    assert clock.slowest_step_s() == 1.6 and progress.Clock(0, cfg, 1).slowest_step_s() == 0
    cfg = train.TrainConfig(max_iters=1000, time_limit=10, batch_size=16, eval_samples=0)
    clock = progress.Clock(time.time() - 1.5, cfg, held_out_batches=20)  # 8.5 s left
    clock.overhead_s, clock.batch_s, clock.probe_s = 0.4, 1.0, 1.5  # 22 s of evaluation
    assert clock.limit_note() == (
        "note: --time_limit 10 s leaves 8 s, too little for an evaluation (about 22 s: 20 held-out "
        "batches of 1.00 s, 0.4 s besides, the probe 1.5 s): the run will stop at its first chance "
        "and score the held-out samples that fit, without the probe; to score them all, lower "
        "--eval_samples or --probe_samples, or raise --time_limit")
    # batches start until the limit less one batch, the save (0.5 s) and, with time, the probe
    clock.save_s, end = 0.5, clock.t_begin + 10
    assert clock.evaluation_deadline(True) == pytest.approx(end - 1.5, abs=0.01)
    assert clock.evaluation_deadline(False) == pytest.approx(end - 3.0, abs=0.01)
    clock.cfg = train.TrainConfig(batch_size=16)
    assert not clock.short_of_time() and clock.limit_note() == ""  # no limit: no deadline
    assert clock.evaluation_deadline(False) is None
    # an evaluation: 2 batches and the probe, 1 s each; 6 s left
    clock = progress.Clock(time.time() - 4, cfg, held_out_batches=2)
    clock.step_times, clock.batch_s, clock.probe_s = [1.0] * 11, 1.0, 1.0
    bar = tqdm(total=1000, disable=True)
    clock.show_progress(bar, 10, 2.5, 1e-3)
    line = ("step 10/1000: loss 2.5000, lr 1.00e-03, 1000 ms/step, about 0.1 min left: "
            "--time_limit stops the run at about step 12 (all 1000 steps would take about "
            "16.8 min)")  # 6 s left, 3.75 s kept for the final evaluation; 990 s + 5 x 3 s
    assert bar.total == 12 and line in capsys.readouterr().out
    cfg.eval_interval = 3  # an evaluation every third step: each step also holds a third of one
    clock.show_progress(bar, 10, 2.5, 1e-3)
    assert bar.total == 11  # 2.25 s for steps of 1 s + 1 s
    cfg.time_limit = 1e308  # a limit too large to count in steps is no limit, not an error
    clock.show_progress(bar, 10, 2.5, 1e-3)
    assert bar.total == 1000
    clock.cfg, clock.said = train.TrainConfig(max_iters=1000), 0.0
    clock.batch_s = clock.probe_s = 0.0  # no time limit: nothing timed at the start
    clock.show_progress(bar, 10, 2.5, 1e-3)
    assert capsys.readouterr().out.endswith("16.5 min left (steps only: no evaluation timed yet)\n")
    clock.said, clock.eval_s = 0.0, 6.0  # once an evaluation is timed, the 5 left count too
    clock.show_progress(bar, 10, 2.5, 1e-3)
    assert capsys.readouterr().out.endswith("about 17.0 min left\n")


def test_a_time_limit_met_right_after_an_evaluation_stops_there_without_another(
        tiny_data, tmp_path, monkeypatch):
    # out of time only once the first evaluation has been timed (at step 2)
    monkeypatch.setattr(progress.Clock, "out_of_time", lambda self, step: self.eval_s is not None)
    flags = image_flags(tiny_data, "cls", "--max_iters", "10", "--eval_interval", "2",
                        "--time_limit", "60")
    code, out, records = run_train(*flags, out_dir=tmp_path)
    assert code == 0 and "time limit reached at step 2" in out, out
    assert [r["step"] for r in records if r.get("eval")] == [2]  # not 2 and then 3


def test_a_time_limit_counts_from_the_start_of_the_process(tiny_data, tmp_path):
    """python train.py passes the time taken before its imports: a limit already spent there is
    said at the start, and the run stops after its first step, saved, with what fits evaluated."""
    flags = image_flags(tiny_data, "cls", "--max_iters", "40", "--time_limit", "900")
    printed = io.StringIO()
    with redirect_stdout(printed), redirect_stderr(printed):
        code = train.main(flags + ["--out_dir", str(tmp_path)], started=time.time() - 1000)
    log, out = log_records(tmp_path), printed.getvalue()
    note = out.index("note: --time_limit 900 s leaves 0 s, too little for an evaluation (about ")
    assert code == 0 and "time limit reached" in out and note < out.index("step 1 train_"), out
    assert [(r["step"], r["eval_samples"]) for r in log if r.get("eval")] == [(1, 16)]  # of 32
    # a part is not compared with whole evaluations, nor probed
    assert not (tmp_path / "best.pt").exists() and "layers" not in log[-1]
    assert "(no best: no whole evaluation)" in out.splitlines()[-1], out
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 1
    assert train.STARTED < time.time() and "main(started=STARTED)" in open(train.__file__).read()


def test_a_time_limit_holds_in_a_process_whose_evaluation_costs_many_steps(tiny_data, tmp_path):
    """python train.py --time_limit 15 ends within 15 s, start-up and exit counted, evaluated whole
    and saved, though its evaluation (10 held-out batches, a 1,024-window probe) costs many steps
    a batch, not the third of a step once assumed."""
    (tmp_path / "text").mkdir()
    for name, copies in (("train.txt", 1), ("val.txt", 100)):  # 8,000 held-out windows
        (tmp_path / "text" / name).write_text((tiny_data / "text" / name).read_text() * copies)
    flags = text_flags(tiny_data, "mlm", "--data_dir", tmp_path / "text", "--max_iters", "100000",
                       "--eval_interval", "100000", "--eval_samples", "160", "--probe_samples",
                       "1024", "--time_limit", "15")
    began = time.time()
    done = subprocess.run([sys.executable, "train.py", *map(str, flags), "--out_dir",
                           str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    wall, out = time.time() - began, done.stdout + done.stderr
    evals = [r for r in log_records(tmp_path / "run") if r.get("eval")]
    step_ms, eval_s = map(float, re.search(r"([\d.]+) ms/step.*ion ([\d.]+) s", out).groups())
    assert done.returncode == 0 and "time limit reached" in out and wall <= 15, (wall, out)
    assert len(evals) == 1 and "eval_samples" not in evals[0] and evals[0]["step"] > 10, out
    assert eval_s > 10 * step_ms / 1000, out  # more than a step per held-out batch


def test_a_run_in_a_log_file_says_what_it_does(tiny_data, tmp_path, monkeypatch):
    """Loading the data, a progress line at a bounded rate, the stop on a line of its own, a summary
    on every exit."""
    flags = image_flags(tiny_data, "cls", "--max_iters", "6", "--eval_interval", "6")
    code, out, _ = run_train(*flags, out_dir=tmp_path / "a")  # reads the loss at every step
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("loading folder from "), out
    said = [line for line in lines if re.match(r"step \d/6: loss [\d.]+, lr ", line)]
    assert len(said) == 1 and "min left" in said[0]  # the first, then at most every 30 s
    assert lines[-1].startswith("done: top1 ")
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0)
    code, out, _ = run_train(*flags, "--time_limit", "1e-9", out_dir=tmp_path / "b")
    lines = out.splitlines()
    # a time limit's stop ends as every stop does: evaluated, saved, said
    assert code == 0 and lines[-3].startswith("step 1 train_loss "), out
    assert "time limit reached at step 1; checkpoint saved to" in lines[-2], out
    assert lines[-1].startswith("stopped: top1 ") and "ms/step" in lines[-1]
    code, out, _ = run_train(*flags, out_dir=tmp_path / "c")
    assert len([line for line in out.splitlines() if re.match(r"step \d/6: ", line)]) == 5  # 2-6


def test_a_long_evaluation_says_how_far_it_is_and_the_time_left(capsys, monkeypatch):
    """In a log file (no terminal) an evaluation prints a progress line at most every
    PROGRESS_EVERY_S seconds, never after its last batch; its batches pass through unchanged."""
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    assert list(progress.evaluation_progress(iter(range(4)), 4)) == [0, 1, 2, 3]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [f"evaluating: {i}/4 batches"
                                                     for i in (1, 2, 3)]
    assert all(line.endswith(" s left") for line in lines)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 3600.0)
    assert list(progress.evaluation_progress(iter(range(4)), 4)) == [0, 1, 2, 3]
    assert capsys.readouterr().out == ""  # a short evaluation says nothing


@pytest.mark.parametrize("resume_flags,message", [
    # --resume may raise the iterations and change the rate: here to one that diverges at once
    (["--max_iters", "50", "--eval_interval", "100", "--lr", "1e30"], "loss is"),
    # step 3's loss is still finite; its update is not, and step 3 is an evaluation step
    (["--max_iters", "3", "--lr", "1e30", "--min_lr", "1e30"], "non-finite at step 3"),
])
def test_going_non_finite_keeps_the_last_good_checkpoint_and_says_which(capsys, tiny_data, tmp_path,
                                                                        resume_flags, message):
    train_run(tiny_data, "cls", tmp_path, 2, "--eval_interval", "1")
    good = (tmp_path / "ckpt.pt").read_bytes()
    err = cli_error(capsys, "--resume", "--out_dir", str(tmp_path), *resume_flags, "--grad_clip",
                    "0")
    assert message in err and "still holds step 2" in err
    assert f"continue from it with: python train.py --resume --out_dir {tmp_path}" in err
    assert "lengthen --warmup" in err and "--grad_clip 1.0" in err  # clipping was off, so advised
    assert (tmp_path / "ckpt.pt").read_bytes() == good


def test_non_finite_before_the_first_checkpoint_says_nothing_was_saved_and_the_advice_fits(
        capsys, tiny_data, tmp_path):
    err = cli_error(capsys, *image_flags(tiny_data, "cls", "--max_iters", "50", "--eval_interval",
                                         "100", "--grad_clip", "0", "--warmup", "0", "--lr", "1e30",
                                         "--min_lr", "1e30"), "--out_dir", str(tmp_path))
    assert "no checkpoint was written yet" in err and not (tmp_path / "ckpt.pt").exists()
    advice = str(progress.diverged("x", train.TrainConfig(lr=3e-4, warmup=240), None))  # clip on
    assert "now 0.0003" in advice and "now 240" in advice and "grad_clip" not in advice


# --- 4e. Mistakes and faults: each one line that says what to do

def edited(objective, **fields):
    """A set-up: a trained run in {run} whose checkpoint has fields set (None: removed)."""
    def setup(c):
        ckpt = torch.load(c.trained(objective, c.run), weights_only=True)
        for field, value in fields.items():
            ckpt.pop(field) if value is None else ckpt.update({field: value})
        torch.save(ckpt, c.run / "ckpt.pt")
    return setup


def log_ending(tail, keep=None):
    """A set-up: a trained cls run in {run} whose log ends in tail (after its first `keep` lines,
    the rest following); {n} is the number of tail's line."""
    def setup(c):
        log = c.trained("cls", c.run).with_name("log.jsonl")
        lines = log.read_bytes().splitlines(keepends=True)
        keep_ = len(lines) if keep is None else keep
        log.write_bytes(b"".join(lines[:keep_]) + tail + b"".join(lines[keep_:]))
        return {"{n}": str(keep_ + 1)}
    return setup


def offline_downloads(c):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    c.monkeypatch.setattr(urllib.request, "urlopen", offline)


def log_linked_outside(c):
    (c.tmp / "outside.txt").write_text("the user's own\n")
    c.trained("cls", c.run).with_name("log.jsonl").unlink()
    (c.run / "log.jsonl").symlink_to(c.tmp / "outside.txt")


def killed_before_a_checkpoint(c):
    c.run.mkdir(parents=True, exist_ok=True)
    (c.run / "log.jsonl").write_text('{"run": {}, "from_step": 0}\n')


def fine_tuned_from_mae(c):
    train_run(c.data, "cls", c.run, 1, "--init_from", c.trained("mae", c.tmp / "mae"))


def misshapen(c):  # weights that do not fit the stored config
    ckpt = torch.load(c.trained("mae", c.run), weights_only=True)
    ckpt["model"]["ln_f.weight"] = torch.zeros(3)
    torch.save(ckpt, c.run / "ckpt.pt")


def truncated(c):
    blob = c.trained("mae", c.run).read_bytes()
    (c.run / "ckpt.pt").write_bytes(blob[: len(blob) // 2])


def copied(kind, change=lambda folder: None):
    """A set-up: the tiny data's images or text (jpegs: the mixed JPEGs) copied into {tmp}/kind,
    then changed."""
    def setup(c):
        source = c.request.getfixturevalue("mixed_jpegs") if kind == "jpegs" else c.data / kind
        change(Path(shutil.copytree(source, c.tmp / kind)))
    return setup


def folder_of(classes):
    """A set-up: {tmp}/images, write_folder's images of classes ({split: [names]}), and train/."""
    def setup(c):
        write_folder(c.tmp / "images", classes)
        (c.tmp / "images" / "train").mkdir(exist_ok=True)
    return setup


NO_DATA = ["--dataset", "folder", "--data_dir", "{tmp}"]
MAE_NO_DATA = ["--objective", "mae", "--data_dir", "{tmp}/d"]
RESUME = ["--resume", "--max_iters", "3"]
IMAGES_IN_TMP, TEXT_IN_TMP = ["@cls", "--data_dir", "{tmp}/images"], ["@next", "--data_dir",
                                                                      "{tmp}/text"]
STREAMED = ["--objective", "mae", "--dataset", "folder", "--data_dir", "{tmp}/jpegs", *STREAM_FLAGS,
            "--max_iters", "2", "--workers", "1"]
WIKITEXT = ["--objective", "next", "--dataset", "wikitext2", "--data_dir", "{tmp}/d",
            "--tokenizer", "bytes"]
# train.py's refusals: (set-up, argv, what the one line says); --out_dir is {run} unless given. A
# set-up: an objective (a trained run copied into {run}), "OBJECTIVE:DIR" (into {tmp}/DIR), a
# function of the context (it may return more names to fill in), or a list of them.
TRAIN_REFUSALS = [
    (None, [*NO_DATA, "--log_interval", "0"], "--log_interval 0 must be at least 1"),
    (None, [*NO_DATA, "--layer_decay", "-0.5"], "--layer_decay -0.5 must be in (0, 1]"),
    (None, [*NO_DATA, "--device", "gpu0"], "--device 'gpu0' is not a device"),
    (None, [*NO_DATA, "--lr", "nan"], "--lr nan must be a finite number"),
    (None, [*NO_DATA, "--warmup", "-2"], "--warmup -2 must be >= 0, or -1"),
    (None, [*NO_DATA, "--base_lr", "-0.001"], "--base_lr -0.001 must be a finite number >= 0"),
    (None, [*NO_DATA, "--lr", "1e-5", "--min_lr", "1e-4"],
     "--min_lr 0.0001 must be in [0, --lr 1e-05]"),
    (None, [*NO_DATA, "--beta2", "1.5"], "--beta2 1.5 must be in (0, 1)"),
    (None, [*NO_DATA, "--resume", "--overwrite"], "choose one"),
    (None, [*NO_DATA, "--probe_samples", "-1"], "--probe_samples -1 must be >= 0"),
    (None, [*NO_DATA, "--patch_size", "0"], "Config.patch_size=0 must divide image_size=32"),
    (None, [*NO_DATA, "--weight_decay", "-0.1"], "--weight_decay -0.1 must be >= 0"),
    (None, [*NO_DATA, "--threads", "-1"], "--threads -1 must be >= 0"),
    (None, [*NO_DATA, "--time_limit", "inf"],
     "--time_limit inf must be a number of seconds >= 0 (0 means no limit)"),
    (None, [*NO_DATA, "--mask_ratio", "0.005"],
     "Config.mask_ratio=0.005 must hide some patches and leave others"),
    (None, [*NO_DATA, "--mask_ratio", "0.995"],
     "Config.mask_ratio=0.995 must hide some patches and leave others"),
    (None, ["--seed", "99999999999999999999999"], "--seed 99999999999999999999999 must fit in 64"),
    (None, [*MAE_NO_DATA, "--dataset", "cifar10", "--stream", "on"],
     "--stream on reads an image folder"),
    (None, [*MAE_NO_DATA, "--workers", "-2"], "--workers -2 must be"),
    (None, [*MAE_NO_DATA, "--crop_scale", "1.5"], "--crop_scale 1.5 must be"),
    (None, [*MAE_NO_DATA, "--memory_gb", "-1"], "--memory_gb -1.0 must be"),
    # the data: missing, unreadable, not what the objective needs
    (None, ["@cls", "--data_dir", "{tmp}/nope"],
     "nope does not exist; point --data_dir at an image folder"),
    (lambda c: (c.tmp / "a_file").write_text("x"), ["@cls", "--data_dir", "{tmp}/a_file"],
     "a_file is a file, not a folder; point --data_dir at an image folder"),
    (copied("images", lambda f: (f / "test" / "red" / "broken.png").write_bytes(
        b"\x89PNG\r\n\x1a\n not really")), IMAGES_IN_TMP, "broken.png (UnidentifiedImageError"),
    (folder_of({"train": ["cat", "dog"], "test": ["dog", "emu"]}), IMAGES_IN_TMP,
     "classes (only in training: ['cat'], only in test: ['emu'])"),
    (folder_of({"train": ["all"], "test": ["all"]}), IMAGES_IN_TMP,
     "num_classes=1 must be at least 2 for cls"),
    (folder_of({"test": ["a", "b"]}), IMAGES_IN_TMP, "train: Couldn't find any class folder"),
    ([folder_of({"train": ["a", "b"], "test": ["a", "b"]}), lambda c: (c.tmp / "images/test/c")
      .mkdir() or (c.tmp / "images/test/c/notes.txt").write_text("not an image")], IMAGES_IN_TMP,
     "test: Found no valid file for the classes c"),
    (copied("text", lambda f: (f / "train.txt").write_text("")), TEXT_IN_TMP,
     "train.txt is empty; give --train_file a file with text in it"),
    (copied("text", lambda f: (f / "train.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)),
     TEXT_IN_TMP, "train.txt is not UTF-8 text (byte 3 is 0xe9); convert it, e.g. iconv"),
    (None, ["@next", "--val_file", "nosuch.txt"],
     "nosuch.txt is missing; put the text there, or point --data_dir and --val_file"),
    (copied("text", lambda f: (f / "folder.txt").mkdir()),
     [*TEXT_IN_TMP, "--val_file", "folder.txt"], "folder.txt is not a file (a folder, a pipe)"),
    (None, ["@cls", "--objective", "next"],
     "a text model (next) cannot be run on --dataset folder; use wikitext2 or wikitext103 or text"),
    (None, ["@cls", "--heads", "3"], "Config.heads=3"),
    (copied("jpegs", lambda f: shutil.rmtree(f / "val" / "fox") or (f / "val" / "fox").mkdir()),
     STREAMED, "Found no valid file for the classes fox"),  # a streamed folder: before any work
    (copied("jpegs", lambda f: shutil.rmtree(f / "val")), STREAMED, "no test/ or val/ folder in"),
    # the out_dir is checked before any data is read; a failed start leaves no out_dir behind
    (lambda c: c.run.mkdir(), [*NO_DATA[:3], "{tmp}/no-data"], "does not exist"),  # the user's
    (lambda c: (c.tmp / "file").write_text("not a folder"),
     [*NO_DATA[:3], "{tmp}/no-data", "--out_dir", "{tmp}/file"], "is a file"),
    (None, [*NO_DATA[:3], "{tmp}/no-data", "--out_dir", ""], "--out_dir '' must name a folder"),
    (lambda c: c.monkeypatch.delattr(torch.compiler, "set_stance"),  # as in torch 2.5 and older
     NO_DATA, ("is older than 2.6", "requirements.txt")),
    # a download that fails leaves nothing half-written
    (offline_downloads, WIKITEXT, ("could not download wikitext2", "--dataset text")),
    (offline_downloads, ["--dataset", "cifar10", "--data_dir", "{tmp}/c"],
     "could not download cifar10"),
    # flags that would silently do nothing, or not what they say
    (None, ["--preset", "wikitext-small", "--dataset", "folder", "--data_dir", "{images}"],
     "--preset wikitext-small is a text preset (its recipe is for text)"),
    (None, ["@next", "--vocab_size", "50257"],
     "--vocab_size 50257 differs from the tokenizer's 256 ids"),
    (None, ["@next", "--stream", "on"], "--stream 'on' reads image files; --dataset text is text"),
    ("next", ["--init_from", "{run}/ckpt.pt", "--eval_only", "--stream", "on", "--out_dir",
              "{tmp}/e"], "--stream 'on' reads image files; --dataset text is text"),
    # fine-tuning from a trunk that does not fit would silently train from scratch
    ("next:next", ["@cls", "--max_iters", "1", "--init_from", "{tmp}/next/ckpt.pt"],
     ("does not hold this model's trunk: 2 tensors", "patch_embed.weight, patch_embed.bias)")),
    ("mae:mae", ["@cls", "--max_iters", "1", "--init_from", "{tmp}/mae/ckpt.pt", "--width", "64"],
     ("blocks.0.ln1.weight, ...); fine-tune", "--width")),
    # --eval_only scores a checkpoint as it was trained, and saves nothing
    ("cls", ["--eval_only", "--overwrite"],
     "--eval_only saves nothing, so it replaces nothing; drop --overwrite"),
    ("cls", ["--overwrite", "--init_from", "{run}/best.pt"],  # never the old run's to remove
     "--overwrite would remove --init_from {run}/best.pt with the run in"),
    ("cls", ["--eval_only", "--init_from", "{run}/best.pt", "--objective", "mae", "--depth", "1",
             "--out_dir", "{tmp}/score"], "error: --eval_only --init_from {run}/best.pt scores "
     "that checkpoint as it was trained; drop --depth --objective"),
    # a run's out_dir is never replaced unless told, nor by a mistyped --overwrite
    ("cls", ["@cls", "--max_iters", "2", "--eval_interval", "2"],
     ("holds another run", "--overwrite", "--resume")),
    (killed_before_a_checkpoint, ["@cls", "--max_iters", "1"],
     ("(log.jsonl); it saved no checkpoint to resume; choose another --out_dir", "--overwrite")),
    ("cls", ["@cls", "--data_dir", "{tmp}/nosuch", "--overwrite"], "nosuch"),
    ("cls", ["@next", "--tokenizer", "nosuch_bpe", "--overwrite"], "nosuch_bpe"),
    (log_linked_outside, RESUME,
     "log.jsonl is a link; a run writes only its own files in --out_dir"),
    # --resume continues the same run, from a checkpoint and log it can read, or says why not
    (fine_tuned_from_mae, [*RESUME, "--init_from", "{tmp}/other.pt"],
     ("--init_from counts only when a run starts", "mae/ckpt.pt")),
    ("cls", ["--resume", "--batch_size", "8"], ("batch_size=16, not 8", "--max_iters")),
    ("cls", ["--resume", "--batch_size", "8", "--depth", "3"],  # every one in the same line
     ("has batch_size=16, not 8, depth=2, not 3; --resume", "; drop --batch_size --depth")),
    ("cls", ["--resume", "--base_lr", "1e-3"],
     "base_lr=0.0003, not 0.001; --resume may change only --max_iters --lr "),
    ("mae", ["--resume", "--objective", "cls"], ("objective='mae'", "--init_from")),
    (misshapen, ["--resume"], "does not match its own config"),
    (truncated, ["--resume"], "corrupt or truncated"),
    (edited("cls", step="three"), ["--resume"], "{run}/ckpt.pt"),
    (edited("cls", rng=[1, 2]), ["--resume"], "{run}/ckpt.pt"),
    (edited("cls", config=[1]), ["--resume"], "{run}/ckpt.pt"),
    (edited("cls", fingerprint=None), ["--resume"],  # as 0bbb605 wrote it
     "predates the data check of this version; resume it with commit 0bbb605"),
    (edited("next", window=None), ["--resume"],  # as written before 2026-11-27
     "was written by a development version before 2026-11-27; read it with commit 0bbb605"),
    (log_ending(b"[1]\n"), RESUME, "line {n} is not a record train.py writes ([1]); the log is "),
    (log_ending(b'{"step": null}\n'), RESUME,
     'line {n} is not a record train.py writes ({"step": null}); the log is damaged'),
    (log_ending(b'{"step": 3, "lo\n'), RESUME,  # whole, as a kill never leaves it
     'line {n} is not a record train.py writes ({"step": 3, "lo)'),
    (log_ending(b'{"step": 1, "lo\n', keep=2), RESUME,  # cut short: only the last may be
     'line 3 is not a record train.py writes ({"step": 1, "lo)'),
    (log_ending(b"\xff\n"), RESUME, "{run}/log.jsonl is not a log train.py wrote (not UTF-8 text)"),
]


@pytest.mark.parametrize("setup, argv, says", TRAIN_REFUSALS)
def test_each_mistake_is_one_line_that_changes_no_file(capsys, tmp_path, table_row, setup, argv,
                                                      says):
    """Refused before any work, in one line that says what to do; no file written or changed."""
    argv, says = table_row(setup, argv, says)
    argv += [] if "--out_dir" in argv else ["--out_dir", str(tmp_path / "run")]
    out_dir = Path(argv[argv.index("--out_dir") + 1])
    before = tree(tmp_path), out_dir.exists()
    err = cli_error(capsys, *argv)
    assert all(p in err and (err.startswith(p) or not p.startswith("error: ")) for p in says), err
    assert (tree(tmp_path), out_dir.exists()) == before


def test_flags_are_never_matched_by_a_prefix(capsys, tmp_path):
    train_parse = train.build_parser().parse_args
    for parse, argv in ((train_parse, ["--max_iter", "5"]),
                        (probe.build_parser().parse_args, ["x.pt", "--sample", "4"]),
                        (bench.build_parser().parse_args, ["cls:cifar-tiny", "--batch", "4"]),
                        (look.build_parser().parse_args, ["curves", "run", "--ou", "c.png"]),
                        (export.main, ["x.pt", "--out", "a.safetensors", "--ou", "b"])):
        with pytest.raises(SystemExit):
            parse(argv)
        err = capsys.readouterr().err
        assert "unrecognized arguments" in err
        if parse == train_parse:  # one line, not usage's thirty
            assert err.count("\n") == 1 and err.endswith("--help lists every flag)\n"), err


def test_a_log_that_cannot_be_written_is_one_line_and_the_checkpoint_resumes(capsys, tiny_data,
                                                                             tmp_path, monkeypatch):
    calls = {"n": 0}
    dumps = train.json.dumps

    # the run's first record (what made it), step 1's log line and evaluation, then the disk is full
    def disk_fills_at_step_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(28, "No space left on device")
        return dumps(*args, **kwargs)

    monkeypatch.setattr(train.json, "dumps", disk_fills_at_step_2)
    err = cli_error(capsys, *image_flags(tiny_data, "cls", "--max_iters", "3", "--eval_interval",
                                         "1"), "--log_interval", "1", "--out_dir", str(tmp_path))
    monkeypatch.undo()
    assert "(No space left on device); the last checkpoint is as it was" in err
    assert "--resume" in err and torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 1
    code, out, _ = run_train("--resume", out_dir=tmp_path)
    assert code == 0 and "resumed from" in out and "at step 1" in out, out


def test_running_out_of_memory_is_one_line_that_names_the_batch(capsys, tiny_data, tmp_path,
                                                                 monkeypatch):
    def too_large(data, draws):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "83886080000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(ImageData, "train_batch", too_large)
    err = cli_error(capsys, *image_flags(tiny_data, "cls", "--max_iters", "1"), "--out_dir",
                    str(tmp_path))
    assert err.startswith("error: out of memory (DefaultCPUAllocator") and "--batch_size" in err


def test_a_failure_is_one_line_that_says_truthfully_what_is_left_and_others_still_raise(
        capsys, tmp_path, monkeypatch):
    """A rank whose peer died, a streaming worker killed, an interrupt: each one line, saying
    whether a checkpoint is left to resume."""
    def peer_gone():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                           "by peer [127.0.0.1]:2")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with one_line_errors(str(tmp_path)) as outcome:
        peer_gone()
    assert outcome.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: another rank of this DDP run stopped ([../third_party/gloo")
    assert err.count("\n") == 1 and "nothing to resume" in err
    with one_line_errors(str(tmp_path)) as outcome:  # torch's words for a worker killed mid-run
        raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    err = capsys.readouterr().err
    assert outcome.code == 2 and err.count("\n") == 1
    assert err.startswith("error: a streaming worker died (DataLoader worker (pid(s) 4242) exited")
    monkeypatch.setenv("WORLD_SIZE", "1")  # alone, the same words are not about a peer
    with pytest.raises(RuntimeError, match="Connection closed"):
        with one_line_errors(str(tmp_path)):
            peer_gone()

    def interrupted_twice(args, started):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train", interrupted_twice)
    assert train.main(["--out_dir", str(tmp_path)]) == 130
    assert "no checkpoint was written, so there is nothing to resume" in capsys.readouterr().err
    (tmp_path / "ckpt.pt").write_bytes(b"")
    assert train.main(["--out_dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "the last checkpoint is as it was; continue with: python train.py --resume" in err


# ==================================================================================================
# 5. probe.py: every metric on regimes whose answer is known, and its command line
# ==================================================================================================

def test_each_evaluation_logs_the_probes_layer_metrics_exactly_and_disturbs_nothing(
        capsys, tiny_data, tmp_path, monkeypatch):
    """Each evaluation logs probe.py's own per-layer metrics for the checkpoint; a run with them
    trains bit for bit as one without; look.py draws them for several runs."""
    flags = image_flags(tiny_data, "mae", "--max_iters", "4", "--eval_interval", "2")
    code, out, logged = run_train(*flags, "--probe_samples", "8", out_dir=tmp_path / "a")
    assert code == 0, out
    evals = [r for r in logged if r.get("eval")]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(len(r["layers"]["abs_cos_centered"]) == 3 for r in evals)  # stem + 2 blocks
    ckpt = str(tmp_path / "a" / "ckpt.pt")
    assert probe.main([ckpt, "--samples", "8", "--json", str(tmp_path / "p.json")]) == 0
    report = json.loads((tmp_path / "p.json").read_text())["metrics"]
    for name in ("std", "cos", "abs_cos_centered", "hc_dc", "erank", "attn_entropy"):
        ours, probes = evals[-1]["layers"][name], report[name][ckpt]
        assert [v is None for v in ours] == [v is None for v in probes], name  # attn_entropy[0]
        assert [v for v in ours if v is not None] == pytest.approx(
            [v for v in probes if v is not None], rel=1e-5), name
    code, out, plain = run_train(*flags, "--probe_samples", "0", out_dir=tmp_path / "b")
    assert code == 0 and not any("layers" in r for r in plain)
    assert train_losses(plain) == train_losses(logged)
    weights = [torch.load(tmp_path / run / "ckpt.pt", weights_only=True)["model"] for run in "ab"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    capsys.readouterr()
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    drawn, save_figure = [], look.save_figure
    monkeypatch.setattr(look, "save_figure", lambda fig, path: drawn.append(fig) or
                        save_figure(fig, path))
    assert look.main(["smoothing", str(tmp_path / "a"), str(tmp_path / "c"), "--out",
                      str(tmp_path / "s.png")]) == 0
    labels = [ax.get_ylabel() for ax in drawn[0].axes]  # two heatmaps, the last layer, the bar
    assert labels == ["layer (0 = embedding)"] * 2 + ["", "abs_cos_centered"]  # named once
    printed = capsys.readouterr().out
    assert "a: abs_cos_centered of the last layer at steps [2, 4]: " in printed
    assert "\nc: abs_cos_centered of the last layer" in printed
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert look.main(["smoothing", str(tmp_path / "a"), "--metric", "erank", "--out",
                      str(tmp_path / "e.png")]) == 0
    assert "a: erank of the last layer at steps [2, 4]: " in capsys.readouterr().out
    assert look.main(["smoothing", str(tmp_path / "b"), "--out", str(tmp_path / "t.png")]) == 2
    assert "logged no per-layer metrics (trained with --probe_samples 0" in capsys.readouterr().err
    # what train.py writes when the probe met non-finite states ("layers": null), or a null value
    records = (tmp_path / "c" / "log.jsonl").read_text().splitlines()
    evals = [i for i, line in enumerate(records) if '"eval": true' in line]
    first, last = json.loads(records[evals[0]]), json.loads(records[evals[-1]])
    first["layers"], last["layers"]["abs_cos_centered"][-1] = None, None
    records[evals[0]], records[evals[-1]] = json.dumps(first), json.dumps(last)
    (tmp_path / "c" / "log.jsonl").write_text("\n".join(records) + "\n")
    assert look.main(["smoothing", str(tmp_path / "c"), "--out", str(tmp_path / "u.png")]) == 0
    assert "c: abs_cos_centered of the last layer at steps [4]: nan" in capsys.readouterr().out


@pytest.mark.parametrize("tool, flag", [("probe", "--json"), ("probe", "--plot"), ("look", "--out"),
                                        ("bench", "--json")])
def test_no_tool_writes_over_a_runs_own_files_and_a_name_too_long_is_one_line(capsys, tmp_path,
                                                                              tool, flag):
    """One check of an output path for every tool that writes, before any work: a run's own files,
    a missing folder, a folder; the system's write errors are one line too."""
    model = Bamboo(tiny("cls"))
    checkpoint.save(str(tmp_path / "c.pt"), {"config": model.config.to_dict(),
                                             "model": model.state_dict(), "window": None})
    main, args = {"probe": (probe.main, ["init:cifar-tiny", "--dataset", "folder", "--data_dir",
                                         str(tmp_path / "no-data")]),
                  "look": (look.main, ["curves", str(tmp_path / "run")]),
                  "bench": (bench.main, ["cls:cifar-tiny", "--steps", "1", "--rounds", "1",
                                         "--warmup", "1", "--batch_size", "2"])}[tool]
    (tmp_path / "run").mkdir()
    for name in RUN_FILES:
        (tmp_path / "run" / name).write_text(name)
        assert main([*args, flag, str(tmp_path / "run" / name)]) == 2
        err = capsys.readouterr().err
        assert "is a training run's own file; write the output elsewhere" in err, err
        assert err.count("\n") == 1 and (tmp_path / "run" / name).read_text() == name
    for path, says in ((tmp_path / "no" / "x.png", "no does not exist"), (tmp_path, "is a folder")):
        assert main([*args, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    if tool == "bench":  # written at once, without a temporary file's own checks
        long = str(tmp_path / ("x" * 300 + ".json"))
        assert main([*args, flag, long]) == 2
        err = capsys.readouterr().err
        assert "(File name too long); write elsewhere" in err and err.count("\n") == 1, err


def test_probe_json_is_written_atomically_and_a_failed_write_leaves_nothing_behind(
        capsys, tiny_data, tmp_path, monkeypatch):
    (tmp_path / "p.json").write_text("the previous report")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    argv = ["init:cifar-tiny,image_size=16,depth=1", "--dataset", "folder", "--data_dir",
            str(tiny_data / "images"), "--samples", "2", "--json", str(tmp_path / "p.json")]
    monkeypatch.setattr(probe.json, "dumps", full_disk)
    assert probe.main(argv) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert f"could not write {tmp_path / 'p.json'} (No space left on device)" in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temporary file left
    assert (tmp_path / "p.json").read_text() == "the previous report" and probe.main(argv) == 0
    assert json.loads((tmp_path / "p.json").read_text())["depth"] == {argv[0]: 1}


def test_identical_tokens_are_fully_smoothed_orthogonal_ones_not_at_all_and_batches_average():
    m = token_metrics(torch.randn(3, 1, 16).expand(3, 10, 16))
    assert m["cos"] == pytest.approx(1.0) and m["std"] == pytest.approx(0.0, abs=1e-9)
    assert m["hc_dc"] == pytest.approx(0.0, abs=1e-9) and m["erank"] == pytest.approx(1.0)
    m = token_metrics(torch.zeros(2, 5, 8))  # collapsed, exactly zero: identical all the same
    assert m["cos"] == 1.0 and m["abs_cos_centered"] == 1.0 and m["std"] == 0.0
    h = (torch.eye(12)[:8] * torch.arange(1, 9)[:, None]).expand(2, 8, 12)  # 8 orthogonal tokens
    assert token_metrics(h)["cos"] == pytest.approx(0.0, abs=1e-12)
    torch.manual_seed(0)
    for k in (1, 3, 7):  # rank k: effective rank k
        u, _ = torch.linalg.qr(torch.randn(20, k, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(32, k, dtype=torch.float64))
        assert token_metrics((u @ v.T)[None])["erank"] == pytest.approx(k, rel=1e-6)
    h = torch.randn(6, 10, 24) + torch.randn(6, 1, 24)  # a batch: the mean of its samples'
    for name, value in token_metrics(h).items():
        assert value == pytest.approx(np.mean([token_metrics(h[i:i + 1])[name] for i in range(6)]),
                                      rel=1e-9)


def test_gaussian_tokens_abs_centred_cosine_is_that_of_random_directions():
    """Centred i.i.d. N(0, I_d) tokens have pairwise cosines close to N(rho, (1 - rho^2) / d), rho
    = -1/(T-1); E|N(mu, s^2)| = s sqrt(2/pi) exp(-mu^2 / 2s^2) + mu (1 - 2 Phi(-mu/s))."""
    torch.manual_seed(0)
    T, d = 32, 1024
    rho = -1 / (T - 1)
    s = math.sqrt((1 - rho ** 2) / d)
    phi = 0.5 * (1 + math.erf(-rho / s / math.sqrt(2)))
    expected = s * math.sqrt(2 / math.pi) * math.exp(-rho ** 2 / (2 * s ** 2)) + rho * (1 - 2 * phi)
    m = token_metrics(torch.randn(16, T, d) + 5.0)  # an offset: raw cos high, centred not
    assert m["abs_cos_centered"] == pytest.approx(expected, rel=0.02) and m["cos"] > 0.9


def test_residual_attention_stack_contracts_tokens_and_every_metric_says_so():
    torch.manual_seed(0)
    m = per_layer(attention_stack(torch.randn(4, 32, 64, dtype=torch.float64), 48, residual=True))
    deep = slice(24, 49)

    def increasing(values):
        return all(b > a for a, b in zip(values[deep], values[deep][1:]))

    def decreasing(values):
        return all(b < a for a, b in zip(values[deep], values[deep][1:]))

    assert m["cos"][-1] > 0.99 and increasing(m["cos"])
    assert m["hc_dc"][-1] < m["hc_dc"][0] / 50 and decreasing(m["hc_dc"])
    assert m["erank"][-1] < 3 and decreasing(m["erank"])
    # the centred tokens line up early and then keep their angles while they shrink: the absolute
    # cosine ends well above layer 0, never falling back over the deep half (a plateau, to rounding)
    centred = m["abs_cos_centered"]
    assert centred[-1] > centred[0] + 0.1 and centred[0] > 0.05
    assert all(b > a - 1e-3 for a, b in zip(centred[deep], centred[deep][1:]))


def test_pure_attention_stack_collapses_and_centred_metrics_do_not_call_it_diverse():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        m = per_layer(attention_stack(torch.randn(4, 32, 64, dtype=dtype), 8, residual=False))
        # within a few layers the tokens agree to rounding: the centred vectors are noise
        for name, collapsed in (("cos", 1.0), ("abs_cos_centered", 1.0), ("erank", 1.0)):
            assert m[name][-1] == pytest.approx(collapsed, abs=1e-4), name
        assert m["abs_cos_centered"][0] < 0.2  # diverse at the start
        assert m["hc_dc"][-1] < 1e-5 and m["std"][-1] < 1e-5 * m["std"][0]


def test_attention_entropy_and_the_update_ratio_known_and_reported_for_every_block():
    T = 10
    uniform = torch.full((2, 3, T, T), 1 / T)
    one_hot = torch.eye(T).expand(2, 3, T, T)
    assert attention_entropy(uniform).tolist() == pytest.approx([math.log(T)] * 2)
    assert attention_entropy(one_hot).tolist() == [0.0, 0.0]
    before = torch.randn(3, 6, 8)  # the update: the relative change of the stream
    assert update_ratio(before, 1.5 * before).tolist() == pytest.approx([0.5] * 3)
    assert update_ratio(before, before).tolist() == [0.0] * 3
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=3)).eval()
    x, _ = batch(model.config)
    report = probe.probe_model(model, x, 2)
    T = model.config.num_patches()
    assert report["update"][0] is None and report["attn_entropy"][0] is None
    assert report["attn_sim"][:2] == [None] * 2
    assert all(0 < e <= math.log(T) + 1e-9 for e in report["attn_entropy"][1:])
    with torch.no_grad():
        hiddens = model.hidden_states(x)
    expected = np.mean([(b - a).norm().item() / a.norm().item() for a, b in
                        zip(hiddens[1][:, None], hiddens[2][:, None])])  # block 2, sample by sample
    assert report["update"][2] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("tokens,width", [(16, 48), (48, 16)])
def test_singular_values_from_the_gram_matrix_equal_svdvals(tokens, width):
    torch.manual_seed(0)
    h = torch.randn(3, tokens, width, dtype=torch.float64)
    # rank 2
    h[1] = torch.randn(tokens, 2, dtype=torch.float64) @ torch.randn(2, width, dtype=torch.float64)
    expected = torch.linalg.svdvals(h).flip(-1)  # descending there, ascending here
    assert torch.allclose(singular_values(h), expected, atol=1e-6 * expected.max())


def test_vo_spectrum_of_a_hand_built_product_and_head_products_have_the_full_eigenvalues():
    model = Bamboo(tiny("cls", width=8, heads=2, depth=1))
    model.blocks[0], _ = hand_built_block(torch.ones(8))
    dominant, positive = vo_spectrum(model)
    assert dominant == [0.0] and positive == [pytest.approx(6 / 8)]  # head 0: +3, head 1: -2
    # LayerNorm gain is folded in: flipping head 1's channels flips its eigenvalues' signs
    model.blocks[0], _ = hand_built_block(torch.tensor([1.0] * 4 + [-1.0] * 4))
    dominant, positive = vo_spectrum(model)
    assert dominant == [1.0] and positive == [pytest.approx(4 / 8)]
    torch.manual_seed(0)
    block = Bamboo(tiny("cls", width=32, heads=2, depth=1)).blocks[0]
    with torch.no_grad():
        block.ln1.weight.normal_()
    small = head_value_output(block)
    w_v = block.attn.qkv.weight.detach().double()[64:]
    w_o, g = block.attn.proj.weight.detach().double(), block.ln1.weight.detach().double()
    for h in range(2):  # (32, 32), rank 16
        full = torch.diag(g) @ w_v[16 * h:16 * (h + 1)].T @ w_o[:, 16 * h:16 * (h + 1)].T
        big = torch.linalg.eigvals(full)
        big = big[big.abs().argsort(descending=True)][:16]
        assert torch.allclose(torch.linalg.eigvals(small[h]).abs().sort().values,
                              big.abs().sort().values, atol=1e-8)


def test_beta_of_a_model_against_itself_is_one():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=3))
    qk, v = beta(model, model)
    assert qk == [1.0, 1.0, 1.0] and v == [1.0, 1.0, 1.0]
    scaled = Bamboo(tiny("cls", depth=3))
    scaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        for block in scaled.blocks:
            block.attn.qkv.weight.mul_(2)
    qk, v = beta(scaled, model)
    assert qk == pytest.approx([4.0] * 3) and v == pytest.approx([2.0] * 3)


def test_probe_writes_json_and_png_and_repeats_exactly(capsys, tiny_data, trained, tmp_path):
    argv = [trained("cls", tmp_path / "cls"), "init:cifar-tiny,image_size=16,neutreno=0.6",
            "--labels", "trained,init", "--dataset", "folder", "--data_dir", tiny_data / "images",
            "--samples", "8", "--batch_size", "3"]
    code, out = probe_cli(capsys, *argv, "--json", tmp_path / "a.json", "--plot",
                          tmp_path / "a.png")
    assert code == 0 and out.out.endswith(f"wrote {tmp_path}/a.json\nwrote {tmp_path}/a.png\n")
    code, _ = probe_cli(capsys, *argv, "--json", tmp_path / "b.json", "--relative", "--plot",
                        tmp_path / "b.png")
    assert code == 0 and (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["labels"] == ["trained", "init"] and report["layers"] == [0, 1, 2, 3, 4]
    for name in ("std", "cos", "abs_cos_centered", "hc_dc", "erank", "update", "attn_entropy",
                 "attn_sim", "vo_dominant", "vo_positive", "beta_qk", "beta_v"):
        for label in report["labels"]:
            assert len(report["metrics"][name][label]) == 5
    # itself; padded to 5
    assert report["metrics"]["beta_v"]["trained"] == [None, 1.0, 1.0, None, None]
    assert report["metrics"]["beta_v"]["init"][1:] == [None] * 4  # depth 2 vs 4: no pairs
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "trained" in out.out and "abs_cos_centered" in out.out
    for relative, last, label in ((False, 4, "layer"), (True, 1.0, "relative depth")):
        axes = [ax for ax in probe.probe_figure(report, relative).axes if ax.get_lines()]
        assert max(x for ax in axes for line in ax.get_lines() for x in line.get_xdata()) == last
        assert all(ax.get_xlabel().startswith(label) for ax in axes)  # --relative: layer / depth


def test_the_probe_table_fits_100_columns_and_the_figure_says_which_way_is_smoother(
        capsys, tiny_data, trained, tmp_path):
    code, out = probe_cli(capsys, trained("cls", tmp_path / "cls"),
                          "init:cifar-tiny,image_size=16,depth=2,width=32",  # trained's shape
                          "--labels", "trained,fresh", "--dataset", "folder", "--data_dir",
                          tiny_data / "images", "--samples", "4", "--json", tmp_path / "p.json")
    assert code == 0 and max(len(line) for line in out.out.splitlines()) <= 100
    assert "probing trained (1 of 2) ...\nprobing fresh (2 of 2) ..." in out.out  # progress
    assert all(name in out.out for name in probe.TOKEN_METRICS + probe.LAYER_METRICS
               + probe.WEIGHT_METRICS)
    assert "over those of trained" in out.out
    figure = probe.probe_figure(json.loads((tmp_path / "p.json").read_text()), relative=False)
    labels = {ax.get_title(): ax.get_ylabel().replace("\n", " ") for ax in figure.axes
              if ax.get_title()}
    assert set(labels) == set(probe.AXES)  # every metric has its panel, none without a label
    smoothing = [name for name, label in labels.items() if "smooth" in label]
    assert len(smoothing) >= 8 and labels["beta_v"] == "ratio to trained; above 1: larger"
    report = probe.main([str(tmp_path / "cls" / "ckpt.pt"), "--samples", "1000", "--json",
                         str(tmp_path / "p.json")])  # more samples than the held-out split's
    assert report == 0 and json.loads((tmp_path / "p.json").read_text())["samples"] == 32
    assert "note: the held-out split has 32 samples; probed 32, not 1000" in capsys.readouterr().out


def test_probe_mask_sees_only_visible_patches(capsys, tiny_data, tmp_path):
    samples = torch.rand(4, 3, 16, 16)
    classifier, _ = probe.load_model("init:cifar-tiny,image_size=16", "folder")
    with pytest.raises(ValueError, match="--mask probes MAE's visible patches; it needs an MAE"):
        probe.probe_model(classifier, samples, 4, mask=True)  # every Config has a mask_ratio
    model, _ = probe.load_model("init:cifar-tiny,image_size=16,objective=mae", "folder")
    full = probe.probe_model(model, samples, 4)
    masked = probe.probe_model(model, samples, 4, mask=True)
    assert full["std"] != masked["std"]
    assert full["attn_entropy_ceiling"][-1] == pytest.approx(math.log(16))  # every patch
    assert masked["attn_entropy_ceiling"][-1] == pytest.approx(math.log(4))  # MAE's 25% visible
    visible = model.hidden_states(samples, mask_ratio=0.75, noise=torch.rand(4, 16))[-1]
    assert visible.shape[1] == 4  # round(16 * 0.25) patches


def test_probe_and_bench_run_on_the_device_and_threads_they_are_given(capsys, tiny_data):
    try:
        code, out = probe_cli(capsys, "init:cifar-tiny,image_size=16", "--dataset", "folder",
                              "--data_dir", tiny_data / "images", "--samples", "2", "--device",
                              "cpu", "--threads", "2")
        assert code == 0 and torch.get_num_threads() == 2, out.err
        torch.set_num_threads(1)
        assert bench.main(["cls:cifar-tiny,image_size=16", "--device", "cpu", "--threads", "2",
                           "--steps", "1", "--rounds", "1", "--warmup", "1"]) == 0
        assert "device cpu, batch 8, 1 rounds x 1 steps (fastest round), 2 threads" in (
            capsys.readouterr().out)
    finally:
        torch.set_num_threads(1)  # the suite's, for the tests after this one


def test_foreign_specs_take_true_and_false_in_any_case_and_failed_loads_give_advice_that_fits(
        monkeypatch):
    """Never a text that reads as True (offline: no download); a pickle behind a spec is refused in
    one line (no code ran); an unknown name offline advises pretrained=0 only where not given."""
    vit = hub.load(TIMM_VIT.replace("pretrained=0", "pretrained=False") + ",class_token=no,"
                        "qkv_bias=false,global_pool=avg").model
    assert vit.cls_token is None and vit.blocks[0].attn.qkv.bias is None
    gpt2 = hub.load(HF_TINY["gpt2"] + ",reorder_and_upcast_attn=TRUE,layer_norm_epsilon=1")
    assert gpt2.model.config.reorder_and_upcast_attn is True
    assert gpt2.model.config.layer_norm_epsilon == 1.0
    assert cli.config_from_spec("cifar-tiny,checkpointing=TRUE").checkpointing is True

    def refused(name, pretrained, settings):
        raise pickle.UnpicklingError("Weights only load failed")

    monkeypatch.setattr(hub, "hf_model", refused)
    with pytest.raises(ValueError, match="a pickle with more than tensors, which is not loaded"):
        hub.load("hf:./local-folder")

    def offline(name, pretrained, settings):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(hub, "hf_model", offline)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: False)  # the network is up
    with pytest.raises(ValueError) as e:
        hub.load("hf:gpt3,pretrained=0")
    assert "with pretrained=0 the name must be a model type (" in str(e.value)
    assert "pass pretrained=0" not in str(e.value)
    with pytest.raises(ValueError, match="check the name and the network, or pass pretrained=0"):
        hub.load("hf:gpt3")


def test_every_tool_says_out_of_memory_and_unwritable_outputs_by_name_in_one_line(capsys, tmp_path,
                                                                                   monkeypatch):
    """The tools share one mapping of errors to lines; an output that cannot be written is named
    as the user gave it, never as its hidden temporary file."""
    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(bench, "run", out_of_memory)
    assert bench.main(["cls:cifar-tiny,width=100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory (CUDA out of memory.") and err.count("\n") == 1

    def read_only(dir, prefix, suffix):
        raise PermissionError(13, "Permission denied", os.path.join(dir, prefix + "x1" + suffix))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OSError) as e:
        figures.save_figure(None, str(tmp_path / "fig.png"))
    assert e.value.filename == str(tmp_path / "fig.png")


def test_non_finite_hidden_states_are_named_not_fed_to_the_eigen_solver():
    model = Bamboo(tiny("cls"))
    with torch.no_grad():
        model.blocks[1].mlp.proj.bias[0] = float("nan")  # finite through block 0, not after block 1
    with pytest.raises(ValueError,
                       match="layer 2's hidden states are not finite on samples 0 to 3"):
        probe.probe_model(model, batch(model.config, B=6)[0], 4)


def hub_offline(what, network_up=False):
    """A set-up: transformers' `what` cannot reach the hub (and hub_unreachable says it can)."""
    def setup(c):
        def offline(*args, **kwargs):
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

        c.monkeypatch.setattr(getattr(transformers, what), "from_pretrained", offline)
        if network_up:
            c.monkeypatch.setattr(hub, "hub_unreachable", lambda: False)
    return setup


IMAGES, TEXT = ["--dataset", "folder", "--data_dir", "{images}"], ["--dataset", "text",
                                                                   "--data_dir", "{text}"]
T5 = "hf:t5,pretrained=0,num_layers=1,d_model=32,num_heads=2,d_ff=64,d_kv=16,vocab_size=300"
PROBE_REFUSALS = [  # (set-up, argv, what the one line says), as table_row reads them
    ("next", ["{run}/ckpt.pt", *IMAGES], "a text model (next) cannot be run on --dataset folder; "
                                         "use"),
    (None, ["{tmp}/missing.pt"], "no checkpoint at"),
    (None, ["{tmp}"], "{tmp} is a folder; pass a checkpoint in it, e.g. {tmp}/ckpt.pt"),
    (lambda c: (c.tmp / "corrupt.pt").write_bytes(b"not a checkpoint"), ["{tmp}/corrupt.pt"],
     "corrupt or truncated"),
    (None, ["init:bamboo-zz"], "unknown preset"),
    (None, ["init:cifar-tiny,depth"], "bad setting"),
    (None, ["init:cifar-tiny", "--samples", "1"], "--samples must be at least 2"),
    (None, ["init:cifar-tiny", "--batch_size", "0"], "--batch_size at least 1"),
    (None, ["init:wikitext-small,depth=1,vocab_size=300", "init:wikitext-small,depth=1,vocab_size="
            "99", "--tokenizer", "bytes", *TEXT],  # the second model checked too
     "the tokenizer has 256 ids but the model knows 99"),
    (None, ["init:cifar-tiny,objective=mae,image_size=8", "--mask", *IMAGES],
     "each sample reaches the blocks as one token"),
    (None, ["init:wikitext-small,depth=1", *TEXT],
     "a fresh model (init:) has no tokenizer of its own (random weights); pass --tokenizer"),
    (None, ["timm:vit_tinyy_patch16_224,pretrained=0"], "timm knows no model 'vit_tinyy_patch"),
    (None, [T5, *TEXT], "has no block list"),
    (None, [HF_TINY["gpt2"], *IMAGES], "a text model (next) cannot be run on --dataset folder"),
    (None, [TIMM_VIT, *IMAGES, "--mask"],
     "--mask probes MAE's visible patches; it needs an MAE model"),
    (hub_offline("AutoModel", network_up=True), ["hf:gpt2", *TEXT],
     ("hf:gpt2: could not load the weights (We couldn't connect", "pass pretrained=0")),
    (None, [HF_TINY["opt"], *TEXT, "--samples", "4"],  # random weights: no tokenizer
     "has no tokenizer of its own (random weights); pass --tokenizer"),
    (hub_offline("AutoTokenizer"), [HF_TINY["opt"], *TEXT, "--tokenizer", "hf:facebook/opt-125m"],
     "could not load the Hugging Face tokenizer 'facebook/opt-125m' (We couldn't"),
]


@pytest.mark.parametrize("setup, argv, says", PROBE_REFUSALS)
def test_probe_refuses_each_mistake_in_one_line(capsys, table_row, setup, argv, says):
    argv, says = table_row(setup, argv, says)
    code, out = probe_cli(capsys, *argv)
    assert code == 2 and out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    assert all(piece in out.err for piece in says), out.err


# ==================================================================================================
# 6. operations/fast.py: speedups keep results (compilation, CUDA graphs, AdamW, bf16)
# ==================================================================================================

def test_mlm_head_on_chosen_positions_equals_the_full_head_and_static_shapes_the_targets_path():
    """Training gathers the k chosen positions per window (graph-safe); given targets, boolean
    indexing: both give the full head's logits and loss at the chosen positions."""
    torch.manual_seed(0)
    model = Bamboo(tiny("mlm"))
    x, _ = batch(model.config)
    inputs, targets = model.mask_tokens(x)
    logits, loss = model(inputs, targets)
    h, _, _ = model.run_blocks(model.embed(inputs)[0])
    full = model.token_logits(model.mlm_transform(model.ln_f(h))) + model.mlm_bias  # every position
    reference = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert torch.allclose(loss, reference, atol=1e-6)
    assert torch.allclose(logits, full[targets != -100], atol=1e-6)
    torch.manual_seed(0)
    logits, loss = model(x)
    assert logits.shape == (len(x) * model.config.num_chosen(x.shape[1]), model.config.vocab_size)
    torch.manual_seed(0)  # the same draws: positions, then the 80/10/10 roll and the random ids
    inputs, targets = model.mask_tokens(x)
    reference_logits, reference = model(inputs, targets)
    assert torch.allclose(logits, reference_logits, atol=1e-6) and torch.allclose(loss, reference,
                                                                                  atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_the_full_logits_loss(dtype, monkeypatch):
    monkeypatch.setattr(bamboo, "LOGITS_PER_CHUNK", 64 * 5)  # 5 rows a chunk: 4 chunks + a part
    torch.manual_seed(0)
    h = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(64, 16, requires_grad=True)
    targets = torch.randint(0, 64, (23,))
    targets[[3, 11]] = -100
    full = F.cross_entropy(h @ weight.T, targets, ignore_index=-100)  # fp32 reference
    full_grads = torch.autograd.grad(3 * full, (h, weight))
    with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
        chunked = ChunkedCrossEntropy.apply(h.to(dtype), weight.to(dtype), targets)
    grads = torch.autograd.grad(3 * chunked, (h, weight))  # 3: the incoming gradient applied
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(chunked.float(), full, rtol=tolerance)
    for a, b in zip(grads, full_grads):
        assert a.dtype == b.dtype and ((a - b).norm() / b.norm()) < tolerance
    none = ChunkedCrossEntropy.apply(h, weight, torch.full((23,), -100))  # nothing to predict
    assert none.item() == 0 and torch.autograd.grad(none, h)[0].abs().max() == 0  # no NaN


def test_next_token_loss_is_the_cross_entropy_of_the_logits_with_or_without_gradients(monkeypatch):
    """The model's one next-token loss, chunked, equals F.cross_entropy of token_logits in value and
    gradients; without gradients (evaluation) it gives the same value from the logits alone."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(bamboo, "LOGITS_PER_CHUNK", 64 * 7)  # 7 rows a chunk: several chunks
    torch.manual_seed(0)
    model = Bamboo(tiny("next", depth=2))
    x, _ = batch(model.config)
    out, loss = model(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    h, targets = model.next_token_features(x)  # x fits seq_len: read whole, h one position longer
    assert torch.equal(out, model.token_logits(h[:, -1:])) and h.shape[1] == x.shape[1]
    h = h[:, :-1]  # the positions with a target
    reference = F.cross_entropy(model.token_logits(h).flatten(0, 1), targets.flatten())
    reference_grads = torch.autograd.grad(reference, list(model.parameters()))
    assert torch.allclose(loss, reference, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, reference_grads))
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        evaluated = model.next_token_loss(h, targets)
    assert torch.allclose(evaluated, reference, atol=1e-6)
    rows, width = h.flatten(0, 1).shape  # without gradients: the logits' matmul alone
    assert flops.get_total_flops() == 2 * rows * width * model.config.vocab_size


def test_the_readme_commands_run_in_order_each_into_its_own_out_dir():
    """The README's and the guide's commands, run in order, never collide: each new run has its own
    out_dir, and every path they use lies in an out_dir an earlier command made."""
    made, shapes = [], {}  # shapes: out_dir -> (depth, heads) of the model trained there
    commands = readme_commands("README.md", "docs/guide.md")
    assert len(commands) > 10
    for argv in commands:
        flags = dict(zip(argv, argv[1:]))
        if argv[0] == "mkdir":
            made += argv[2:]
            continue
        if "train.py" in argv and "--resume" not in argv:
            assert flags.get("--out_dir") not in made + [None], argv
            if "--init_from" in argv:
                assert os.path.dirname(flags["--init_from"]) in made, argv
            made.append(flags["--out_dir"])
            preset = {**Config().to_dict(), **PRESETS.get(flags.get("--preset"), {})}
            depth = int(flags.get("--depth", preset["depth"]))
            heads = int(flags.get("--heads", preset["heads"] or preset["width"] // 64))
            shapes[flags["--out_dir"]] = (depth, heads)
            continue
        if "attention" in argv:  # every --layers and --heads within the model it looks at
            depth, heads = shapes[os.path.dirname(argv[argv.index("attention") + 1])]
            for flag, count in (("--layers", depth), ("--heads", heads)):
                picked = [int(i) for i in flags.get(flag, "0").split(",")]
                assert all(-count <= i < count for i in picked), (argv, count)
        used = [a for a in argv if a.endswith("ckpt.pt")]
        used += [os.path.dirname(flags[f]) + "/x" for f in ("--out", "--json", "--plot")
                 if f in flags]
        used += [flags["--out_dir"] + "/x"] if "--resume" in argv else []
        listed = [a for a in ("curves", "smoothing") if a in argv]
        rest = argv[argv.index(listed[0]) + 1:] if listed else []
        used += [a + "/x" for i, a in enumerate(rest)
                 if not a.startswith("-") and not (i and rest[i - 1].startswith("-"))]
        assert all(os.path.dirname(path) in made for path in used), (argv, made)


def test_every_fast_name_the_code_and_readme_cite_exists():
    """A docstring or the README that names one of fast's functions names a real one."""
    texts = [open(os.path.join(REPO, path)).read() for path in (*REFERENCE_FILES, "README.md")]
    cited = {name for text in texts for name in re.findall(r"\bfast\.([A-Za-z_]\w*)", text)}
    assert cited and not {name for name in cited if name != "py" and not hasattr(fast, name)}


@pytest.mark.parametrize("objective", ["cls", "next"])
def test_activation_checkpointing_gives_the_same_gradients(objective, monkeypatch):
    """Each block runs again in backward (its forward counted), with the same dropout draws."""
    grads, runs, forward = {}, [], bamboo.Block.forward
    monkeypatch.setattr(bamboo.Block, "forward", lambda *args: runs.append(1) or forward(*args))
    for flag in (False, True):
        torch.manual_seed(0)
        model = Bamboo(tiny(objective, depth=3, neutreno=0.6, dropout=0.1, drop_path=0.1,
                            checkpointing=flag))
        x, y = batch(model.config)
        torch.manual_seed(1)
        model(x, y)[1].backward()
        grads[flag] = [p.grad.clone() for p in model.parameters()]
    assert len(runs) == 3 + 6  # without, then with: three blocks run once, then twice each
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True]))


NEXT_MODE, PAYS = fast.CPU_COMPILE[torch.bfloat16]["next"]


@pytest.mark.parametrize("asked,device,options,ddp,expected,why", [
    ("auto", "cpu", {"objective": "mae", "steps": 10 ** 6}, False, "off",
     "compiling mae on a CPU is not known to pay; --compile model forces it"),
    ("auto", "cpu", {"objective": "next", "steps": PAYS}, False, NEXT_MODE, f"from {PAYS} steps"),
    ("auto", "cpu", {"objective": "next", "steps": PAYS - 1}, False, "off",
     f"from {PAYS} steps, without DDP; --compile {NEXT_MODE} forces it"),
    ("auto", "cpu", {"objective": "next", "steps": PAYS}, True, "off", "without DDP"),
    ("auto", "cpu", {"objective": "next", "steps": 10 ** 6, "dtype": torch.float32}, False, "off",
     "not known to pay"),  # float32: 1.02x, paid back after about 1,000 steps
    ("auto", "meta", {}, False, "off", "auto compiles on CUDA and CPUs only"),
    ("auto", "cuda", {}, False, "graphs", ""),
    ("graphs", "cpu", {}, False, "blocks", "CUDA graphs need a CUDA device"),
    ("auto", "cuda", {}, True, "blocks", "not measured under DDP"),
    ("auto", "cuda", {"objective": "mlm"}, False, "graphs", ""),
    ("graphs", "cuda", {"checkpointing": True}, False, "blocks", "activation checkpointing"),
    ("model", "cpu", {}, False, "model", ""),
    ("off", "cuda", {}, False, "off", ""),
])
def test_compile_plan_picks_graphs_only_where_safe_and_says_why(asked, device, options, ddp,
                                                                expected, why):
    steps, dtype = options.pop("steps", 0), options.pop("dtype", torch.bfloat16)
    mode, reason = fast.compile_plan(asked, torch.device(device), tiny(options.pop(
        "objective", "cls"), **options), ddp, steps, dtype)
    assert mode == expected and why in reason and (reason == "") == (why == "")


def test_compilation_chosen_on_a_cpu_that_fails_leaves_the_run_eager_in_one_line(capsys,
                                                                               monkeypatch):
    """Without a C++ compiler the first step says so in one line and gives the eager loss."""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/g++",))
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    monkeypatch.setitem(fast.CPU_COMPILE[torch.float32], "cls", ("blocks", 1))
    model = Bamboo(tiny("cls"))
    eager = model(*batch(model.config))[1]
    module, mode, _ = fast.for_training(model, torch.device("cpu"), torch.float32, "auto", steps=1)
    try:
        torch._dynamo.reset()
        assert mode == "blocks" and torch.equal(module(*batch(model.config))[1], eager)
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("note: compilation failed (") and said[0].endswith(
        "the run goes on uncompiled, as --compile off")


@pytest.mark.parametrize("objective", ["cls", "mae", "next"])
def test_regional_compilation_compiles_one_block_whatever_the_depth(objective):
    """Each Block is compiled in place; identical Blocks reuse one graph, so the count of compiled
    graphs does not grow with depth (block 0, which has no V0 yet, is the one other graph)."""
    graphs = {}
    for depth in (3, 8):
        torch.manual_seed(0)
        model = Bamboo(tiny(objective, depth=depth, neutreno=0.6))
        x, y = batch(model.config)
        torch.manual_seed(1)
        eager_out, eager_loss = model(x, y)
        torch._dynamo.reset()
        counters.clear()
        fast.compile_blocks(model, backend="eager")  # the graph capture alone, no code generation
        module = fast.CompiledNextToken(model, backend="eager") if objective == "next" else model
        torch.manual_seed(1)
        out, loss = module(x, y)
        loss.backward()
        assert torch.allclose(loss, eager_loss, atol=1e-6)
        assert torch.allclose(out, eager_out, atol=1e-6)
        graphs[depth] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs[3] == graphs[8] <= 2 + (objective != "cls")  # decoder or next's loss: one more


def test_compiled_next_token_loss_is_the_models_loss_in_value_and_gradients():
    """Regional compilation of next-token's loss (through AOTAutograd, as inductor compiles it)
    keeps the model's loss and every gradient, with no graph break inside the chunked loss."""
    torch.manual_seed(0)
    model = Bamboo(tiny("next", vocab_size=100))
    x, _ = batch(model.config)
    _, plain_loss = model(x)
    plain_grads = torch.autograd.grad(plain_loss, list(model.parameters()))
    torch._dynamo.reset()
    counters.clear()
    fast.compile_blocks(model, backend="aot_eager")
    out, loss = fast.CompiledNextToken(model, backend="aot_eager")(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert torch.equal(out, model(x)[0]) and breaks == {}
    assert torch.allclose(loss, plain_loss, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, plain_grads))


def test_evaluation_runs_compiled_blocks_eagerly_whatever_its_batch_shapes(tiny_data):
    """evaluate() never compiles (or, under graphs, captures) graphs for its smaller last batch."""
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", image_size=16))
    data = ImageData("folder", str(tiny_data / "images"), torch.device("cpu"), image_size=16)
    torch._dynamo.reset()
    counters.clear()
    fast.compile_blocks(model, backend="eager")
    metrics = train.evaluate(model, data, 0, 12, torch.device("cpu"))  # 32 = 12 + 12 + 8
    assert counters["stats"]["unique_graphs"] == 0 and 0 <= metrics["top1"] <= 100
    torch._dynamo.reset()


def test_uncompiled_the_model_trains_itself_and_the_graph_wrapper_differentiates_the_loss_only():
    """Uncompiled, every objective trains the model itself; under CUDA graphs y=None reaches the
    model as None, and only the loss is differentiated (out is kept beside it, detached)."""
    for objective in ("mae", "cls", "mlm", "next"):
        model = Bamboo(tiny(objective))
        for device in ("cpu", "meta"):
            assert fast.for_training(model, torch.device(device), torch.float32)[0] is model
    model = Bamboo(tiny("mae"))
    x, _ = batch(model.config)
    wrapped = fast.LossOnly(model, (x, None))
    torch.manual_seed(0)
    loss = wrapped(x)
    torch.manual_seed(0)
    out, expected = model(x)
    assert torch.equal(loss, expected) and loss.requires_grad
    assert torch.equal(wrapped.out, out) and not wrapped.out.requires_grad


def test_bf16_autocast_tracks_fp32_training():
    """bf16 autocast (the CPU default where native) must not change where training goes: 5% after 60
    steps."""
    final = {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = Bamboo(tiny("cls", width=64))
        x, y = batch(model.config, B=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(60):
            with torch.autocast("cpu", dtype=dtype) if dtype else nullcontext():
                loss = model(x, y)[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
        final[dtype] = model(x, y)[1].item()  # measured in fp32
    assert final[torch.bfloat16] == pytest.approx(final[None], rel=0.05), final


# ==================================================================================================
# 7. operations/adapters.py and export.py: timm and Hugging Face models, both ways
# ==================================================================================================

@pytest.mark.parametrize("objective", ["cls", "next"])
def test_our_model_through_the_generic_path_gives_the_native_numbers(objective):
    torch.manual_seed(0)
    model = Bamboo(tiny(objective, depth=3, neutreno=0.6)).eval()
    x, _ = batch(model.config)
    native = probe.probe_model(model, x, 4)
    generic = probe.probe_model(adapters.Foreign(model, "bamboo, seen from outside"), x, 4)
    for name, values in native.items():
        assert generic[name] == pytest.approx(values, abs=1e-5, nan_ok=False), name


def test_tiny_timm_and_hugging_face_models_probe_end_to_end(capsys, tiny_data, tmp_path,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)  # a model with no run of its own caches tokens in ./data/cache
    code, out = probe_cli(capsys, TIMM_VIT, "init:cifar-tiny,image_size=16", "--labels", "vit,ours",
                          "--dataset", "folder", "--data_dir", tiny_data / "images", "--samples",
                          "4", "--json", tmp_path / "v.json")
    report = json.loads((tmp_path / "v.json").read_text())
    assert code == 0 and report["depth"] == {"vit": 3, "ours": 4}, out.err
    assert all(v is not None for v in report["metrics"]["vo_dominant"]["vit"][1:4])
    assert "do not pair up" in report["absent"]["ours"]["beta_v"]  # another shape: no beta
    code, out = probe_cli(capsys, *HF_TINY.values(), "--labels", "gpt2,bert,opt", "--dataset",
                          "text", "--data_dir", tiny_data / "text", "--val_file", "val.txt",
                          "--tokenizer", "bytes", "--samples", "4", "--json", tmp_path / "t.json")
    report = json.loads((tmp_path / "t.json").read_text())
    assert code == 0 and report["depth"] == {"gpt2": 2, "bert": 2, "opt": 2}, out.err
    assert "post-norm" in report["absent"]["bert"]["vo_dominant"]  # BERT: the sign means nothing
    assert report["metrics"]["vo_dominant"]["bert"] == [None] * 3
    assert report["absent"]["gpt2"] == {} and report["absent"]["opt"] == {}
    assert all(v is not None for v in report["metrics"]["attn_entropy"]["opt"][1:])


@pytest.mark.parametrize("objective", ["cls", "mae", "next"])
def test_an_exported_model_gives_our_outputs_in_timm_and_hugging_face(objective, tmp_path, capsys):
    """The export is a folder the library loads as its users do (timm's create_model keeps the head,
    statistics and classes; Hugging Face's from_pretrained) and computes our outputs with."""
    import timm.data
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = Bamboo(tiny(objective, vocab_size=256)).eval()  # next: the bytes tokenizer's ids
    for p in model.parameters():  # no zero-initialised head or bias hides a wrong mapping
        p.data.add_(torch.randn_like(p) * 0.02)
    ckpt = tmp_path / "ckpt.pt"
    statistics = (torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.full((1, 3, 1, 1), 0.2))
    checkpoint.save(str(ckpt), {"config": model.config.to_dict(), "model": model.state_dict(),
                                "window": None, "statistics": statistics, "classes": ["a", "b"],
                                "train": {"tokenizer": "bytes"}})
    out = tmp_path / ("gpt2" if objective == "next" else "vit")
    out.mkdir()  # a folder with files of its own, none a model's: written into
    (out / "model_card.md").write_text("notes")
    assert export.main([str(ckpt), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    x, _ = batch(model.config)
    with torch.no_grad():
        if objective == "next":  # as a user loads it: the model and its tokenizer
            theirs = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=x).logits
            ours = model.token_logits(model.next_token_features(x)[0])
            assert AutoTokenizer.from_pretrained(out)("héllo")["input_ids"] == list(b"h\xc3\xa9llo")
            bpe = tiktoken.Encoding("m", pat_str=r"\S+|\s+", special_tokens={}, mergeable_ranks={
                **{bytes([i]): i for i in range(256)}, b"ab": 256, b"abc": 257, b"ca": 258})
            assert export.exported_tokenizer(bpe)("cab abc")["input_ids"] == bpe.encode("cab abc")
            with pytest.raises(ValueError, match="special tokens' ids"):  # 259 is missing
                gap = {"mergeable_ranks": bpe._mergeable_ranks, "special_tokens": {"<|e|>": 260}}
                export.exported_tokenizer(tiktoken.Encoding("g", pat_str=r"\S+", **gap))
        else:
            users = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
            seen = {**timm.data.resolve_data_config(model=users), **users.pretrained_cfg}
            assert {k: seen[k] for k in ("input_size", "crop_pct", "label_names", "std")} == {
                "input_size": (3, 16, 16), "crop_pct": 1.0, "label_names": ["a", "b"],
                "std": pytest.approx([0.2] * 3)} and seen["mean"] == pytest.approx([0.5, 0.4, 0.3])
            vit = export.timm_model(model.config).eval()
            vit.load_state_dict(load_file(out / "model.safetensors"))  # strict: named, shaped alike
            with safe_open(out / "model.safetensors", "pt") as f:  # the weights' own header
                meta = {k: json.loads(v) for k, v in f.metadata().items()}
            assert meta == {"input_size": [3, 16, 16], "classes": ["a", "b"], "patch_size": 4,
                            "mean": pytest.approx([0.5, 0.4, 0.3]), "std": pytest.approx([0.2] * 3),
                            "num_classes": 10 * (objective == "cls")}
            theirs, close = (getattr(m, "forward" if objective == "cls" else "forward_features")(x)
                             for m in (vit, users))
            ours = model(x)[0] if objective == "cls" else model.forward_encoder(x, 0.0)[0]
            assert torch.allclose(close, ours, atol=1e-4)  # timm's eps, 1e-6, against our 1e-5
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()
    assert (out / "model_card.md").read_text() == "notes"


def own_file(name, text="the user's own"):
    """A set-up: out/name holding text (the out path itself where name is '')."""
    def setup(out):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return setup


def exported(out):
    assert export.main([str(out.parent / "c.pt"), "--out", str(out)]) == 0


EXPORT_REFUSALS = [  # (model, set-up of the --out path, --out, what the one line says)
    ({"neutreno": 0.6}, None, "x", "uses NeuTRENO"),
    ({"vo_param": "smooth"}, None, "x", "W_V W_O is smooth"),
    ({"pool": "cls"}, None, "x", "CLS-token pool"),
    ({"objective": "mlm"}, None, "x", "an mlm model has no export"),
    ({"objective": "next"}, own_file(""), "file", "the export is a folder Hugging Face loads"),
    ({}, None, "vit.safetensors", "the export is a folder timm loads; give --out a folder"),
    ({"objective": "next"}, exported, "hf", "already holds a model (config.json"),
    ({}, exported, "vit", "already holds a model (config.json, model.safetensors)"),
    ({}, None, "x" * 300, "(File name too long)"),
    ({}, own_file("log.jsonl"), "run", "already holds a model (log.jsonl)"),  # a run's folder
    # a sharded model: transformers' clean-up would delete it
    ({"objective": "next"}, own_file("model-00001-of-00002.safetensors", "a shard"), "shards",
     "already holds a model (model-00001-of-00002.safetensors)"),
]


@pytest.mark.parametrize("model, setup, out, says", EXPORT_REFUSALS)
def test_what_timm_and_hugging_face_do_not_have_is_refused_and_nothing_written_over(
        tmp_path, capsys, model, setup, out, says):
    model = Bamboo(tiny(model.get("objective", "cls"),
                        **{k: v for k, v in model.items() if k != "objective"}))
    checkpoint.save(str(tmp_path / "c.pt"), {"config": model.config.to_dict(),
                                             "model": model.state_dict(), "window": None})
    if setup:
        setup(tmp_path / out)
    before, _ = (tree(tmp_path), os.path.exists(tmp_path / out)), capsys.readouterr()
    assert export.main([str(tmp_path / "c.pt"), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    after = (tree(tmp_path), os.path.exists(tmp_path / out))
    assert says in err and err.count("\n") == 1 and after == before, err


def test_the_adapters_read_the_libraries_weights_and_attention_as_the_libraries_compute_them():
    """Each head's W_V W_O equals the product taken by hand from timm's fused qkv and GPT-2's
    Conv1D, and the attention recomputed is the libraries' own explicit attention."""
    for spec in (TIMM_VIT, HF_TINY["gpt2"]):
        model, _ = probe.load_model(spec, "")
        library, D, nh = model.model, model.blocks[0].attn.weights()["q"].shape[0], model.heads
        hs = D // nh
        for i, block in enumerate(model.blocks):
            ours = probe.head_value_output(block)
            if spec.startswith("timm"):
                module = library.blocks[i]
                w_v, w_o = module.attn.qkv.weight[2 * D:].T, module.attn.proj.weight.T  # x @ W
                gain = module.norm1.weight
            else:
                module = library.h[i]
                w_v, w_o, gain = module.attn.c_attn.weight[:, 2 * D:], module.attn.c_proj.weight, \
                    module.ln_1.weight
            for h in range(nh):
                by_hand = (gain[:, None] * w_v[:, h * hs:(h + 1) * hs]) @ w_o[h * hs:(h + 1) * hs]
                want = torch.linalg.eigvals(by_hand.double().detach())  # D x D: rank hs
                got = torch.linalg.eigvals(ours[h])
                largest = want[want.abs().argsort(descending=True)[:hs]]
                assert torch.allclose(got.abs().sort().values, largest.abs().sort().values,
                                      atol=1e-6)
                assert (got.real > 0).sum() == (largest.real > 0).sum()
    torch.manual_seed(0)
    for name in ("gpt2", "bert"):
        model, _ = probe.load_model(HF_TINY[name], "")
        tokens = torch.randint(0, 300, (2, 12))
        _, attns = model.hidden_states(tokens, need_weights=True)
        library = model.model(input_ids=tokens, output_attentions=True).attentions
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(attns, library)), name
    model, _ = probe.load_model(TIMM_VIT, "")
    seen = []
    for module in model.block_modules:
        module.attn.fused_attn = False  # timm's explicit path: its probabilities pass attn_drop
        module.attn.attn_drop.register_forward_hook(lambda m, args, out: seen.append(out))
    _, attns = model.hidden_states(torch.rand(2, 3, 16, 16), need_weights=True)
    assert len(seen) == 3 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(attns, seen))


def test_without_network_a_hub_model_fails_in_seconds_with_advice_that_works(
        capsys, tiny_data, monkeypatch):
    """No network: the hub's offline switch is set after one quick connection attempt, so a model
    or a tokenizer missing from the cache is one line within seconds (not ~30 s of retries)."""
    from huggingface_hub import constants

    def no_network(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr("socket.create_connection", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored afterwards, whatever the test sets
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tiny_data / "no-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    t0 = time.time()  # a tokenizer alone (--tokenizer hf:NAME) too
    with pytest.raises(files.DataError, match="could not load the Hugging Face tokenizer 'gpt2'"):
        get_tokenizer("hf:gpt2")
    assert time.time() - t0 < 10 and constants.HF_HUB_OFFLINE
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # and again for the models
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for spec in ("hf:gpt2", "timm:vit_tiny_patch16_224"):
        t0 = time.time()
        code, out = probe_cli(capsys, spec, "--dataset", "text", "--data_dir", tiny_data / "text")
        assert code == 2 and time.time() - t0 < 10 and "Traceback" not in out.err
        assert "huggingface.co cannot be reached" in out.err and "pass pretrained=0" in out.err
    assert constants.HF_HUB_OFFLINE  # the hub's own switch (monkeypatch restores it afterwards)


def test_hugging_faces_vit_mae_is_probed_unmasked_unless_told(capsys, tiny_data, tmp_path):
    """Every patch, in order, by default: the hooked states equal the library's own; --mask keeps
    a quarter of the patches, the same ones in every run, and changes the numbers."""
    model, _ = probe.load_model(HF_MAE, "")
    x = torch.rand(2, 3, 16, 16)
    ratio = model.model.config.mask_ratio
    hiddens, attns = model.hidden_states(x, need_weights=True)
    assert model.model.config.mask_ratio == ratio == 0.75  # the model's own setting, kept
    model.model.config.mask_ratio = 0.0
    library = model.model(pixel_values=x, noise=torch.arange(16.).expand(2, -1),
                          output_hidden_states=True, output_attentions=True)
    assert [h.shape[1] for h in hiddens] == [17] * 3  # the class token and 16 patches
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(hiddens, library.hidden_states))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(attns, library.attentions))
    reports = {}
    for flags in ((), ("--mask",), ("--mask",)):
        path = tmp_path / f"mae{len(reports)}.json"
        code, out = probe_cli(capsys, HF_MAE, "--dataset", "folder", "--data_dir",
                              tiny_data / "images", "--samples", "4", "--json", path, *flags)
        assert code == 0, out.err
        reports[len(reports)] = json.loads(path.read_text())
    unmasked, masked, again = (r["metrics"] for r in reports.values())
    assert reports[0]["attn_entropy_ceiling"][HF_MAE] == pytest.approx(math.log(17))
    assert reports[1]["attn_entropy_ceiling"][HF_MAE] == pytest.approx(math.log(5))  # 4 visible
    assert masked == again and masked["cos"] != unmasked["cos"]


def test_a_models_metrics_do_not_depend_on_the_models_probed_beside_it(capsys, tiny_data, tmp_path):
    """Each model sees the samples normalised by its own statistics (DeiT's are ImageNet's, this
    ViT's 0.5), whichever model was probed first on the same data."""
    deit = TIMM_VIT.replace("vit_tiny", "deit_tiny")
    reports = []
    for specs in ((TIMM_VIT, deit), (deit,)):
        path = tmp_path / f"{len(specs)}.json"
        code, out = probe_cli(capsys, *specs, "--dataset", "folder", "--data_dir",
                              tiny_data / "images", "--samples", "4", "--json", path)
        assert code == 0, out.err
        reports.append(json.loads(path.read_text())["metrics"])
    beside, alone = ({name: values[deit] for name, values in r.items()
                      if name not in ("beta_qk", "beta_v")} for r in reports)  # against the first
    assert beside == alone


SMALL_VIT = "pretrained=0,img_size=16,patch_size=4,depth=1,embed_dim=48,num_heads=3"
HUB_REFUSALS = [  # (spec, what the one line says)
    ("timm:vit_tiny_patch16_224,pretrained=0,foo=1", "unexpected keyword argument 'foo'"),
    ("timm:vit_tiny_patch16_224,pretrained=0,depth=abc", "refuses the settings"),
    ("hf:gpt2,pretrained=0,n_layer=abc", "'n_layer=abc': n_layer takes an integer"),
    ("hf:gpt2,pretrained=0,n_layer=yes", "'n_layer=yes': n_layer takes an integer"),
    ("hf:gpt2,pretrained=0,n_layers=6",
     ("gpt2 takes no setting 'n_layers'; it takes: ", "n_layer")),
    ("hf:gpt2,pretrained=0,n_layer=2,n_layer=3", "n_layer is given twice"),
    ("hf:gpt2,pretrained=0,scale_attn_weights=2",
     "scale_attn_weights=2': scale_attn_weights takes true or"),
    # timm's own error for a checkpoint_path it cannot use (a pickle that torch.load refuses)
    ("timm:vit_tiny_patch16_224,pretrained=0,img_size=16,patch_size=4,depth=1,embed_dim=32,"
     "num_heads=2,checkpoint_path={other}", "could not load its checkpoint_path"),
    # attention that is more than the probe's softmax(q k^T / sqrt(head size)): never misprobed
    (f"timm:vit_tiny_patch16_224,{SMALL_VIT},qk_norm=True",
     "normalises inside attention (q_norm, k_norm)"),
    (f"timm:beit_base_patch16_224,{SMALL_VIT}", "is more than softmax(q k^T)"),  # relative
    (f"timm:eva02_tiny_patch14_224,{SMALL_VIT}", "is more than softmax(q k^T)"),  # rotary
    (HF_TINY["gpt2"] + ",scale_attn_by_inverse_layer_idx=true",
     "scales its attention otherwise than by 1/sqrt(head size)"),
]


@pytest.mark.parametrize("spec, says", HUB_REFUSALS)
def test_a_foreign_spec_that_cannot_be_probed_as_given_is_one_line(tmp_path, spec, says):
    torch.save({"state_dict": {"x": argparse.Namespace(a=1)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError) as e:
        hub.load(spec.replace("{other}", str(tmp_path / "other.pt")))
    assert all(piece in str(e.value) for piece in ((says,) if isinstance(says, str) else says))
    assert "\n" not in str(e.value)


def test_causal_attention_entropy_is_reported_against_its_own_ceiling(capsys, tiny_data, tmp_path):
    T = 12
    causal = torch.tril(torch.ones(T, T))
    uniform = (causal / causal.sum(-1, keepdim=True))[None, None]  # (1, 1, T, T)
    assert probe.attention_entropy(uniform).item() == pytest.approx(probe.entropy_ceiling(T, True))
    assert probe.entropy_ceiling(T, True) < math.log(T) - 0.5  # not log T, which it never reaches
    full = torch.full((1, 1, T, T), 1 / T)
    assert probe.attention_entropy(full).item() == pytest.approx(probe.entropy_ceiling(T, False))
    code, out = probe_cli(capsys, HF_TINY["gpt2"], HF_TINY["bert"], "--labels", "gpt2,bert",
                          "--dataset", "text", "--data_dir", tiny_data / "text", "--tokenizer",
                          "bytes", "--samples", "4", "--json", tmp_path / "t.json")
    report = json.loads((tmp_path / "t.json").read_text())
    ceiling = report["attn_entropy_ceiling"]
    assert code == 0 and ceiling["bert"] == pytest.approx(math.log(64)), out.err  # seq_len 64
    assert ceiling["gpt2"] == pytest.approx(sum(math.log(i + 1) for i in range(64)) / 64)
    assert all(e <= ceiling["gpt2"] + 1e-6 for e in report["metrics"]["attn_entropy"]["gpt2"][1:])
    assert "its ceiling here: " + f"{ceiling['gpt2']:.4f}" in out.out


def test_a_pretrained_hugging_face_model_reads_its_own_statistics_and_tokenizer(monkeypatch):
    """Offline stand-ins for the hub: the image model is normalised with its processor's mean and
    std, and a pretrained text model other than GPT-2 reads the hub's tokenizer by default."""
    def random_weights(spec):  # the suite's tiny model of that spec, as if downloaded
        name, settings = cli.split_spec(spec.removeprefix("hf:"))
        settings.pop("pretrained")
        return hub.hf_model(name, False, settings)

    tiny = {"facebook/vit-mae-base": random_weights(HF_MAE),
            "facebook/opt-125m": random_weights(HF_TINY["opt"])}
    processor = types.SimpleNamespace(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224,
                                                                                  0.225])
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda name, **kw: tiny[name])
    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", lambda name: processor)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: False)  # as if online
    mae = hub.load("hf:facebook/vit-mae-base")
    pixels = torch.full((1, 3, 16, 16), 0.485)
    assert mae.normalize(pixels)[0, 0].abs().max() < 1e-6 and mae.config.mask_ratio == 0.75
    assert mae.normalize(pixels)[0, 1, 0, 0] == pytest.approx((0.485 - 0.456) / 0.224)
    assert hub.load("hf:facebook/opt-125m").tokenizer == "hf:facebook/opt-125m"


def test_tokenizers_are_read_where_they_can_be_loaded_and_offline_the_fix_that_works_is_named(
        capsys, tiny_data, tmp_path, monkeypatch):
    """Offline, tiktoken's gpt2 needs two files; r50k_base (GPT-2's ranks) needs one, which a
    TIKTOKEN_CACHE_DIR can hold: the message names it for gpt2, and only for gpt2."""
    folder = byte_level_tokenizer(tmp_path / "tok")
    tok = get_tokenizer(f"hf:{folder}")
    assert tok.n_vocab == 256 and tok.decode(tok.encode_ordinary("héllo, wörld")) == "héllo, wörld"
    common = ("--dataset", "text", "--data_dir", tiny_data / "text", "--samples", "4")
    code, out = probe_cli(capsys, HF_TINY["opt"], *common, "--tokenizer", f"hf:{folder}")
    assert code == 0, out.err
    gpt2, opt = (transformers.AutoConfig.for_model(t) for t in ("gpt2", "opt"))
    assert hub.hf_tokenizer(gpt2, "gpt2", True) == "r50k_base"  # GPT-2's BPE, one file
    assert hub.hf_tokenizer(opt, "facebook/opt-125m", True) == "hf:facebook/opt-125m"
    assert hub.hf_tokenizer(opt, "opt", False) is None

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(files.DataError, match=r"or --tokenizer r50k_base: GPT-2's ranks in one"):
        get_tokenizer("gpt2")
    with pytest.raises(files.DataError) as e:
        get_tokenizer("cl100k_base")
    assert "TIKTOKEN_CACHE_DIR" in str(e.value) and "r50k_base" not in str(e.value)
    assert "bytes" not in str(e.value)  # another vocabulary: no fix for a trained model


# ==================================================================================================
# 8. look.py: looking at what a model does
# ==================================================================================================

def test_look_draws_a_log_kept_as_a_file_or_cut_short_says_when_a_run_diverged_and_labels_few(
        capsys, tiny_data, tmp_path, monkeypatch):
    """results/ keeps runs' logs as NAME.jsonl: look.py's smoothing and curves draw them as they
    draw an out_dir, named NAME."""
    train_run(tiny_data, "cls", tmp_path / "run", 2, "--eval_interval", "1", "--probe_samples", "4")
    shutil.copy(tmp_path / "run" / "log.jsonl", tmp_path / "kept.jsonl")
    capsys.readouterr()
    code, out = look_cli(capsys, "smoothing", tmp_path / "kept.jsonl", "--out", tmp_path / "k.png")
    assert code == 0 and "kept: abs_cos_centered of the last layer at steps [1, 2]: " in out.out
    assert not look.main(["curves", str(tmp_path / "kept.jsonl"), "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "k.png").stat().st_size > 10_000 and (tmp_path / "c.png").exists()
    drawn, save_figure = [], look.save_figure
    monkeypatch.setattr(look, "save_figure", lambda fig, path: drawn.append(fig) or
                        save_figure(fig, path))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "log.jsonl").write_text('{"step": 500, "loss": 2.0}\n{"step": 501, "lo')
    assert look.main(["curves", str(tmp_path / "e"), "--out", str(tmp_path / "v.png")]) == 0
    assert drawn[-1].axes[0].get_xlim()[0] == 0  # one point: steps from 0, not a sliver around it
    (tmp_path / "e" / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "eval": true, '
                                              '"val_loss": Infinity}\n\n')  # a blank line too
    assert look.main(["curves", str(tmp_path / "e"), "--out", str(tmp_path / "v.png")]) == 0
    assert "e: every val_loss is non-finite (diverged); nothing to draw" in capsys.readouterr().err
    records = [{"eval": True, "step": 250 * i, "layers": {"abs_cos_centered": [0.5, 0.6, 0.7]}}
               for i in range(1, 17)]  # 16 evaluations: about eight labelled, never overlapping
    (tmp_path / "e" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert look.main(["smoothing", str(tmp_path / "e"), "--out", str(tmp_path / "s.png")]) == 0
    labels = [t.get_text() for t in drawn[-1].axes[0].get_xticklabels()]
    assert labels == ["250", "750", "1250", "1750", "2250", "2750", "3250", "3750"]


def test_generate_and_look_sample_continue_with_the_likeliest_token_under_top_k_one(
        capsys, trained, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Bamboo(tiny("next")).eval()
    prompt = torch.randint(0, 64, (2, 5))
    out = model.generate(prompt, 20, temperature=0.7, top_k=1)  # longer than seq_len 16: cropped
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)
    for t in range(5, 25):  # a context of at most seq_len tokens; out: what follows it
        assert torch.equal(out[:, t], model(out[:, max(0, t - 16):t])[0][:, -1].argmax(-1))
    draws = [model.generate(prompt, 8, generator=torch.Generator().manual_seed(seed))
             for seed in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    with pytest.raises(ValueError, match="needs a next-token model"):
        Bamboo(tiny("mlm")).generate(prompt, 1)
    ckpt = trained("next", tmp_path / "next")
    generated, generate = [], Bamboo.generate  # never silent: each token printed as it comes
    monkeypatch.setattr(Bamboo, "generate", lambda *a: generated.append(
        len(capsys.readouterr().out)) or generate(*a))
    monkeypatch.setattr(look, "get_tokenizer", lambda name: types.SimpleNamespace(
        n_vocab=256, encode_ordinary=lambda text: list(text.encode()),
        decode=lambda ids: "x" * len(ids)))  # one character a token
    assert look_cli(capsys, "sample", ckpt, "--prompt", "ab", "--max_new_tokens", "3",
                    "--num_samples", "2")[0] == 0
    assert generated == [2, 1, 1, 1 + 17 + 2, 1, 1]  # ab, x, x, x + the rule, ab, x, x
    monkeypatch.undo()
    code, out = look_cli(capsys, "sample", ckpt, "--prompt", "the quick", "--num_samples", "2",
                         "--max_new_tokens", "12", "--seed", "3")
    texts = out.out.split("---------------\n")
    assert code == 0 and len(texts) == 3 and all(t.startswith("the quick") for t in texts[:2])
    assert look_cli(capsys, "sample", ckpt, "--prompt", "the quick", "--num_samples", "2",
                    "--max_new_tokens", "12", "--seed", "3")[1].out == out.out  # seeded
    code, out = look_cli(capsys, "sample", ckpt, "--prompt", "the quick", "--num_samples", "3",
                         "--max_new_tokens", "12", "--top_k", "1")  # the likeliest id each time
    texts = out.out.split("---------------\n")[:3]
    assert code == 0 and texts[0] == texts[1] == texts[2] and len(texts[0]) > len("the quick")


def test_the_probe_figure_draws_no_noise_as_signal_and_no_panel_without_information():
    """No beta panels without a pair; a metric that moves by 1e-4 near 1 is drawn flat (a y-range
    of at least 5% of its size); y-labels wrap, never overlapping the next panel."""
    wobble = [0.9999, 1.0, 0.99995]
    report = {"labels": ["a"], "depth": {"a": 2}, "samples": 4, "attn_entropy_ceiling": {"a": 1.0},
              "metrics": {name: {"a": wobble} for name in probe.AXES}}
    figure = probe.probe_figure(report, relative=False)
    panels = {ax.get_title(): ax for ax in figure.axes if ax.get_title()}
    assert set(panels) == set(probe.AXES) - {"beta_qk", "beta_v"}
    low, high = panels["cos"].get_ylim()
    assert high - low >= 0.05 * 0.9999
    assert all(len(line) <= 32 for ax in panels.values() for line in ax.get_ylabel().split("\n"))
    report["labels"], report["depth"]["b"] = ["a", "b"], 2
    report["metrics"] = {name: {"a": wobble, "b": [0.2, 0.5, 0.9]} for name in probe.AXES}
    report["attn_entropy_ceiling"]["b"] = 1.0
    panels = {ax.get_title(): ax for ax in probe.probe_figure(report, False).axes}
    assert "beta_v" in panels and panels["cos"].get_ylim()[0] < 0.25  # a real range is kept
    for name in ("beta_qk", "beta_v"):  # b of another shape: no beta, so no flat line at 1 alone
        report["metrics"][name]["b"] = [None, None, None]
    panels = {ax.get_title() for ax in probe.probe_figure(report, False).axes}
    assert "cos" in panels and not panels & {"beta_qk", "beta_v"}


def log_with(text):
    """A set-up: {tmp}/e/log.jsonl holding text."""
    return lambda c: (c.tmp / "e").mkdir() or (c.tmp / "e" / "log.jsonl").write_bytes(text)


SAMPLE, DRAW = ["sample", "{run}/ckpt.pt"], ["{tmp}/e", "--out", "{tmp}/v.png"]
LOOK_REFUSALS = [  # (set-up, argv, what the one line says), as table_row reads them
    ("next", [*SAMPLE, "--temperature", "0"], "--temperature must be"),
    ("cls", SAMPLE, "holds a cls model"),
    ("cls", ["attention", "{run}/ckpt.pt", "--layers", "5", "--out", "{tmp}/a.png"],
     "--layers 5: the model has 2 layers; give whole numbers from -2 to 1"),
    ("cls", ["attention", "{run}/ckpt.pt", "--index", "100000", "--out", "{tmp}/a.png"],
     "--index 100000 is past the 32 held-out samples; choose 0 to 31"),
    (None, ["curves", "{tmp}", "--out", "{tmp}/c.png"], "no log at"),
    (log_with(b'{"step": 1, "loss": 2.0}\n'), ["smoothing", *DRAW], "has no evaluation yet"),
    (log_with(b"\x80\x81 not text"), ["curves", *DRAW],
     "is not a log train.py wrote (not UTF-8 text)"),
    *[(log_with(b'{"step": 2, "eval": true, ' + bad + b'}\n'), [command, *DRAW],
       "line 1 is not a record train.py writes")  # records train.py never writes
      for bad in (b'"layers": [1, 2]', b'"layers": 5', b'"val_loss": null', b'"val_loss": "NaN"')
      for command in ("smoothing", "curves")],
]


@pytest.mark.parametrize("setup, argv, says", LOOK_REFUSALS)
def test_look_refuses_each_mistake_in_one_line_and_draws_nothing(capsys, tmp_path, table_row,
                                                                 setup, argv, says):
    argv, says = table_row(setup, argv, says)
    before = tree(tmp_path)
    code, out = look_cli(capsys, *argv)
    assert code == 2 and out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    assert all(piece in out.err for piece in says) and tree(tmp_path) == before, out.err


def test_look_reconstructs_held_out_images_as_the_mae_paper_shows_them(capsys, tiny_data, tmp_path):
    ckpt = train_run(tiny_data, "mae", tmp_path / "mae", 2, "--norm_pix_loss")
    code, out = look_cli(capsys, "reconstruct", ckpt, "--samples", "3", "--out", tmp_path / "r.png")
    width, height = png_size(tmp_path / "r.png")  # 4 columns, 3 rows
    assert code == 0 and width > height > 400, out.err
    for seed, name in (("0", "same.png"), ("1", "other.png")):  # --seed picks the hidden patches
        assert look_cli(capsys, "reconstruct", ckpt, "--samples", "3", "--seed", seed, "--out",
                        tmp_path / name)[0] == 0
    pixels = [(tmp_path / name).read_bytes() for name in ("r.png", "same.png", "other.png")]
    assert pixels[0] == pixels[1] != pixels[2]
    model, _, step = look.load(ckpt, "mae")
    assert step == 2
    images = batch(model.config, B=3)[0]
    original, masked, recon, pasted, hidden = look.mae_columns(model, images)
    assert hidden.float().mean() == 0.75 and torch.equal(original, images)
    hidden = hidden.expand_as(images)
    assert torch.equal(masked[hidden], torch.zeros_like(masked[hidden]))
    assert torch.equal(masked[~hidden], images[~hidden])
    assert torch.equal(pasted[~hidden], images[~hidden])
    assert torch.equal(pasted[hidden], recon[hidden]) and not torch.allclose(recon, images)


def test_look_draws_attention_maps_and_training_curves(capsys, trained, tmp_path):
    runs = [trained(kind, tmp_path / kind).parent for kind in ("cls", "next")]
    for run in runs:
        code, out = look_cli(capsys, "attention", run / "ckpt.pt", "--layers", "0,-1", "--heads",
                             "0,1", "--out", tmp_path / f"{run.name}.png")
        assert code == 0 and png_size(tmp_path / f"{run.name}.png")[0] > 400, out.err
    probs = torch.softmax(torch.randn(17, 17), -1)  # a CLS token and a 4 x 4 patch grid
    figure = look.attention_over_image(torch.rand(16, 16, 3), {(0, 0): probs, (1, 1): probs}, 4)
    assert [ax.get_title() for ax in figure.axes if ax.get_title()] == [
        "the image", "block 0, head 0: attention received", "block 1, head 1: attention received"]
    maps = [ax for ax in figure.axes if ax.get_title().startswith("block")]
    assert all(len(ax.get_images()) == 2 for ax in maps)  # the map over the image
    assert len(figure.axes) == 3 + 2  # a colour bar beside each map
    overlay = figure.axes[1].get_images()[1].get_array()
    assert torch.allclose(torch.as_tensor(overlay), probs.mean(0)[1:].reshape(4, 4))  # no CLS
    figure = look.attention_over_tokens(["a", " cat", "\n"] * 20, {(0, 0): torch.rand(60, 60)})
    ticks = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    assert ticks[:3] == ["a", " cat", "\\n"] and len(ticks) == 24  # one label per shown token
    code, out = look_cli(capsys, "curves", *runs, "--out", tmp_path / "c.png")
    assert code == 0 and png_size(tmp_path / "c.png")[0] > 800, out.err
    figure = look.curves_figure({d: look.read_log(d) for d in runs})
    panels = {ax.get_title(): len(ax.get_lines()) for ax in figure.axes}
    assert panels == {"training loss (cross-entropy)": 2, "held-out loss (cross-entropy)": 2,
                      "held-out top-1 (%)": 1, "held-out perplexity": 1}  # one metric an axis
    mae = trained("mae", tmp_path / "mae").parent
    figure = look.curves_figure({d: look.read_log(d) for d in (mae, runs[0])})
    panels = {ax.get_title(): len(ax.get_lines()) for ax in figure.axes}
    assert panels == {"training loss (MAE, pixel MSE)": 1, "training loss (cross-entropy)": 1,
                      "held-out loss (MAE, pixel MSE)": 1, "held-out loss (cross-entropy)": 1,
                      "held-out top-1 (%)": 1}  # pixel MSE never beside cross-entropy
    assert all(ax.get_ylabel() == ax.get_title() for ax in figure.axes)


# ==================================================================================================
# 9. bench.py: step time, MFU and memory
# ==================================================================================================

QUICK_BENCH = ["--batch_size", "2", "--steps", "1", "--rounds", "1", "--warmup", "1", "--dtype",
               "float32"]  # bench.py's flags for a quick run (flags after them override)


def test_bench_compares_configs_dtypes_and_attention_kernels_and_profiles_a_step(capsys, tmp_path):
    """One run compares configs and dtypes, or attention kernels (its rows written as JSON too);
    --profile shows one step's profile."""
    rows = bench.run(bench.build_parser().parse_args([
        "cls:cifar-tiny,image_size=16", "next:cifar-tiny,seq_len=16,vocab_size=64", *QUICK_BENCH,
        "--rounds", "2", "--dtype", "float32,bfloat16", "--compile", "off"]))
    out = capsys.readouterr().out
    assert [(r["spec"].split(":")[0], r["dtype"]) for r in rows] == [
        ("cls", "float32"), ("cls", "bfloat16"), ("next", "float32"), ("next", "bfloat16")]
    for r in rows:
        assert r["step_ms"] > 0 and r["samples_s"] > 0 and r["tflops"] > 0
        assert r["mfu"] is None and r["peak_mib"] is None  # no peak on a CPU, no memory counter
        assert r["first_step_s"] > 0  # the first warm-up step, where compilation would show
    assert r["tokens_s"] == pytest.approx(16 * r["samples_s"])
    assert "MFU %" in out and "peak: cpu (peak unknown: no MFU)" in out and "round 1 of 2 " in out
    assert "first step of cls:cifar-tiny,image_size=16 (bamboo, float32, off): " in out  # at once
    rows = bench.run(bench.build_parser().parse_args([
        "cls:cifar-tiny,image_size=16", *QUICK_BENCH, "--attention", "sdpa,explicit", "--json",
        str(tmp_path / "b.json")]))
    assert [r["attention"] for r in rows] == ["sdpa", "explicit"]
    assert " explicit " in capsys.readouterr().out
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["rows"] == rows and written["batch_size"] == 2 and written["device"]
    bench.run(bench.build_parser().parse_args(["cls:cifar-tiny,image_size=16", *QUICK_BENCH,
                                               "--profile", "5"]))
    out = capsys.readouterr().out
    assert "profile of one step: cls:cifar-tiny" in out and "Self CPU" in out


def test_bench_against_puts_each_librarys_model_of_the_same_shape_beside_ours(capsys, monkeypatch):
    """--against: timm's ViT, Hugging Face's GPT-2 and BERT of our shape beside ours, a library
    compiled whole and, on a CPU under auto, eager too: each at its fastest (a stand-in compile)."""
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    rows = bench.run(bench.build_parser().parse_args([
        "cls:cifar-tiny,image_size=16", "next:cifar-tiny,seq_len=16,vocab_size=64,mlp_ratio=2",
        "mlm:cifar-tiny,seq_len=16,vocab_size=64", "--against", *QUICK_BENCH, "--compile",
        "blocks,auto"]))
    assert [(r["impl"], r["compiled"]) for r in rows] == [pair for library in (
        "timm VisionTransformer", "HF GPT2LMHeadModel", "HF BertForMaskedLM") for pair in (
        ("bamboo", "blocks"), ("bamboo", "off"), (library, "model"), (library, "off"))]
    for ours, library in zip(rows[::4], rows[2::4]):
        assert library["attention"] == "library" and library["step_ms"] > 0
        assert library["params_m"] == pytest.approx(ours["params_m"], rel=0.1)  # the same shape
    assert "as fast as HF BertForMaskedLM at its fastest (" in capsys.readouterr().out


def test_bench_times_steps_the_device_has_run_and_only_after_seconds_of_untimed_ones(monkeypatch):
    """The first step's time waits for the device, as the rounds do (a 50 ms wait stands in for
    CUDA's queue); the rounds start after WARM_S of untimed steps."""
    monkeypatch.setattr(bench, "device_sync", lambda device: lambda: time.sleep(0.05))
    args = bench.build_parser().parse_args(["cls:cifar-tiny,image_size=16", *QUICK_BENCH])
    row, = bench.run(args)
    assert row["first_step_s"] >= 0.05 and row["step_ms"] >= 50
    monkeypatch.setattr(bench, "WARM_S", 0.5)
    steps, step = [], bench.Runner.step
    monkeypatch.setattr(bench.Runner, "step", lambda self: steps.append(time.perf_counter())
                        or step(self))
    bench.build_runners(args, torch.device("cpu"))
    assert steps[-1] - steps[0] >= 0.45 and len(steps) > 2


@pytest.mark.parametrize("argv, says", [
    (["cifar-tiny"], "OBJECTIVE:PRESET"),
    (["cls:cifar-tiny,checkpointing=ture"], "checkpointing takes true or false"),
    (["cls:cifar-tiny,depth=2,depth=1"], "depth is given twice"),
    (["cls:cifar-tiny", "--threads", "-1"], "--threads -1 must be at least 1"),
    (["cls:cifar-tiny", "--dtype", "float8"], "unknown --dtype 'float8'"),
    (["cls:cifar-tiny", "--warmup", "0"], "--warmup must be at least 1"),
    (["cls:cifar-tiny,objective=mae"], "says objective mae after its prefix cls"),
    (["cls:cifar-tiny", "--attention", "fused"], "unknown --attention 'fused'"),
    (["cls:cifar-tiny", "--json", "no/such/folder/b.json"], "the folder no/such/folder does not"),
])
def test_bench_rejects_bad_arguments_in_one_line_before_any_step(capsys, argv, says):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


# ==================================================================================================
# 10. The code itself: what runs is what the reader reads, in the shape the user asked for
# ==================================================================================================

@pytest.mark.parametrize("compile_mode", ["off", "model", "blocks", "graphs", "auto"])
@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_no_speedup_assigns_anything_on_a_live_model(compile_mode, objective):
    """fast.for_training never assigns a method or attribute on the model or its modules (torch's
    compile slot aside): the methods a reader studies are the ones that train."""
    model = Bamboo(tiny(objective, neutreno=0.4))
    before = instance_attributes(model)
    for device in ("cpu", "meta"):  # the CPU's wrappers, and those of any other device
        fast.for_training(model, torch.device(device), torch.bfloat16, compile_mode)
        after = instance_attributes(model)
        for name, attributes in after.items():
            changed = {key for key in attributes.keys() | before[name].keys()
                       if attributes.get(key) is not before[name].get(key)}
            changed -= {"_compiled_call_impl", "_is_torch_compile"}  # torch.compile's own
            assert not changed, (name, changed)
        for module_name, submodule in model.named_modules():
            shadowed = [key for key in vars(submodule)
                        if callable(getattr(type(submodule), key, None))]
            assert not shadowed, (module_name, shadowed)


def test_measurement_tools_do_not_import_the_trainer():
    """probe.py and bench.py load checkpoints, pick devices, build optimizers without train.py."""
    code = "import sys, probe, bench; print('train' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_imports_point_one_way_down_the_stated_order():
    """Every module imports only modules before it in LAYERS (inside functions too); the tutorial's
    files import only named packages besides, and operations/ as modules: out_dir.out_dir_claimed"""
    modules = {p[:-3].replace("/", ".") for p in os.listdir(REPO) + [
        f"operations/{f}" for f in os.listdir(f"{REPO}/operations")]
        if p.endswith(".py") and not p.startswith(("test_", "operations/__init__"))}
    assert modules == set(LAYERS)
    allowed = {m.split(".")[0] for m in LAYERS} | PACKAGES | sys.stdlib_module_names
    up, outside = [], []
    for rank, module in enumerate(LAYERS):
        path = module.replace(".", "/") + ".py"
        for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "operations":
                names = [f"operations.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            up += [f"{module} imports {n}" for n in names if n in LAYERS[rank:]
                   or n.startswith("operations.") and n not in LAYERS]
            if path in TUTORIAL and (isinstance(node, ast.Import) or node.module != "operations"):
                outside += [f"{module} imports {n}" for n in names
                            if n.split(".")[0] not in allowed or n.startswith("operations.")]
    assert up == [] and outside == [], (up, outside)


def test_reference_code_passes_ruff_at_100_columns():
    """The reference's lines are at most 100 characters; no file has unused imports or names, or
    undefined names (ruff, run by the suite wherever it runs)."""
    for select, paths in (("E501,F", REFERENCE_FILES), ("F", ("results",))):
        ruff = [sys.executable, "-m", "ruff", "check", "--no-cache", "--line-length", "100"]
        done = subprocess.run([*ruff, "--select", select, *paths], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_readme_links_each_name_to_its_lines(tmp_path):
    """Every `file.py:name` in the README is a link to exactly that name's lines (a file's
    docstring and parts of train() too): a reader on GitHub lands on what is meant, and no more."""
    readme = open(os.path.join(REPO, "README.md")).read()
    assert re.findall(POINTER, re.sub(README_LINK, "", readme)) == []  # each one a link
    assert re.findall(r"\]\(\w+\.py#L\d+\)", readme) == []  # a range, which relinking follows
    links = list(readme_links(readme))
    wrong = [f"{link[1]}: L{link[3]}-L{link[4]}, {now} now" for link, now in links
             if now != (int(link[3]), int(link[4]))]
    stale = tmp_path / "README.md"  # what an edit that moved code leaves, mended by one call
    stale.write_text(re.sub(README_LINK, lambda m: m[0].replace(f"#L{m[3]}-", f"#L{m[3]}9-"),
                            readme))
    relink_readme(stale)
    assert stale.read_text() == readme or wrong
    assert len(links) > 40 and wrong == [], ("README.md's links are stale (python -c \"import "
                                             "test_all; test_all.relink_readme()\"): "
                                             + "; ".join(wrong))


def test_functions_fit_on_a_screen_and_the_training_loop_holds_the_step():
    """No function over 60 lines but train.train (a run's state as its locals, as nanoGPT's
    script); its loop shows each of the step's verbs itself, in order."""
    lengths = {}
    for path in REFERENCE_FILES:
        for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{path}:{node.name}"] = node.end_lineno - node.lineno + 1
    long = {name: n for name, n in lengths.items() if n > 60 and name != "train.py:train"}
    assert not long and lengths["train.py:train"] <= 200, (long, lengths["train.py:train"])
    source = inspect.getsource(train.train)
    loop = source[source.index("while step < cfg.max_iters"):]
    verbs = ["get_lr(", ".backward()", "clip_grad_norm_(", "scaler.step(", "zero_grad(",
             "read_loss(", "evaluate(", "checkpoint.save("]
    where = [loop.find(verb) for verb in verbs]
    assert all(i >= 0 for i in where) and where == sorted(where), dict(zip(verbs, where))


# ==================================================================================================
# 11. CUDA: compilation modes, the step as one CUDA graph with per-step randomness
# ==================================================================================================

# Collected everywhere, skipped without a GPU (shown as skipped); results/gpu.sh runs them on one.
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


def cuda_batch(config):
    return tuple(t.to(CUDA) if t is not None else None for t in batch(config))


@CUDA_ONLY
@pytest.mark.parametrize("mode,objective", [("model", "cls"), ("blocks", "cls"), ("graphs", "cls"),
                                            ("blocks", "next"), ("graphs", "next")])
def test_every_compile_mode_on_cuda_gives_the_eager_loss_and_gradients(mode, objective):
    torch.manual_seed(0)
    model = Bamboo(tiny(objective, depth=4, width=64, vocab_size=100)).to(CUDA)
    x, y = cuda_batch(model.config)
    eager_out, eager = model(x, y)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    # frees the eager autograd graph: a capture must not meet it
    eager_out = eager_out.detach()
    eager = eager.detach()
    module, chosen, _ = fast.for_training(model, CUDA, torch.float32, mode)
    assert chosen == mode
    for _ in range(3):  # the first call warms up and captures; then replays
        out, loss = module(x, y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.allclose(loss, eager, rtol=1e-3)
    assert out.shape == eager_out.shape and torch.allclose(out, eager_out, rtol=1e-3, atol=1e-4)
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-5) for a, b in zip(grads, eager_grads))


@CUDA_ONLY
def test_explicit_attention_under_cuda_graphs_gives_the_fused_kernels_loss():
    """bench.py --attention explicit on the GPU: matmul-softmax-matmul captured in the graph,
    the same loss."""
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=4, width=64)).to(CUDA)
    x, y = cuda_batch(model.config)
    fused = model(x, y)[1].item()
    explicit = Bamboo(model.config, explicit_attention=True).to(CUDA)
    explicit.load_state_dict(model.state_dict())
    module, chosen, _ = fast.for_training(explicit, CUDA, torch.float32, "graphs")
    losses = [module(x, y)[1].item() for _ in range(3)]  # warm-up and capture, then replays
    assert chosen == "graphs" and all(m.explicit for m in explicit.modules()
                                      if isinstance(m, Attention))
    assert losses == pytest.approx([fused] * 3, rel=1e-4)


@CUDA_ONLY
@pytest.mark.parametrize("objective", ["mae", "mlm"])
def test_masks_differ_per_step_under_cuda_graphs_and_other_shapes_are_refused(objective):
    torch.manual_seed(0)
    model = Bamboo(tiny(objective, depth=4, width=64, decoder_width=64)).to(CUDA)
    x, y = cuda_batch(model.config)
    module, chosen, _ = fast.for_training(model, CUDA, torch.bfloat16, "graphs")
    assert chosen == "graphs"
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        losses = [module(x, y)[1].item() for _ in range(5)]
        assert len(set(losses)) == 5  # a new mask or corruption every replay, not the captured one
        with pytest.raises(ValueError, match="replays the shapes it captured"):
            # MLM corrupts inside the model: no targets passed
            module(x[:1], None if y is None else y[:1])


@CUDA_ONLY
def test_train_py_runs_under_cuda_graphs_and_resumes_exactly(tiny_data, tmp_path):
    flags = image_flags(tiny_data, "mae", "--max_iters", "6", "--eval_interval", "3",
                        "--compile", "graphs", "--dtype", "float32")
    code, out, whole = run_train(*flags, out_dir=tmp_path / "whole")
    assert code == 0 and "compile: graphs" in out, out
    code, out, _ = run_train(*flags, "--time_limit", "1e-9", out_dir=tmp_path / "parts")
    assert code == 0, out
    code, out, parts = run_train("--resume", "--compile", "graphs", out_dir=tmp_path / "parts")
    assert code == 0, out
    a, b = train_losses(parts), train_losses(whole)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 * max(1, abs(b[k]))
                                        for k in b), (a, b)


@CUDA_ONLY
def test_per_layer_metrics_under_cuda_graphs_leave_training_as_it_was(tiny_data, tmp_path):
    """Under CUDA graphs the evaluation's measurement leaves the replayed step untouched (the same
    losses with and without it), and the metrics are logged."""
    flags = image_flags(tiny_data, "mae", "--max_iters", "4", "--eval_interval", "2",
                        "--compile", "graphs", "--dtype", "float32")
    code, out, probed = run_train(*flags, "--probe_samples", "8", out_dir=tmp_path / "a")
    assert code == 0 and "compile: graphs" in out, out
    code, out, plain = run_train(*flags, "--probe_samples", "0", out_dir=tmp_path / "b")
    assert code == 0, out
    a, b = train_losses(probed), train_losses(plain)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 * max(1, abs(b[k]))
                                        for k in b), (a, b)
    assert all(len(r["layers"]["erank"]) == 3 for r in probed if r.get("eval"))

@CUDA_ONLY
def test_to_device_leaves_a_cuda_tensor_where_it_is_whatever_the_device_is_called():
    """--device cuda names no index, while the GPU-resident data sits on cuda:0: pinning it
    would fail."""
    x = torch.arange(6, device="cuda:0")
    assert to_device(x, torch.device("cuda")) is x
    moved = to_device(torch.arange(6), torch.device("cuda"))
    assert moved.is_cuda and torch.equal(moved.cpu(), torch.arange(6))
