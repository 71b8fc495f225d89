"""Datasets for the four objectives: images decoded once to uint8 on the device, or streamed from
disk when they would not fit; text tokenized once.

Images (mae, cls): `cifar10`, `cifar100` (torchvision, downloaded to --data_dir) or `folder`
(any ImageFolder tree with train/ and test/ or val/). Two ways to read them:
  ImageData    the whole split on the training device as one uint8 tensor; whole batches are
               augmented there (random crop with 4-pixel padding, a horizontal flip): CIFAR-sized
               data, where loading is then never the bottleneck.
  ImageStream  a folder too large for that (ImageNet at 224: 190 GB decoded) read as training goes
               by DataLoader worker processes, with MAE's augmentation (RandomResizedCrop, flip).
Both draw a global batch from the run's generator, so DDP ranks agree on it and a resumed run goes
on exactly; each rank then reads only its slice (`shard`).

Text (mlm, next): `wikitext2`, `wikitext103` (downloads.py fetches them from the author's mirror,
with a Hugging Face fallback) or `text` (any train/val pair of text files). Tokenized once with
tiktoken, cached as a uint16/uint32 .bin and memory-mapped; batches are random windows.
`--tokenizer bytes` is a 256-id byte-level tiktoken Encoding built in memory (no download).

Every failure a user can meet (no network, missing files) raises DataError with one line:
what is missing, where to put it, and which flag points elsewhere.

Run: python -c "import data; print(data.TextData('text', 'DIR', 'bytes', 'train.txt', 'val.txt',
     'cache', 128).vocab_size)"
"""
import copy
import hashlib
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from checkpoint import atomic_write

IMAGE_DATASETS = ("cifar10", "cifar100", "folder")
TEXT_DATASETS = ("wikitext2", "wikitext103", "text")
# ImageFolder's
IMAGE_FILES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DataError(Exception):
    """A data problem the user can fix; its message is one line and says how."""


# ----------------------------------------------------------------------------- images

def read_rgb(path):
    """An image file as an RGB PIL image, as ImageFolder reads it; an unreadable one is one line."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    # PIL's errors for unreadable, truncated or non-image files
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"cannot read image {path} ({type(e).__name__}: {e}); remove "
                        f"or replace that file") from None


def _decode(path, size):
    from PIL import Image

    im = read_rgb(path)
    return np.asarray(im if im.size == (size, size) else im.resize((size, size), Image.BICUBIC))


def _image_files(root):
    """torchvision's ImageFolder listing without importing torchvision (whose import pulls in
    torch._dynamo, seconds at every start): (path, class index) for each image under root/<class>/,
    classes and files sorted by name, so subsets match ImageFolder's; and the class names. Hidden
    folders (.ipynb_checkpoints) are not classes."""
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir()
                         and not e.name.startswith("."))
    except OSError as e:
        raise DataError(f"cannot list {root} ({e.strerror}); check its permissions or point "
                        f"--data_dir elsewhere")
    if not classes:
        raise DataError(f"{root} has no class folders; an image folder dataset needs "
                        f"{root}/<class>/<image>")
    samples = []
    for label, name in enumerate(classes):
        before = len(samples)
        for folder, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            samples += [(os.path.join(folder, f), label) for f in sorted(files)
                        if f.lower().endswith(IMAGE_FILES)]
        if len(samples) == before:
            raise DataError(f"{os.path.join(root, name)} holds no image ({' '.join(IMAGE_FILES)}); "
                            "add images to it or remove it")
    return samples, classes


def fixed_order(n):
    """A fixed random order of n items: the same for every run."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))


def fixed_subset(n, limit):
    """Indices of a fixed random subset of `limit` out of n, in order: the same for every run."""
    return fixed_order(n)[:limit].sort().values


