"""What a user with internet downloads: CIFAR, WikiText's text and Hugging Face tokenizers.

data.py calls these only when a dataset or tokenizer is asked for and absent; without the
network each fails with one line (DataError) that says what to put where instead.
"""
import io
import os
import urllib.request
import zipfile

import torch

from checkpoint import atomic_write
from data import DataError

# the WikiText mirror answers 403 to urllib's default
USER_AGENT = "Mozilla/5.0 (X11; Linux x86_64) bamboo"
WIKITEXT = {  # name -> (zip on the author's mirror, folder inside it, Hugging Face config)
    "wikitext2": ("https://wikitext.smerity.com/wikitext-2-raw-v1.zip", "wikitext-2-raw",
                  "wikitext-2-raw-v1"),
    "wikitext103": ("https://wikitext.smerity.com/wikitext-103-raw-v1.zip", "wikitext-103-raw",
                    "wikitext-103-raw-v1"),
}
HF_PARQUET = ("https://huggingface.co/datasets/Salesforce/wikitext/resolve/main/"
              "{config}/{split}-{i:05d}-of-{n:05d}.parquet")
# parquet files per split on the hub; 1 where not listed
HF_SHARDS = {"wikitext-103-raw-v1": {"train": 2}}


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


def _from_mirror(url, folder, target):
    """The author's zip: checked (CRC and expected members) before anything is written."""
    archive = zipfile.ZipFile(io.BytesIO(_fetch(url)))
    if archive.testzip() is not None:
        raise OSError("corrupt zip")
    for split in ("train", "valid", "test"):
        text = archive.read(f"{folder}/wiki.{split}.raw")
        if len(text) < 100_000:
            raise OSError(f"wiki.{split}.raw is only {len(text)} bytes")
        atomic_write(os.path.join(target, f"{split}.txt"), lambda f: f.write(text))


def _from_hugging_face(config, target):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OSError("the Hugging Face fallback needs pyarrow (pip install pyarrow)") from None
    for split, name in (("train", "train"), ("valid", "validation"), ("test", "test")):
        n = HF_SHARDS.get(config, {}).get(name, 1)
        rows = []
        for i in range(n):
            table = pq.read_table(io.BytesIO(_fetch(HF_PARQUET.format(config=config, split=name,
                                                                      i=i, n=n))))
            rows += table.column("text").to_pylist()
        atomic_write(os.path.join(target, f"{split}.txt"),
                     lambda f: f.write("".join(rows).encode()))


def download_wikitext(name, data_dir):
    """Fetch WikiText into data_dir/<folder>/{train,valid,test}.txt unless train.txt and valid.txt
    are there."""
    url, folder, hf_config = WIKITEXT[name]
    target = os.path.join(data_dir, folder)
    if all(os.path.exists(os.path.join(target, f"{s}.txt")) for s in ("train", "valid")):
        return target
    os.makedirs(target, exist_ok=True)
    ours = [os.path.join(target, f"{s}.txt") for s in ("train", "valid", "test")]
    ours = [path for path in ours if not os.path.exists(path)]  # only what this call may write
    errors = []
    for source, fetch in ((url, lambda: _from_mirror(url, folder, target)),
                          ("huggingface.co", lambda: _from_hugging_face(hf_config, target))):
        try:
            fetch()
            return target
        except Exception as e:  # network errors, HTTP errors, corrupt archives
            errors.append(f"{source}: {type(e).__name__}: {e}")
    # nothing half-done survives a failed download; files that were there before stay
    for leftover in ours:
        if os.path.exists(leftover):
            os.remove(leftover)
    raise DataError(f"could not download {name} ({'; '.join(errors)}); put "
                    f"{os.path.join(target, 'train.txt')} "
                    f"and {os.path.join(target, 'valid.txt')} there by hand (WikiText's "
                    f"wiki.train.raw and "
                    "wiki.valid.raw), or use --dataset text --data_dir DIR with your own files")


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer (hub name or folder) with the part of tiktoken's Encoding that
    this project calls: name, n_vocab, encode_ordinary (no special tokens added) and decode."""

    def __init__(self, name):
        try:
            import transformers
        except ImportError:
            raise DataError(f"--tokenizer hf:{name} needs transformers; pip install "
                            "transformers") from None
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
