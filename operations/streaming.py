"""Image folders too large to decode whole (ImageNet at 224: 190 GB of uint8), read from disk as
training goes by DataLoader workers in MAE's views; and the choice, for a run or a probe, between
them and data.ImageData (open_images, held_out).

Run: python train.py --dataset folder --data_dir DIR --stream on   (ImageStream)
"""
import itertools
import os
import signal
import threading

import numpy as np
import torch

from data import IMAGE_DATASETS, TEXT_DATASETS, ImageData, TextData, shard, to_device
from operations import fast
from operations.files import DataError, as_batch, list_folder, listing_fingerprint, read_rgb


# ImageNet's channel statistics, by which MAE and timm normalise: a stream is never read whole
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# What torch's DataLoader raises when its workers are gone: its own error, or a dead worker's pipe
WORKERS_GONE = (RuntimeError, OSError, EOFError)


class ImageStream:
    """An image folder read from disk as training goes, for folders too large to decode whole
    (ImageNet-1k at 224: 190 GB of uint8): DataLoader workers decode ahead of the loop, each rank
    its own slice, as MAE augments (train_view, eval_view), normalised by ImageNet's statistics."""

    def __init__(self, listing, device, image_size, crop_scale=0.2, workers=0, rank=0, world=1,
                 grad_accum=1):
        self.files, classes = listing
        self.fingerprint = listing_fingerprint(self.files.get("train", []) + self.files["test"])
        self.classes, self.num_classes = list(classes), len(classes)
        self.device, self.image_size, self.channels = torch.device(device), image_size, 3
        if workers < 0:  # this rank's share of the node's CPUs but the one that trains, at most 8
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            workers = min(8, max(1, fast.cpus() // ranks_here - 1))
        self.crop_scale, self.workers = crop_scale, workers
        self.shard = (rank, world, grad_accum)
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)
        self.replay = self.batches = None  # what the workers decode, and their micro-batches

    def num_train(self):
        return len(self.files.get("train", ()))

    def num_held_out(self):
        return len(self.files["test"])

    def sample(self, n, generator):
        """The random draws of one global batch: which images, and each one's crop seed."""
        if self.batches is None:  # from here on, the workers replay the generator
            self.replay = StreamReplay(self.files["train"], self.image_size, self.crop_scale,
                                       generator.get_state(), n, self.shard,
                                       self.worker_statistics())
            self.batches = iter(self.loader(self.replay))
            raise_dead_workers_where_read()
        return draw_stream_batch(n, self.num_train(), generator)

    def train_batch(self, draws):
        """The next micro-batch the workers decoded: the one these draws name. If the workers were
        stopped (a signal to every process), this process decodes it, and sample() starts anew."""
        item = None
        if self.batches is not None:
            try:
                item = next(self.batches)
            except WORKERS_GONE:
                self.batches = None
        x, y, index = checked(item if item is not None else self.replay.decode(draws))
        if not torch.equal(index, draws["index"]):  # sample() and train_batch() out of step
            raise RuntimeError("the streamed micro-batch is not the one sampled")
        return self.model_input(x), to_device(y, self.device)

    def eval_batches(self, batch_size, limit=None):
        """The first `limit` test images, in order, in MAE's evaluation view (decoded here from
        where the workers stopped, if a signal to every process stops them)."""
        files = self.files["test"][:limit]
        batches = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
        dataset = StreamEval(batches, self.image_size, self.worker_statistics())
        items = iter(self.loader(dataset))
        raise_dead_workers_where_read()
        for i in range(len(dataset)):
            try:
                item = next(items) if items is not None else dataset[i]
            except WORKERS_GONE:
                items, item = None, dataset[i]
            x, y = checked(item)
            yield self.model_input(x), to_device(y, self.device)

    def worker_statistics(self):
        """What the workers normalise with: nothing for a GPU, which takes uint8 (a quarter of the
        bytes) and normalises them itself; else the mean and std, so that the workers share it."""
        return (self.mean, self.std) if self.device.type == "cpu" else None

    def model_input(self, x):
        """A worker's batch on the device, normalised."""
        x = to_device(x, self.device)
        return standardised(x, self.mean, self.std) if x.dtype == torch.uint8 else x

    def loader(self, dataset):
        """torch's DataLoader over whole micro-batches, in order. Its own generator: the default
        would draw the workers' seeds from the global RNG, which MAE's masks come from."""
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.workers,
                                           pin_memory=self.device.type == "cuda",
                                           worker_init_fn=leave_stopping_to_the_main_process,
                                           generator=torch.Generator())