def list_folder(data_dir, train=True, train_samples=0):
    """An ImageFolder tree's files, which both image paths read: ({"train": [(path, label)], "test":
    [...]}, class names). train_samples > 0 keeps a fixed subset of train; the test split comes in
    one fixed shuffle, since ImageFolder lists class by class and "the first N" must be fair."""
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} does not exist; point --data_dir at an image "
                        "folder tree with train/ and test/ inside")
    files, classes = {}, {}
    wanted = {"test": ("test", "val"), "train": ("train",)} if train else {"test": ("test", "val")}
    for split, names in wanted.items():
        roots = [os.path.join(data_dir, n) for n in names
                 if os.path.isdir(os.path.join(data_dir, n))]
        if not roots:
            raise DataError(f"no {' or '.join(n + '/' for n in names)} folder in {data_dir}; an "
                            f"image folder dataset needs {data_dir}/train/<class>/*.jpg and "
                            f"{data_dir}/test/<class>/*.jpg (point --data_dir at such a tree)")
        files[split], classes[split] = _image_files(roots[0])
    if train:
        check_split_classes(data_dir, classes["train"], classes["test"])
        if train_samples:
            files["train"] = [files["train"][i] for i in
                              fixed_subset(len(files["train"]), train_samples).tolist()]
    files["test"] = [files["test"][i] for i in fixed_order(len(files["test"])).tolist()]
    return files, classes["test"]


def check_split_classes(data_dir, train_classes, test_classes):
    """Labels are class indices: splits with different class folders would mislabel the test."""
    if train_classes != test_classes:
        only_train = sorted(set(train_classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(train_classes))
        raise DataError(f"{data_dir}: the splits have different classes (only in "
                        f"training: {only_train[:5]}, "
                        f"only in test: {only_test[:5]}); give both the same class folders")


def _load_split(name, data_dir, split, image_size, files, limit=0):
    if name == "folder":
        with ThreadPoolExecutor() as pool:  # PIL releases the GIL while decoding
            pixels = list(pool.map(lambda s: _decode(s[0], image_size), files[split]))
        # (N, 3, H, W) uint8
        images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous()
        return images, torch.tensor([label for _, label in files[split]]), None
    from downloads import cifar  # torchvision's CIFAR, downloaded to data_dir if absent

    images, labels, classes = cifar(name, data_dir, split == "train")
    if limit:  # the same fixed random subset as for folders
        keep = fixed_subset(len(images), limit)
        images, labels = images[keep], labels[keep]
    if images.shape[-1] != image_size:  # a few hundred at a time: float copies of all would be GBs
        images = torch.cat([resize(chunk, image_size) for chunk in images.split(500)])
    return images, labels, classes


def resize(images, size):
    """uint8 images (N, C, H, W) resized to (size, size), bicubic with antialiasing, as uint8."""
    resized = torch.nn.functional.interpolate(images.float(), size=size, mode="bicubic",
                                              antialias=True)
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
                 listing=None):
        """train=False loads the test split only (the probe needs nothing else); train_samples > 0
        keeps a fixed random subset of the training split (the test split stays whole); a folder's
        listing is list_folder's, made here unless given."""
        files = classes = None
        if name == "folder":
            files, classes = listing or list_folder(data_dir, train, train_samples)
        else:
            os.makedirs(data_dir, exist_ok=True)
        self.test_x, self.test_y, test_classes = _load_split(name, data_dir, "test", image_size,
                                                             files)
        self.train_x, self.train_y, _ = (
            _load_split(name, data_dir, "train", image_size, files, train_samples) if train
            else (self.test_x[:0], self.test_y[:0], None))
        self.classes = list(classes or test_classes)  # folder names, in label order
        self.num_classes = len(self.classes)
        self.train_x, self.train_y = self.train_x.to(device), self.train_y.to(device)
        self.test_x, self.test_y = self.test_x.to(device), self.test_y.to(device)
        # the training pixels' statistics (the test split's without a train split)
        self.mean, self.std = normalisation((self.train_x if train else self.test_x))
        self.image_size, self.channels = self.train_x.shape[-1], self.train_x.shape[1]

    def num_train(self):
        return len(self.train_x)

    def num_held_out(self):
        return len(self.test_x)

    def as_held_out(self):
        """This data as held_out() loads it (train=False: the test split on the CPU, normalised by
        its own statistics), without decoding a file again."""
        view = copy.copy(self)
        view.test_x, view.test_y = self.test_x.cpu(), self.test_y.cpu()
        view.train_x, view.train_y = view.test_x[:0], view.test_y[:0]
        view.mean, view.std = normalisation(view.test_x)
        return view

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
        n = len(self.test_x) if limit is None else min(limit, len(self.test_x))
        for i in range(0, n, batch_size):
            j = min(i + batch_size, n)
            yield self.normalize(self.test_x[i:j]), self.test_y[i:j]


