"""Datasets for the four objectives: images decoded once to uint8 on the device, or streamed from
disk when they would not fit; text tokenized once.

Images (mae, cls): `cifar10`, `cifar100` (torchvision, downloaded to --data_dir) or `folder`
(any ImageFolder tree with train/ and test/ or val/). Two ways to read them:
  ImageData    the whole split on the training device as one uint8 tensor, whole batches augmented
               there (random crop with 4-pixel padding, a horizontal flip): CIFAR-sized data. A
               folder is listed, decoded once and kept in --cache_dir by operations/files.py.
  ImageStream  (operations/streaming.py) a folder too large for that (ImageNet) read by DataLoader
               workers as training goes, with MAE's augmentation; streaming.open_images chooses.
Both draw a global batch from the run's generator, so DDP ranks agree on it and a resumed run goes
on exactly; each rank then reads only its slice (`shard`).

Text (mlm, next): `wikitext2`, `wikitext103` (operations/files.py fetches them from the author's
mirror) or `text` (any train/val pair of text files). Tokenized once with tiktoken, cached as a
uint16/uint32 .bin and memory-mapped; batches are random windows.

Every failure a user can meet (no network, missing files) raises files.DataError with one line:
what is missing, where to put it, and which flag points elsewhere.

Run: python -c "import data; print(data.TextData('text', 'DIR', 'bytes', 'train.txt', 'val.txt',
     'cache', 128).vocab_size)"
"""
import os
import zlib

import numpy as np
import torch

from operations import files, hub

IMAGE_DATASETS = ("cifar10", "cifar100", "folder")
TEXT_DATASETS = ("wikitext2", "wikitext103", "text")


# ----------------------------------------------------------------------------- images

def _load_split(name, data_dir, split, image_size, listed, limit=0, cache_dir=None):
    """A folder's split decoded (and cached), or CIFAR's downloaded."""
    if name == "folder":
        labels = torch.tensor([label for _, label in listed[split]])
        return files.decode_folder(listed[split], image_size, cache_dir), labels, None
    images, labels, classes = files.cifar(name, data_dir, split == "train")
    if limit:  # the same fixed random subset as for folders
        keep = files.fixed_subset(len(images), limit)
        images, labels = images[keep], labels[keep]
    if images.shape[-1] != image_size:  # a few hundred at a time: float copies of all would be GBs
        images = torch.cat([resize(chunk, image_size) for chunk in images.split(500)])
    return images, labels, classes


def resize(images, size):
    """uint8 images (N, C, H, W) resized to (size, size), bicubic with antialiasing, as uint8."""
    resized = torch.nn.functional.interpolate(images.float(), size, mode="bicubic", antialias=True)
    return resized.round().clamp(0, 255).to(torch.uint8)