def draw_stream_batch(n, num_train, generator):
    """Which images a global batch takes (with replacement) and a seed for each one's crop."""
    return {"index": torch.randint(0, num_train, (n,), generator=generator),
            "seed": torch.randint(0, 2 ** 62, (n,), generator=generator)}


def checked(item):
    """A worker's result; a worker's DataError comes back as its line (a traceback otherwise)."""
    if isinstance(item, str):
        raise DataError(item)
    return item


def raise_dead_workers_where_read():
    """torch's DataLoader raises a dead worker's error from a SIGCHLD handler, wherever the main
    process is (a forward, a save); without the handler it raises where a batch is read, within
    seconds, and train_batch and eval_batches decode that batch here and go on."""
    if hasattr(signal, "SIGCHLD") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def leave_stopping_to_the_main_process(worker_id):
    """Ctrl-C reaches every process: the main one stops at a checkpoint and ends the workers. A
    SIGTERM (the DataLoader's own, a scheduler's) ends a worker quietly; see train_batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


class StreamReplay(torch.utils.data.IterableDataset):
    """One rank's micro-batches in the loop's order: each worker replays the run's generator from
    `state` (as the first sample() found it, restored on a resume); worker w of W decodes micro-
    batches w, w + W, ..., returned in turn; the draws decide every pixel, whatever the workers."""

    def __init__(self, files, size, crop_scale, state, n, shard, statistics=None):
        # two numpy arrays, not a list of 1.28M tuples: each worker's reference counting would
        # copy the list's pages into its own memory, one ImageNet listing per worker
        self.paths = np.array([os.fsencode(path) for path, _ in files])
        self.labels = torch.tensor([label for _, label in files])
        self.size, self.crop_scale, self.statistics = size, crop_scale, statistics
        self.state, self.n, (self.rank, self.world, self.grad_accum) = state, n, shard

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        generator = torch.Generator()
        generator.set_state(self.state)
        for step in itertools.count():
            draws = draw_stream_batch(self.n, len(self.labels), generator)
            for k in range(self.grad_accum):
                if (step * self.grad_accum + k) % workers == worker:
                    yield self.decode(shard(draws, self.rank, self.world, self.grad_accum, k))

    def decode(self, part):
        try:
            pixels = [train_view(os.fsdecode(self.paths[i]), self.size, self.crop_scale, seed)
                      for i, seed in zip(part["index"].tolist(), part["seed"].tolist())]
        except DataError as e:
            return str(e)
        return as_input(pixels, self.statistics), self.labels[part["index"]], part["index"]


class StreamEval(torch.utils.data.Dataset):
    """Held-out batches of (path, label), each decoded in MAE's evaluation view."""

    def __init__(self, batches, size, statistics=None):
        self.batches, self.size, self.statistics = batches, size, statistics

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        try:
            pixels = [eval_view(path, self.size) for path, _ in self.batches[i]]
        except DataError as e:
            return str(e)
        return (as_input(pixels, self.statistics),
                torch.tensor([label for _, label in self.batches[i]]))


def as_input(pixels, statistics=None):
    """(H, W, 3) uint8 arrays as one (N, 3, H, W) uint8 tensor, or standardised by (mean, std)."""
    x = as_batch(pixels)
    return x if statistics is None else standardised(x, *statistics)