def shard(draws, rank, world, grad_accum, k):
    """Micro-batch k of rank's part of a global batch's draws: world x grad_accum equal parts."""
    return {name: v.view(world, grad_accum, -1, *v.shape[1:])[rank][k]
            for name, v in draws.items()}


# ImageNet's channel statistics, by which MAE and timm normalise: a stream is never read whole
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# What torch's DataLoader raises when its workers are gone: its own error, or the broken connection
# to a dead worker that had yet to hand over a batch's shared memory
WORKERS_GONE = (RuntimeError, OSError, EOFError)


class ImageStream:
    """An image folder read from disk as training goes, for folders too large to decode whole
    (ImageNet-1k at 224: 190 GB of uint8): DataLoader workers decode ahead of the loop, each rank
    its own slice, as MAE augments (train_view, eval_view), normalised by ImageNet's statistics."""

    def __init__(self, listing, device, image_size, crop_scale=0.2, workers=0, rank=0, world=1,
                 grad_accum=1):
        self.files, classes = listing
        self.classes, self.num_classes = list(classes), len(classes)
        self.device, self.image_size, self.channels = torch.device(device), image_size, 3
        if workers < 0:  # this rank's share of the node's CPUs but the one that trains, at most 8
            cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1)
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            workers = min(8, max(1, cpus // ranks_here - 1))
        self.crop_scale, self.workers = crop_scale, workers
        self.shard = (rank, world, grad_accum)
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)
        self.replay = self.batches = None  # what the workers decode, and their micro-batches

    def num_train(self):
        return len(self.files.get("train", ()))

    def num_held_out(self):
        return len(self.files["test"])

    def as_held_out(self):
        """This data as held_out() loads it: the test split, evaluated on the CPU."""
        view = copy.copy(self)
        view.device, view.mean, view.std = torch.device("cpu"), self.mean.cpu(), self.std.cpu()
        return view

    def normalize(self, x):
        return standardised(x, self.mean, self.std)

    def sample(self, n, generator):
        """The random draws of one global batch: which images, and each one's crop seed."""
        if self.batches is None:  # from here on, the workers replay the generator
            self.replay = StreamReplay(self.files["train"], self.image_size, self.crop_scale,
                                       generator.get_state(), n, self.shard,
                                       self.worker_statistics())
            self.batches = iter(self.loader(self.replay))
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
        return self.normalize(x) if x.dtype == torch.uint8 else x

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


def leave_stopping_to_the_main_process(worker_id):
    """Ctrl-C reaches every process: the main one stops at a checkpoint and ends the workers. A
    SIGTERM (the DataLoader's own, a scheduler's) ends a worker quietly; see train_batch."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


class StreamReplay(torch.utils.data.IterableDataset):
    """One rank's micro-batches in the loop's order: each worker replays the run's generator from
    `state` (where the first sample() found it, a resumed run's restored one) and worker w of W
    decodes micro-batches w, w + W, ..., which the DataLoader returns in turn. The draws decide
    every pixel, so any worker count gives the same batches."""

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
        return as_batch(pixels, self.statistics), self.labels[part["index"]], part["index"]


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
        return (as_batch(pixels, self.statistics),
                torch.tensor([label for _, label in self.batches[i]]))


def as_batch(pixels, statistics=None):
    """(H, W, 3) uint8 arrays as one (N, 3, H, W) uint8 tensor, or standardised by (mean, std)."""
    x = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2)
    return x.contiguous() if statistics is None else standardised(x, *statistics)


def standardised(x, mean, std):
    """uint8 images as float32 (x / 255 - mean) / std, in three passes over one new tensor (these
    are the largest tensors a streamed step makes on the CPU)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    return out.mul_(1 / (255 * std)).sub_(mean / std)


def resized_crop_box(width, height, scale, generator, ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, drawing from `generator`: (top, left, h, w) of a
    crop of area scale[0]..scale[1] of the image and aspect ratio 3/4..4/3 (log-uniform); after ten
    misses, the centre crop nearest in shape."""
    area, log_ratio = width * height, torch.log(torch.tensor(ratio))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1],
                                                   generator=generator)).item()
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, (1,), generator=generator).item()
            left = torch.randint(0, width - w + 1, (1,), generator=generator).item()
            return top, left, h, w
    w, h = width, height
    if width / height < min(ratio):
        h = round(w / min(ratio))
    elif width / height > max(ratio):
        w = round(h * max(ratio))
    return (height - h) // 2, (width - w) // 2, h, w


def train_view(path, size, crop_scale, seed):
    """MAE's training view of an image: RandomResizedCrop(size, (crop_scale, 1), bicubic), then a
    horizontal flip half the time: torchvision's pipeline under torch.manual_seed(seed). (size,
    size, 3) uint8."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    im = read_rgb(path)
    top, left, h, w = resized_crop_box(*im.size, (crop_scale, 1.0), generator)
    im = im.crop((left, top, left + w, top + h)).resize((size, size), Image.BICUBIC)
    if torch.rand(1, generator=generator) < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(im)


def eval_view(path, size):
    """MAE's evaluation view: torchvision's Resize(int(size / crop), bicubic) of the shorter side,
    then CenterCrop(size); crop is 224 / 256 up to 224 px, else 1 (MAE's build_transform)."""
    from PIL import Image

    im = read_rgb(path)
    width, height = im.size
    short = int(size / (224 / 256 if size <= 224 else 1.0))
    if width <= height:
        new = (short, int(short * height / width))
    else:
        new = (int(short * width / height), short)
    im = im.resize(new, Image.BICUBIC)  # PIL returns a copy when the size is already right
    top, left = int(round((new[1] - size) / 2)), int(round((new[0] - size) / 2))
    return np.asarray(im.crop((left, top, left + size, top + size)))


def open_images(name, data_dir, device, image_size, train=True, train_samples=0, stream="off",
                memory_gb=16.0, **streaming):
    """ImageData (decoded once into memory), or ImageStream where asked (stream 'on') or, under
    'auto', where an image folder's decoded splits would take more than memory_gb."""
    if name != "folder":
        if stream == "on":
            raise DataError(f"--stream on reads an image folder; --dataset {name} is decoded into "
                            "memory (use --stream auto or off, or --dataset folder)")
        return ImageData(name, data_dir, device, image_size, train, train_samples)
    listing = list_folder(data_dir, train, train_samples)
    decoded_gb = sum(map(len, listing[0].values())) * 3 * image_size ** 2 / 1e9
    if stream == "on" or (stream == "auto" and decoded_gb > memory_gb):
        return ImageStream(listing, device, image_size, **streaming)
    return ImageData(name, data_dir, device, image_size, train, train_samples, listing)


def normalisation(images):
    """(mean, std) per channel of the first 10,000 images. A channel that barely varies (a colour
    the dataset does not use, one image) is only centred: dividing by ~0 would make every input
    non-finite. 1/255 is one grey level."""
    mean, std = channel_statistics(images[:10000])
    return mean, torch.where(std > 1 / 255, std, torch.ones_like(std))


def held_out(config, train_cfg, dataset="", data_dir="", tokenizer="", val_file=""):
    """The held-out split a model of `config` was trained on (train_cfg, a checkpoint's "train"),
    or the one named, un-augmented and on the CPU: ImageData or TextData with train=False."""
    c = config
    dataset = dataset or train_cfg.get("dataset") or ("cifar10" if c.is_image else "wikitext2")
    data_dir = data_dir or train_cfg.get("data_dir") or "./data"
    if c.is_image != (dataset in IMAGE_DATASETS):
        kind, fits = ("an image", IMAGE_DATASETS) if c.is_image else ("a text", TEXT_DATASETS)
        raise DataError(f"{kind} model ({c.objective}) cannot be run on --dataset {dataset}; use "
                        f"{' or '.join(fits)}")
    if c.is_image:  # a streamed run is evaluated in its own view (and a stream reads only a folder)
        stream = train_cfg.get("stream", "off") if dataset == "folder" else "off"
        return open_images(dataset, data_dir, "cpu", c.image_size, train=False,
                           stream="on" if stream == "on" else "off")
    data = TextData(dataset, data_dir, tokenizer or train_cfg.get("tokenizer", "gpt2"), "",
                    val_file or train_cfg.get("val_file", "val.txt"),
                    train_cfg.get("cache_dir", "./data/cache"), c.seq_len, train=False)
    if data.vocab_size > c.vocab_size:
        raise DataError(f"the tokenizer has {data.vocab_size} ids but the model knows "
                        f"{c.vocab_size}; pass the --tokenizer it was trained with")
    return data


def first_samples(data, n):
    """The first n held-out samples of ImageData or TextData, in order, un-augmented: (n, ...)."""
    return torch.cat([x for x, _ in data.eval_batches(n, n)])


def channel_statistics(images, one_pass_bytes=2 ** 30):
    """Per-channel mean and std (1, C, 1, 1) of uint8 images in [0, 1] units. In one float32 pass
    where that takes under 1 GB (CIFAR: 123 MB); larger images (ImageNet-sized, or CIFAR upsampled
    for a pretrained model) in float64 sums over chunks, which need no copy of them all."""
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
    flips (B,): one gather on x's device for the whole batch."""
    B, C, H, W = x.shape
    offsets, flips = offsets.to(x.device), flips.to(x.device)[:, None]
    rows = torch.arange(H, device=x.device) + offsets[:, :1]  # (B, H) rows of the padded image
    cols = torch.arange(W, device=x.device).expand(B, W)
    cols = torch.where(flips, W - 1 - cols, cols) + offsets[:, 1:]  # (B, W)
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    b = torch.arange(B, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------- text

def get_tokenizer(name):
    """A tiktoken Encoding by name, 'bytes' (256 ids, one per byte, built in memory), or
    hf:NAME, a Hugging Face model's own tokenizer."""
    import tiktoken

    if name.startswith("hf:"):
        from downloads import HuggingFaceTokenizer

        return HuggingFaceTokenizer(name[3:])
    if name == "bytes":
        return tiktoken.Encoding("bytes", pat_str=r"[\s\S]",
                                 mergeable_ranks={bytes([i]): i for i in range(256)},
                                 special_tokens={})
    try:
        return tiktoken.get_encoding(name)
    except ValueError:
        raise DataError(f"unknown tokenizer {name!r}; use a tiktoken encoding name (gpt2, "
                        "r50k_base, cl100k_base, ...), bytes, or hf:NAME") from None
    except Exception as e:
        gpt2 = " (or --tokenizer r50k_base: GPT-2's ranks in one file)" if name == "gpt2" else ""
        raise DataError(f"could not load tiktoken encoding {name!r} ({type(e).__name__}); without "
                        f"network set TIKTOKEN_CACHE_DIR to a folder holding its BPE file{gpt2}, "
                        "or use --tokenizer bytes") from None


def read_text(path):
    """The text of a UTF-8 file; any other encoding is one line, never replacement characters."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}); "
                        "convert it, e.g. iconv -f latin1 -t utf-8") from None


def tokenize_cached(path, tokenizer, cache_dir):
    """Token ids of a text file, tokenized once and then memory-mapped from cache_dir."""
    stat = os.stat(path)
    fingerprint = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer.name}"
    key = hashlib.sha1(fingerprint.encode())
    dtype = np.uint16 if tokenizer.n_vocab <= 2 ** 16 else np.uint32
    cache = os.path.join(cache_dir,
                         f"{os.path.basename(path)}.{tokenizer.name}.{key.hexdigest()[:12]}.bin")
    if not os.path.exists(cache):
        os.makedirs(cache_dir, exist_ok=True)
        ids = tokenizer.encode_ordinary(read_text(path))
        atomic_write(cache, lambda f: f.write(np.asarray(ids, dtype=dtype).tobytes()))
    return np.memmap(cache, dtype=dtype, mode="r")


class TextData:
    """Train and validation token streams, with random training windows and fixed eval windows."""

    def __init__(self, name, data_dir, tokenizer, train_file, val_file, cache_dir, seq_len,
                 train=True):
        """train=False reads the validation file only (the probe needs nothing else)."""
        self.tokenizer = get_tokenizer(tokenizer)
        if name in ("wikitext2", "wikitext103"):
            from downloads import download_wikitext

            data_dir = download_wikitext(name, data_dir)
            train_file, val_file = "train.txt", "valid.txt"
        wanted = ((train_file, "--train_file"),) if train else ()
        tokens = []
        for file, flag in wanted + ((val_file, "--val_file"),):
            path = os.path.join(data_dir, file)
            if not os.path.isfile(path):
                raise DataError(f"missing text file {path}; put it there, or point --data_dir "
                                f"and {flag} elsewhere")
            if os.path.getsize(path) == 0:
                raise DataError(f"text file {path} is empty; give {flag} a file with text in it")
            tokens.append(tokenize_cached(path, self.tokenizer, cache_dir))
        self.train, self.val = tokens if train else (tokens[0][:0], tokens[0])
        self.vocab_size = self.tokenizer.n_vocab
        self.seq_len = seq_len
        for split, tokens in (("train", self.train), ("val", self.val))[0 if train else 1:]:
            if len(tokens) <= seq_len:
                raise DataError(f"{split} text has {len(tokens)} tokens, fewer than one window of "
                                f"seq_len={seq_len}; "
                                "use more text or a smaller --seq_len")

    def sample(self, n, generator):
        """The random draws of one global batch: where each window starts."""
        return {"start": torch.randint(0, self.num_train(), (n,), generator=generator)}

    def train_batch(self, draws):
        """Windows of seq_len tokens (int64) for (a shard of) a sampled batch; text has no
        labels."""
        starts = draws["start"].tolist()
        return torch.from_numpy(np.stack([self.train[s: s + self.seq_len]
                                          for s in starts]).astype(np.int64)), None

    def as_held_out(self):
        """This data as held_out() loads it: the validation windows are the same already."""
        return self

    def num_train(self):
        return len(self.train) - self.seq_len + 1

    def num_held_out(self):
        """Whole validation windows."""
        return (len(self.val) - 1) // self.seq_len

    def eval_batches(self, batch_size, limit=None):
        """Consecutive non-overlapping validation windows, in order: the same every time."""
        n = self.num_held_out() if limit is None else min(self.num_held_out(), limit)
        for i in range(0, n, batch_size):
            rows = [self.val[k * self.seq_len: (k + 1) * self.seq_len]
                    for k in range(i, min(i + batch_size, n))]
            yield torch.from_numpy(np.stack(rows).astype(np.int64)), None