def to_device(t, device):
    """t on device without making the CPU wait for the GPU: a copy from pageable memory would wait
    for everything queued before it, so small per-step tensors go through pinned memory."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class ImageData:
    """A dataset's train and test split as uint8 tensors on `device`, with batch augmentation."""

    def __init__(self, name, data_dir, device, image_size=32, train=True, train_samples=0,
                 listing=None, cache_dir=None, statistics=None):
        """Both splits decoded once to uint8 on `device`; train=False: the test split only;
        train_samples > 0: a fixed random training subset; listing: list_folder's (else made here);
        cache_dir keeps the decoded splits; statistics: a checkpoint's (mean, std)."""
        listed, classes = ((listing or files.list_folder(data_dir, train, train_samples))
                           if name == "folder" else (None, None))
        self.test_x, self.test_y, test_classes = _load_split(name, data_dir, "test", image_size,
                                                             listed, cache_dir=cache_dir)
        self.train_x, self.train_y, _ = (
            _load_split(name, data_dir, "train", image_size, listed, train_samples, cache_dir)
            if train else (self.test_x[:0], self.test_y[:0], None))
        self.fingerprint = None  # what a resume checks: a folder's files and labels, CIFAR's pixels
        if train and listed:
            self.fingerprint = files.listing_fingerprint(listed["train"] + listed["test"])
        elif train:
            train_crc = zlib.crc32(self.train_x.contiguous().numpy())
            self.fingerprint = zlib.crc32(self.test_x.contiguous().numpy(), train_crc)
        self.classes = list(classes or test_classes)  # folder names, in label order
        self.num_classes = len(self.classes)
        self.train_x, self.train_y = self.train_x.to(device), self.train_y.to(device)
        self.test_x, self.test_y = self.test_x.to(device), self.test_y.to(device)
        self.mean, self.std = ([s.to(device) for s in statistics] if statistics else
                               normalisation(self.train_x if train else self.test_x))
        self.image_size, self.channels = self.train_x.shape[-1], self.train_x.shape[1]

    def num_train(self):
        return len(self.train_x)

    def num_held_out(self):
        return len(self.test_x)

    def normalize(self, x):
        return (x.float() / 255 - self.mean) / self.std

    def sample(self, n, generator):
        """The random draws of one global batch: which images, where to crop, whether to flip."""
        return {"index": torch.randint(0, len(self.train_x), (n,), generator=generator),
                "offset": torch.randint(0, 9, (n, 2), generator=generator),
                "flip": torch.rand(n, generator=generator) < 0.5}

    def train_batch(self, draws):
        """Augmented, normalised images and their labels for (a shard of) a sampled batch."""
        device = self.train_x.device
        index, offsets, flips = (to_device(draws[k], device) for k in ("index", "offset", "flip"))
        x = random_crop_flip(self.train_x[index], offsets, flips)
        return self.normalize(x), self.train_y[index]

    def eval_batches(self, batch_size, limit=None):
        """The first `limit` test images, in order, un-augmented."""
        x, y = self.test_x[:limit], self.test_y[:limit]
        for i in range(0, len(x), batch_size):
            yield self.normalize(x[i:i + batch_size]), y[i:i + batch_size]


def shard(draws, rank, world, grad_accum, k):
    """Micro-batch k of rank's part of a global batch's draws: world x grad_accum equal parts."""
    return {name: v.view(world, grad_accum, -1, *v.shape[1:])[rank][k] for name, v in draws.items()}


def normalisation(images):
    """(mean, std) per channel of a fixed random 10,000 images (a folder lists them class by class);
    a channel that varies by under one grey level (1/255) is only centred, never divided by ~0."""
    mean, std = channel_statistics(images[files.fixed_subset(len(images), 10000)])
    return mean, torch.where(std > 1 / 255, std, torch.ones_like(std))


def first_samples(data, n):
    """The first n held-out samples of ImageData or TextData, in order, un-augmented, as the model
    reads them (a next-token window without its last token, which is only a target): (n, ...)."""
    x = torch.cat([x for x, _ in data.eval_batches(n, n)])
    return x[:, :data.seq_len] if x.dim() == 2 else x


def channel_statistics(images, one_pass_bytes=2 ** 30):
    """Per-channel mean and std (1, C, 1, 1) of uint8 images in [0, 1] units: in one float32 pass
    under one_pass_bytes, else in float64 sums over chunks, which need no float copy of them all."""
    if images.numel() * 4 < one_pass_bytes:
        flat = images.float().div(255).transpose(0, 1).flatten(1)  # (C, N * H * W)
        return flat.mean(1).view(1, -1, 1, 1), flat.std(1).view(1, -1, 1, 1)
    total = square = 0
    for chunk in images.split(200):
        flat = chunk.double().div(255).transpose(0, 1).flatten(1)
        total, square = total + flat.sum(1), square + flat.pow(2).sum(1)
    n = images.numel() // images.shape[1]
    mean = total / n
    std = ((square - n * mean ** 2) / (n - 1)).clamp_min(0).sqrt()
    return mean.float().view(1, -1, 1, 1), std.float().view(1, -1, 1, 1)


