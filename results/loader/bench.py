"""The streaming loader (streaming.ImageStream) against MAE's own (torchvision ImageFolder, MAE's
transforms, a DataLoader: facebookresearch/mae main_pretrain.py), reading the same folder in the
same process, turn about: images per second of the loader alone, and of a training step it feeds.

Run: python results/loader/bench.py --make /tmp/imagenet-like   (once: writes the folder)
     python results/loader/bench.py --data_dir /tmp/imagenet-like --out results/loader/bench.json
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bamboo import Bamboo, Config  # noqa: E402
from operations.files import list_folder  # noqa: E402
from operations.streaming import ImageStream  # noqa: E402


def make_folder(root, source, per_class, seed=0):
    """An ImageNet-layout tree of JPEGs at ImageNet's typical sizes (short side 300 to 500 px,
    aspect 3:4 to 4:3, quality 90): CIFAR-10's photos upscaled, with grain so the files carry
    about as many bytes per pixel as photographs do."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", max(1, per_class // 5))):
        for name in sorted(os.listdir(os.path.join(source, "train"))):
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
            files = sorted(os.listdir(os.path.join(source, "train", name)))[:n]
            for f in files:
                short, aspect = rng.integers(300, 501), rng.uniform(3 / 4, 4 / 3)
                size = (int(short * max(aspect, 1)), int(short / min(aspect, 1)))
                im = Image.open(os.path.join(source, "train", name, f)).convert("RGB")
                pixels = np.asarray(im.resize(size, Image.BICUBIC), dtype=np.float32)
                pixels += rng.normal(0, 6, pixels.shape)
                jpeg = os.path.join(root, split, name, os.path.splitext(f)[0] + ".jpg")
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(jpeg, quality=90)


def mae_loader(data_dir, batch, workers, size=224):
    """MAE's pre-training loader, as main_pretrain.py builds it."""
    import torchvision.datasets as datasets
    import torchvision.transforms as transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.2, 1.0), interpolation=3),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    dataset = datasets.ImageFolder(os.path.join(data_dir, "train"), transform=transform)
    return torch.utils.data.DataLoader(dataset, sampler=torch.utils.data.RandomSampler(dataset),
                                       batch_size=batch, num_workers=workers, drop_last=True)


def mae_batches(data_dir, batch, workers):
    while True:
        yield from mae_loader(data_dir, batch, workers)


def stream_batches(data_dir, batch, workers):
    stream = ImageStream(list_folder(data_dir), "cpu", 224, 0.2, workers)
    generator = torch.Generator().manual_seed(0)
    while True:
        yield stream.train_batch(stream.sample(batch, generator))


def images_per_second(batches, batch, count, step=None):
    """Batches after the first (workers starting; the step's first run) timed; with `step`, each
    one trains it."""
    x, _ = next(batches)
    if step:
        step(x)
    t0 = time.perf_counter()
    for _ in range(count):
        x, y = next(batches)
        if step:
            step(x)
    return batch * count / (time.perf_counter() - t0)


def training_step(batch_size):
    """A bamboo-b MAE step at 224 in bf16 on this CPU, the optimizer's step included."""
    model = Bamboo(Config.from_preset("bamboo-b-224", objective="mae"))
    optimizer = model.configure_optimizer(1.5e-4, 0.05, 0.95)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--make", default="")
    p.add_argument("--source", default="../shared/data/cifar10-jpeg")
    p.add_argument("--per_class", type=int, default=200)
    p.add_argument("--data_dir", default="")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step_batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.make:
        return make_folder(args.make, args.source, args.per_class)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "torch": torch.__version__, "batch": args.batch, "loader": {}, "step": {}}
    for workers in (1, 2) if args.batches else ():  # turn about, each round: ours, then MAE's
        for name, make in (("stream", stream_batches), ("mae", mae_batches)):
            result["loader"][f"{name}, {workers} workers"] = []
        for _ in range(args.rounds):
            for name, make in (("stream", stream_batches), ("mae", mae_batches)):
                rate = images_per_second(make(args.data_dir, args.batch, workers), args.batch,
                                         args.batches)
                result["loader"][f"{name}, {workers} workers"].append(rate)
                print(f"loader {name} {workers} workers: {rate:.1f} img/s", flush=True)
    step = training_step(args.step_batch)
    for name, make in (("stream", stream_batches), ("mae", mae_batches)) * args.rounds:
        rate = images_per_second(make(args.data_dir, args.step_batch, 1), args.step_batch,
                                 args.steps, step)
        result["step"].setdefault(f"{name}, 1 worker", []).append(rate)
        print(f"step {name}: {rate:.2f} img/s", flush=True)
    result["median"] = {kind: {k: statistics.median(v) for k, v in result[kind].items()}
                        for kind in ("loader", "step")}
    print(json.dumps(result["median"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
