"""pytest set-up: the repository on the import path, one CPU thread, and the tiny data every CLI test shares.

Run: python -m pytest -q tests
"""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The suite's models are tiny: splitting their ops over two threads costs more in hand-offs than it saves on
# a 2-core machine, and one thread leaves the other core to the torchrun and signal tests' subprocesses.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """An ImageFolder of two colour classes written with PIL, and a train/val pair of text files.

    Each image is its class colour plus a smooth wave of random phase and light noise, so
    that hidden patches are predictable from visible ones, as in real photos.
    """
    from PIL import Image

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
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat".split()
    for name, n in (("train.txt", 3000), ("val.txt", 600)):
        (text / name).write_text(" ".join(words[i % len(words)] for i in range(n)))
    return root


# The CUDA tests (tests/gpu/) are collected only where a GPU is: CPU runs and CI never see them.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]