def random_crop_flip(x, offsets, flips, pad=4):
    """Crop a zero-padded (B, C, H, W) batch back to (H, W) at offsets (B, 2), flipping where
    flips (B,), both on x's device: one gather for the whole batch."""
    B, C, H, W = x.shape
    rows = torch.arange(H, device=x.device) + offsets[:, :1]  # (B, H) rows of the padded image
    cols = torch.arange(W, device=x.device).expand(B, W)
    cols = torch.where(flips[:, None], W - 1 - cols, cols) + offsets[:, 1:]  # (B, W)
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    b = torch.arange(B, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------- text

def get_tokenizer(name):
    """A tiktoken Encoding by name, 'bytes' (256 ids, one per byte, built in memory), or
    hf:NAME, a Hugging Face model's own tokenizer."""
    import tiktoken

    if name.startswith("hf:"):
        return hub.HuggingFaceTokenizer(name[3:])
    if name == "bytes":
        return tiktoken.Encoding("bytes", pat_str=r"[\s\S]", special_tokens={},
                                 mergeable_ranks={bytes([i]): i for i in range(256)})
    try:
        return tiktoken.get_encoding(name)
    except ValueError:
        raise files.DataError(f"unknown tokenizer {name!r}; use a tiktoken encoding name (gpt2, "
                              "r50k_base, cl100k_base, ...), bytes, or hf:NAME") from None
    except Exception as e:
        gpt2 = " (or --tokenizer r50k_base: GPT-2's ranks in one file)" if name == "gpt2" else ""
        raise files.DataError(f"could not load tiktoken encoding {name!r} ({type(e).__name__}); "
                              "without network set TIKTOKEN_CACHE_DIR to a folder holding its BPE "
                              f"file{gpt2}") from None


class TextData:
    """Train and validation token streams, with random training windows and fixed eval windows."""

    def __init__(self, name, data_dir, tokenizer, train_file, val_file, cache_dir, seq_len,
                 train=True, device="cpu", next_token=False):
        """Each file tokenized once (and cached); train=False: the validation file only. Training
        batches are made on the CPU and handed to `device`. next_token: windows of seq_len + 1
        tokens, the last only a target (nanoGPT's block_size + 1), so every position trains."""
        self.tokenizer = get_tokenizer(tokenizer)
        if name in ("wikitext2", "wikitext103"):
            data_dir = files.download_wikitext(name, data_dir)
            train_file, val_file = "train.txt", "valid.txt"
        wanted = ((train_file, "--train_file"),) if train else ()
        tokens = []
        for file, flag in wanted + ((val_file, "--val_file"),):
            path = os.path.join(data_dir, file)
            if not os.path.isfile(path):
                what = "is not a file (a folder, a pipe)" if os.path.exists(path) else "is missing"
                raise files.DataError(f"text file {path} {what}; put the text there, or point "
                                      f"--data_dir and {flag} elsewhere")
            if os.path.getsize(path) == 0:
                raise files.DataError(f"{path} is empty; give {flag} a file with text in it")
            tokens.append(files.tokenize_cached(path, self.tokenizer, cache_dir))
        self.train, self.val = tokens if train else (tokens[0][:0], tokens[0])
        self.fingerprint = zlib.crc32(self.val, zlib.crc32(self.train)) if train else None
        self.vocab_size, self.seq_len, self.device = self.tokenizer.n_vocab, seq_len, device
        self.window = seq_len + 1 if next_token else seq_len
        for split, tokens in (("train", self.train), ("val", self.val))[0 if train else 1:]:
            if len(tokens) <= seq_len:  # one window and the token after it
                raise files.DataError(f"{split} text has {len(tokens)} tokens, fewer than one "
                                      f"window of seq_len={seq_len} and its target; use more text "
                                      "or a smaller --seq_len")

    def sample(self, n, generator):
        """The random draws of one global batch: where each window starts."""
        return {"start": torch.randint(0, self.num_train(), (n,), generator=generator)}

    def train_batch(self, draws):
        """Windows of tokens (int64, on the device) for (a shard of) a sampled batch; no labels."""
        windows = np.stack([self.train[s: s + self.window] for s in draws["start"].tolist()])
        x = torch.from_numpy(windows.astype(np.int64))
        return to_device(x, torch.device(self.device)), None

    def num_train(self):
        return len(self.train) - self.window + 1

    def num_held_out(self):
        """Whole validation windows."""
        return (len(self.val) - 1) // self.seq_len

    def eval_batches(self, batch_size, limit=None):
        """Consecutive validation windows, seq_len apart, in order: the same every time (next
        token: each overlaps the next by the one token that is only its target)."""
        n = self.num_held_out() if limit is None else min(self.num_held_out(), limit)
        for i in range(0, n, batch_size):
            rows = [self.val[k * self.seq_len: k * self.seq_len + self.window]
                    for k in range(i, min(i + batch_size, n))]
            yield torch.from_numpy(np.stack(rows).astype(np.int64)), None
