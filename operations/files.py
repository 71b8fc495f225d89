"""Files on disk: image folders listed by torchvision's ImageFolder code and decoded once into a
cache; text tokenized once into a cache; CIFAR and WikiText downloaded, each failing offline with
one line (DataError). Nothing here imports the rest of the project but checkpoint's atomic writes.

Run: python -c "from operations import files; print(files.list_folder('DIR')[1])"
"""
import hashlib
import io
import os
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from operations.checkpoint import atomic_write


class DataError(ValueError):
    """A data problem the user can fix; its message is one line and says how."""


def read_rgb(path):
    """An image file as an RGB PIL image, as ImageFolder reads it; an unreadable one is one line."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    # PIL's errors for unreadable, truncated or non-image files, and for images over its size limit
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {path} ({type(e).__name__}: {str(e)[:160]}); remove "
                        f"or replace that file") from None


def fixed_order(n):
    """A fixed random order of n items: the same for every run."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))


def fixed_subset(n, limit):
    """Indices of a fixed random subset of `limit` out of n, in order: the same for every run."""
    return fixed_order(n)[:limit].sort().values


def as_batch(pixels):
    """(H, W, 3) uint8 arrays as one (N, 3, H, W) uint8 tensor."""
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous()


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
    if train and classes["train"] != classes["test"]:  # labels are class indices: one set for both
        only_train = sorted(set(classes["train"]) - set(classes["test"]))
        only_test = sorted(set(classes["test"]) - set(classes["train"]))
        raise DataError(f"{data_dir}: the splits have different classes (only in training: "
                        f"{only_train[:5]}, only in test: {only_test[:5]}); give both the same "
                        "class folders")
    if train and train_samples:
        files["train"] = [files["train"][i] for i in
                          fixed_subset(len(files["train"]), train_samples).tolist()]
    files["test"] = [files["test"][i] for i in fixed_order(len(files["test"])).tolist()]
    return files, classes["test"]


def _image_files(root):
    """torchvision's ImageFolder listing of root, sorted: ([(path, class index)], class names)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, index = find_classes(root)
        return make_dataset(root, index, extensions=IMG_EXTENSIONS), classes
    except OSError as e:  # no class folder, a class without images, an unreadable folder
        raise DataError(f"{root}: {e.strerror or e}; an image folder dataset needs "
                        f"{root}/<class>/<image>") from None


def _decode(path, size):
    from PIL import Image

    return np.asarray(read_rgb(path).resize((size, size), Image.BICUBIC))


def listing_fingerprint(samples):
    """A short sha1 of a split's (file, label) list, paths below their common folder (so a moved
    data_dir keeps it): a resume checks that the folder still lists the same files."""
    paths = [os.path.abspath(path) for path, _ in samples]
    root, key = os.path.commonpath(paths) if paths else "", hashlib.sha1()
    for path, (_, label) in zip(paths, samples):
        key.update(f"{os.path.relpath(path, root)}|{label}\n".encode())
    return key.hexdigest()[:16]


def decode_folder(files, size, cache_dir=None):
    """A folder split's images as one (N, 3, size, size) uint8 tensor, decoded once: with a
    cache_dir, later runs load the saved array, keyed by every file's identity, size and times, the
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
    """A file as a cache key sees it: which file (device, inode: the same through any link), its
    size and times, ctime too, which no edit can set back (nor keep, keeping size and mtime)."""
    s = os.stat(path)
    return f"{s.st_dev}|{s.st_ino}|{s.st_size}|{s.st_mtime_ns}|{s.st_ctime_ns}"


def folder_key(files, size):
    """The cache file's name for these files decoded at this size."""
    key = hashlib.sha1(f"{DECODING}|{size}".encode())
    for path, _ in files:
        key.update(f"{file_stamp(path)}\n".encode())
    return f"images.{len(files)}x{size}px.{key.hexdigest()[:16]}.npy"


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


def cifar(name, data_dir, train):
    """(uint8 images (N, 3, H, W), labels, class names) of a CIFAR split, via torchvision."""
    import torchvision

    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    try:  # a partial archive is checked (md5) and downloaded again next time
        ds = cls(data_dir, train=train, download=True)
    except Exception as e:  # URLError, socket timeouts, md5 mismatch, ...
        raise DataError(f"could not download {name} to {data_dir} ({type(e).__name__}: {e}); "
                        f"put {cls.base_folder}/ there by hand, or use --dataset folder "
                        "--data_dir DIR with an ImageFolder tree") from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W) uint8
    return images, torch.tensor(ds.targets), list(ds.classes)


WIKITEXT = {  # name -> (zip on the author's mirror, folder inside it)
    "wikitext2": ("https://wikitext.smerity.com/wikitext-2-raw-v1.zip", "wikitext-2-raw"),
    "wikitext103": ("https://wikitext.smerity.com/wikitext-103-raw-v1.zip", "wikitext-103-raw"),
}


def _fetch(url, timeout=30):
    agent = "Mozilla/5.0 (X11; Linux x86_64) bamboo"  # the mirror answers 403 to urllib's own
    request = urllib.request.Request(url, headers={"User-Agent": agent})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def download_wikitext(name, data_dir):
    """Fetch WikiText into data_dir/<folder>/{train,valid,test}.txt unless train.txt and valid.txt
    are there; the archive is read whole before any split is written, and no split is replaced."""
    url, folder = WIKITEXT[name]
    target = os.path.join(data_dir, folder)
    paths = {s: os.path.join(target, f"{s}.txt") for s in ("train", "valid", "test")}
    if os.path.exists(paths["train"]) and os.path.exists(paths["valid"]):
        return target
    try:
        archive = zipfile.ZipFile(io.BytesIO(_fetch(url)))
        texts = {s: archive.read(f"{folder}/wiki.{s}.raw") for s in paths}
    except Exception as e:  # network and HTTP errors, a damaged archive
        raise DataError(f"could not download {name} from {url} ({type(e).__name__}: {e}); put "
                        f"WikiText's wiki.train.raw and wiki.valid.raw at {paths['train']} and "
                        f"{paths['valid']}, or use --dataset text --data_dir DIR") from None
    os.makedirs(target, exist_ok=True)
    for split, text in texts.items():
        if not os.path.exists(paths[split]):
            atomic_write(paths[split], lambda f: f.write(text))
    return target
