"""How data reaches the machine: image folders listed by torchvision's ImageFolder code, decoded
once and cached (list_folder, decode_folder), or streamed from disk as training goes (ImageStream,
with MAE's train_view and eval_view as torchvision transforms); and what a user with internet
downloads (CIFAR, WikiText, Hugging Face tokenizers), each failing offline with one line.

Run: python -c "from operations import datasets;
     print(datasets.ImageStream(datasets.list_folder('DIR'), 'cpu', 224).num_train())"
"""
import functools
import hashlib
import io
import itertools
import os
import signal
import threading
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from data import DataError, as_batch, fixed_order, fixed_subset, read_rgb, shard, to_device
from operations.checkpoint import atomic_write


# ImageNet's channel statistics, by which MAE and timm normalise: a stream is never read whole
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# What torch's DataLoader raises when its workers are gone: its own error, or the broken connection
# to a dead worker that had yet to hand over a batch's shared memory
WORKERS_GONE = (RuntimeError, OSError, EOFError)


# ----------------------------------------------------------------------------- image folders

def list_folder(data_dir, train=True, train_samples=0):
    """An ImageFolder tree's files, which both image paths read: ({"train": [(path, label)], "test":
    [...]}, class names). train_samples > 0 keeps a fixed subset of train; the test split comes in
    one fixed shuffle, since ImageFolder lists class by class and "the first N" must be fair."""
    if not os.path.isdir(data_dir):
        what = "is a file, not a folder" if os.path.exists(data_dir) else "does not exist"
        raise DataError(f"data directory {data_dir} {what}; point --data_dir at an image "
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


def _decode(path, size):
    from PIL import Image

    im = read_rgb(path)
    return np.asarray(im if im.size == (size, size) else im.resize((size, size), Image.BICUBIC))


def listing_fingerprint(samples):
    """A short sha1 of a split's (file, label) list, paths below their common folder (so a moved
    data_dir keeps it): a resume checks that the folder still lists the same files."""
    paths = [path for path, _ in samples]
    root, key = len(os.path.commonpath(paths)) if paths else 0, hashlib.sha1()
    for path, label in samples:
        key.update(f"{path[root:]}|{label}\n".encode())
    return key.hexdigest()[:16]


def stat_checksum(files):
    """A short sha1 of every listed file's size and modification time, split by split: a streamed
    folder's stand-in for a checksum of its pixels, which a resume compares."""
    key = hashlib.sha1()
    for split in sorted(files):
        for path, _ in files[split]:
            stat = os.stat(path)
            key.update(f"{split}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return key.hexdigest()[:16]


def _image_files(root):
    """torchvision's ImageFolder listing of root: ([(path, class index)], class names), classes and
    files sorted by name."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, index = find_classes(root)
        return make_dataset(root, index, extensions=IMG_EXTENSIONS), classes
    except OSError as e:  # no class folder, a class without images, an unreadable folder
        raise DataError(f"{root}: {e.strerror or e}; an image folder dataset needs "
                        f"{root}/<class>/<image>") from None


def decode_folder(files, size, cache_dir=None):
    """A folder split's images as one (N, 3, size, size) uint8 tensor, decoded once: with a
    cache_dir, later runs load the saved array, keyed by every file's path, size and times, the
    image size and DECODING, so that a changed folder (or decoder) is decoded again."""
    cache = cache_dir and os.path.join(cache_dir, folder_key(files, size))
    if cache and os.path.exists(cache):
        try:
            return torch.from_numpy(np.load(cache))
        except (OSError, ValueError, EOFError):  # damaged: decoded again and replaced below
            pass
    started = time.time()
    with ThreadPoolExecutor() as pool:  # PIL releases the GIL while decoding
        images = as_batch(list(pool.map(lambda s: _decode(s[0], size), files)))
    seconds, kept = time.time() - started, False
    if cache and int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one copy per machine under DDP
        try:
            os.makedirs(cache_dir, exist_ok=True)
            atomic_write(cache, lambda f: np.save(f, images.numpy()))
            kept = True
        except OSError as e:  # the run goes on; the next one decodes again
            print(f"note: decoded images not cached ({e.strerror}: {e.filename}); set --cache_dir "
                  "to a writable folder to load them at once next time", flush=True)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"decoded {len(files):,} images in {seconds:.1f} s"
              + (f", kept in {cache_dir} for the next run" if kept else ""), flush=True)
    return images


DECODING = "RGB, bicubic resize, uint8 (N, 3, H, W)"  # change it when _decode changes


def file_stamp(path):
    """A file's path, size and times, as a cache key sees it: ctime too, which no edit can set
    back (an edit that keeps size and mtime still changes the key)."""
    s = os.stat(path)
    return f"{os.path.abspath(path)}|{s.st_size}|{s.st_mtime_ns}|{s.st_ctime_ns}"


def folder_key(files, size):
    """The cache file's name for these files decoded at this size."""
    key = hashlib.sha1(f"{DECODING}|{size}".encode())
    for path, _ in files:
        key.update(f"{file_stamp(path)}\n".encode())
    return f"images.{len(files)}x{size}px.{key.hexdigest()[:16]}.npy"


# ----------------------------------------------------------------------------- text files

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
    """Token ids of a text file, tokenized once and then memory-mapped from cache_dir (keyed by
    file_stamp and the tokenizer)."""
    key = hashlib.sha1(f"{file_stamp(path)}|{tokenizer.name}".encode())
    dtype = np.uint16 if tokenizer.n_vocab <= 2 ** 16 else np.uint32
    cache = os.path.join(cache_dir,
                         f"{os.path.basename(path)}.{tokenizer.name}.{key.hexdigest()[:12]}.bin")
    if not os.path.exists(cache):
        ids = np.asarray(tokenizer.encode_ordinary(read_text(path)), dtype=dtype)
        try:
            os.makedirs(cache_dir, exist_ok=True)
            atomic_write(cache, lambda f: f.write(ids.tobytes()))
        except OSError as e:  # the run goes on with the tokens in memory; the next tokenizes again
            print(f"note: tokens not cached ({e.strerror}: {e.filename or cache_dir}); set "
                  "--cache_dir to a writable folder to load them at once next time", flush=True)
            return ids
    return np.memmap(cache, dtype=dtype, mode="r")


# ----------------------------------------------------------------------------- streaming

class ImageStream:
    """An image folder read from disk as training goes, for folders too large to decode whole
    (ImageNet-1k at 224: 190 GB of uint8): DataLoader workers decode ahead of the loop, each rank
    its own slice, as MAE augments (train_view, eval_view), normalised by ImageNet's statistics."""

    def __init__(self, listing, device, image_size, crop_scale=0.2, workers=0, rank=0, world=1,
                 grad_accum=1):
        self.files, classes = listing
        self.listing = listing_fingerprint(self.files.get("train", ()))  # checked on resume
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

    @functools.cached_property
    def checksum(self):
        """Sizes and times, not pixels (too many to read): on demand, by rank 0 only."""
        return stat_checksum(self.files)

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


def eval_view(path, size):
    """MAE's evaluation view: Resize(int(size / crop), bicubic) of the shorter side, then
    CenterCrop(size); crop is 224 / 256 up to 224 px, else 1 (MAE's build_transform)."""
    from torchvision import transforms as T

    short = int(size / (224 / 256 if size <= 224 else 1.0))
    view = T.Compose([T.Resize(short, interpolation=T.InterpolationMode.BICUBIC),
                      T.CenterCrop(size)])
    return np.asarray(view(read_rgb(path)))


# ----------------------------------------------------------------------------- downloads

# the WikiText mirror answers 403 to urllib's default
USER_AGENT = "Mozilla/5.0 (X11; Linux x86_64) bamboo"
WIKITEXT = {  # name -> (zip on the author's mirror, folder inside it)
    "wikitext2": ("https://wikitext.smerity.com/wikitext-2-raw-v1.zip", "wikitext-2-raw"),
    "wikitext103": ("https://wikitext.smerity.com/wikitext-103-raw-v1.zip", "wikitext-103-raw"),
}


def cifar(name, data_dir, train):
    """(uint8 images (N, 3, H, W), labels, class names) of a CIFAR split, via torchvision."""
    try:
        import torchvision
    except ImportError:
        raise DataError(f"--dataset {name} downloads through torchvision, which is not installed: "
                        "pip install torchvision, or use --dataset folder --data_dir DIR") from None

    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    archive = os.path.join(data_dir, cls.filename)
    had_archive = os.path.exists(archive)
    try:
        ds = cls(data_dir, train=train, download=True)
    except Exception as e:  # URLError, socket timeouts, md5 mismatch, ...
        if os.path.exists(archive) and not had_archive:
            # leave no half-written archive behind; never one that was there before
            os.remove(archive)
        raise DataError(f"could not download {name} to {data_dir} ({type(e).__name__}: {e}); "
                        f"put {cls.base_folder}/ there by hand, or use --dataset folder "
                        "--data_dir DIR with an ImageFolder tree") from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W) uint8
    return images, torch.tensor(ds.targets), list(ds.classes)


def _fetch(url, timeout=30):
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def download_wikitext(name, data_dir):
    """Fetch WikiText into data_dir/<folder>/{train,valid,test}.txt unless train.txt and valid.txt
    are there. The archive is read whole before any split is written, and a split that is there
    stays."""
    url, folder = WIKITEXT[name]
    target = os.path.join(data_dir, folder)
    if all(os.path.exists(os.path.join(target, f"{s}.txt")) for s in ("train", "valid")):
        return target
    try:
        archive = zipfile.ZipFile(io.BytesIO(_fetch(url)))
        texts = {s: archive.read(f"{folder}/wiki.{s}.raw") for s in ("train", "valid", "test")}
    except Exception as e:  # network and HTTP errors, a damaged archive
        raise DataError(f"could not download {name} from {url} ({type(e).__name__}: {e}); put "
                        f"{os.path.join(target, 'train.txt')} and "
                        f"{os.path.join(target, 'valid.txt')} there by hand (WikiText's "
                        "wiki.train.raw and wiki.valid.raw), or use --dataset text --data_dir DIR "
                        "with your own files") from None
    os.makedirs(target, exist_ok=True)
    for split, text in texts.items():
        if not os.path.exists(os.path.join(target, f"{split}.txt")):
            atomic_write(os.path.join(target, f"{split}.txt"), lambda f: f.write(text))
    return target


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer (hub name or folder) with the part of tiktoken's Encoding that
    this project calls: name, n_vocab, encode_ordinary (no special tokens added) and decode."""

    def __init__(self, name):
        try:
            import transformers
        except ImportError:
            raise DataError(f"--tokenizer hf:{name} needs transformers; pip install "
                            "transformers") from None
        if not os.path.isdir(name):  # offline: the hub's own switch, so no retries to sit out
            from operations.adapters import hub_unreachable

            hub_unreachable()
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:  # offline, unknown name, no tokenizer files
            raise DataError(f"could not load the Hugging Face tokenizer {name!r} "
                            f"({str(e).splitlines()[0][:120]}); it needs the network once "
                            "(then the cache), or pass --tokenizer bytes or a tiktoken "
                            "encoding") from None
        self.name = "hf-" + "".join(c if c.isalnum() or c in "-." else "_" for c in name)
        self.n_vocab = len(self.tokenizer)

    def encode_ordinary(self, text):
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids):
        return self.tokenizer.decode(ids)