def standardised(x, mean, std):
    """uint8 images as float32 (x / 255 - mean) / std, in three passes over one new tensor (these
    are the largest tensors a streamed step makes on the CPU)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    return out.mul_(1 / (255 * std)).sub_(mean / std)


def train_view(path, size, crop_scale, seed):
    """MAE's training view of an image: RandomResizedCrop(size, (crop_scale, 1), bicubic), then a
    horizontal flip half the time, drawn from `seed`. (size, size, 3) uint8."""
    from torchvision import transforms as T

    view = T.Compose([T.RandomResizedCrop(size, (crop_scale, 1.0), interpolation=T.InterpolationMode
                                          .BICUBIC), T.RandomHorizontalFlip()])
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        return np.asarray(view(read_rgb(path)))


def eval_crop(size):
    """The share of the resized image evaluation keeps (MAE's build_transform; timm's crop_pct)."""
    return 224 / 256 if size <= 224 else 1.0


def eval_view(path, size):
    """MAE's evaluation view: Resize(int(size / eval_crop(size)), bicubic) of the shorter side,
    then CenterCrop(size)."""
    from torchvision import transforms as T

    short = int(size / eval_crop(size))
    view = T.Compose([T.Resize(short, interpolation=T.InterpolationMode.BICUBIC),
                      T.CenterCrop(size)])
    return np.asarray(view(read_rgb(path)))


def open_images(name, data_dir, device, image_size, train=True, train_samples=0, stream="off",
                memory_gb=16.0, cache_dir=None, statistics=None, **streaming):
    """ImageData (decoded once into memory, a folder's decoded splits kept in cache_dir), or
    ImageStream where asked (stream 'on') or, under 'auto', where an image folder's decoded splits
    would take more than memory_gb."""
    if name != "folder":
        if stream == "on":
            raise DataError(f"--stream on reads an image folder; --dataset {name} is decoded into "
                            "memory (use --stream auto or off, or --dataset folder)")
        return ImageData(name, data_dir, device, image_size, train, train_samples,
                         statistics=statistics)
    listing = list_folder(data_dir, train, train_samples)
    decoded_gb = sum(map(len, listing[0].values())) * 3 * image_size ** 2 / 1e9
    if stream == "on" or (stream == "auto" and decoded_gb > memory_gb):
        return ImageStream(listing, device, image_size, **streaming)
    return ImageData(name, data_dir, device, image_size, train, train_samples, listing, cache_dir,
                     statistics)


def check_dataset_fits(is_image, objective, dataset):
    """An image model needs an image dataset, a text model a text one: training's and looking's."""
    if is_image != (dataset in IMAGE_DATASETS):
        kind, fits = ("an image", IMAGE_DATASETS) if is_image else ("a text", TEXT_DATASETS)
        raise DataError(f"{kind} model ({objective}) cannot be run on --dataset {dataset}; use "
                        f"{' or '.join(fits)}")


def held_out(config, train_cfg, dataset="", data_dir="", tokenizer="", val_file=""):
    """The held-out split a model of `config` was trained on (train_cfg: checkpoint.data_settings),
    or the one named, un-augmented and on the CPU, normalised as training saw it: ImageData or
    TextData with train=False."""
    c = config
    dataset = dataset or train_cfg.get("dataset") or ("cifar10" if c.is_image else "wikitext2")
    data_dir = data_dir or train_cfg.get("data_dir") or "./data"
    check_dataset_fits(c.is_image, c.objective, dataset)
    if c.is_image:  # a streamed run is evaluated in its own view (and a stream reads only a folder)
        streamed = dataset == "folder" and train_cfg.get("stream") == "on"
        return open_images(dataset, data_dir, "cpu", c.image_size, train=False,
                           stream="on" if streamed else "off",
                           cache_dir=train_cfg.get("cache_dir"),  # a run's own; else none
                           statistics=train_cfg.get("statistics"))
    data = TextData(dataset, data_dir, tokenizer or train_cfg.get("tokenizer", "gpt2"), "",
                    val_file or train_cfg.get("val_file", "val.txt"),
                    train_cfg.get("cache_dir", "./data/cache"), c.seq_len, train=False)
    if data.vocab_size > c.vocab_size:
        raise DataError(f"the tokenizer has {data.vocab_size} ids but the model knows "
                        f"{c.vocab_size}; pass the --tokenizer it was trained with")
    return data
