"""Benchmark training steps of any configs side by side, on synthetic data, in one run.

Specs are OBJECTIVE:PRESET[,key=value,...], timed round-robin in one process so that every ratio
comes from one machine state (the fastest round counts, as with timeit). --against adds timm's ViT,
Hugging Face GPT-2 and BERT and vit-pytorch's MAE of the same shape (bench.py -h: every flag).

Run: python bench.py cls:base-12x768 cls:bamboo-b --batch_size 8
     python bench.py cls:cifar-small --dtype float32,bfloat16 --compile off,blocks
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from bamboo import Bamboo, Config, training_flops
from operations import export, fast
from operations.checkpoint import atomic_write
from operations.cli import check_output_path, config_from_spec, one_line_errors
from operations.fast import pick_device, pick_dtype

LEARNING_RATE = 1e-4  # any finite rate: the step's time does not depend on it
WARM_S = 2.0  # untimed steps for at least this long before the rounds (results/bench/)


def parse_spec(spec):
    objective, sep, rest = spec.partition(":")
    if not sep:
        raise ValueError(f"bad spec {spec!r}; write OBJECTIVE:PRESET, e.g. cls:bamboo-b,depth=6")
    config = config_from_spec(rest, objective=objective)
    if config.objective != objective:  # a row is labelled by its prefix
        raise ValueError(f"spec {spec!r} says objective {config.objective} after its prefix "
                         f"{objective}; drop objective=")
    return config


def synthetic_batch(config, batch_size, device, generator, extra_token=False):
    """Random images and labels, or random tokens, with the config's shapes (extra_token: windows
    of seq_len + 1 tokens, as train.py reads a next-token run's text)."""
    if config.is_image:
        x = torch.randn(batch_size, config.channels, config.image_size, config.image_size,
                        generator=generator)
        y = torch.randint(0, config.num_classes, (batch_size,), generator=generator)
        return x.to(device), y.to(device)
    return torch.randint(0, config.vocab_size, (batch_size, config.seq_len + extra_token),
                         generator=generator).to(device), None


def timm_vit(c):
    model = export.timm_model(c)  # the VisionTransformer our export loads into
    return "timm VisionTransformer", model, lambda m, x, y: F.cross_entropy(m(x), y)


def hf_gpt2(c):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(export.gpt2_config(c))  # the one our export writes
    return "HF GPT2LMHeadModel", model, lambda m, x, y: m(input_ids=x, labels=x).loss


def hf_bert(c):
    from transformers import BertConfig, BertForMaskedLM

    hf = BertConfig(vocab_size=c.vocab_size + 1, hidden_size=c.width, num_hidden_layers=c.depth,
                    num_attention_heads=c.heads, intermediate_size=int(c.mlp_ratio * c.width),
                    max_position_embeddings=c.seq_len, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    masker = Bamboo(Config(objective="mlm", depth=1, width=8, heads=1, vocab_size=c.vocab_size,
                           seq_len=c.seq_len))

    def bert_loss(m, x, y):
        inputs, targets = masker.mask_tokens(x)  # the same 80/10/10 corruption as ours
        return m(input_ids=inputs, labels=targets).loss

    return "HF BertForMaskedLM", BertForMaskedLM(hf), bert_loss


def vit_pytorch_mae(c):
    from vit_pytorch import MAE, ViT

    # Its MAE breaks with pool="cls" (vit-pytorch 1.26); ours pools by mean too.
    encoder = ViT(image_size=c.image_size, patch_size=c.patch_size, num_classes=c.num_classes,
                  dim=c.width, depth=c.depth, heads=c.heads, mlp_dim=int(c.mlp_ratio * c.width),
                  dim_head=c.width // c.heads, pool="mean")
    model = MAE(encoder=encoder, masking_ratio=c.mask_ratio, decoder_dim=c.decoder_width,
                decoder_depth=c.decoder_depth, decoder_heads=c.decoder_heads,
                decoder_dim_head=c.decoder_width // c.decoder_heads)
    return "vit-pytorch MAE", model, lambda m, x, y: m(x)


class Runner:
    """One model, its optimizer and a fixed synthetic batch; step() is one full training step."""

    def __init__(self, config, args, device, dtype, compile_mode, reference=False,
                 attention="auto"):
        torch.manual_seed(0)
        self.config, self.device = config, device
        if reference:  # the usual library model of the same shape, compiled whole as users would
            builders = {"cls": timm_vit, "next": hf_gpt2, "mlm": hf_bert, "mae": vit_pytorch_mae}
            self.name, model, self.loss_fn = builders[config.objective](config)
            self.model = model.to(device).train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE,
                                               fused=device.type in ("cuda", "cpu"))
            plan, _ = fast.compile_plan(compile_mode, device, config, ddp=False)
            kwargs = {"mode": "reduce-overhead"} if plan == "graphs" else {}
            self.forward = torch.compile(self.model, **kwargs) if plan != "off" else self.model
            self.compiled = "model" if plan == "blocks" else plan  # what ran: the whole model
            self.attention = "library"
        else:  # exactly as train.py does
            explicit = fast.use_explicit_attention(attention, device, dtype, config)
            self.model = Bamboo(config, explicit_attention=explicit).to(device).train()
            self.name, self.loss_fn = "bamboo", lambda m, x, y: m(x, y)[1]
            self.optimizer = self.model.configure_optimizer(LEARNING_RATE, weight_decay=0.05,
                                                            beta2=0.95)
            self.forward, self.compiled, _ = fast.for_training(self.model, device, dtype,
                                                               compile_mode)
            self.attention = "explicit" if explicit else "sdpa"
        self.batch = synthetic_batch(config, args.batch_size, device,
                                     torch.Generator().manual_seed(0),
                                     extra_token=config.objective == "next" and not reference)
        self.autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32,
                                       cache_enabled=self.compiled != "graphs")
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step(self):
        if self.compiled == "graphs" and self.name != "bamboo":  # under mode="reduce-overhead"
            torch.compiler.cudagraph_mark_step_begin()
        with self.autocast:
            loss = self.loss_fn(self.forward, *self.batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def fastest_ms(calls, rounds, reps, sync=lambda: None):
    """Round-robin over named callables, so drift in machine speed hits each alike; per name, the
    fastest round's ms per call (as timeit: on a shared machine, noise only ever adds time)."""
    best, start = {name: float("inf") for name in calls}, time.perf_counter()
    for done in range(rounds):
        if done:  # never silent for long
            print(f"round {done} of {rounds} timed, {time.perf_counter() - start:.0f} s",
                  flush=True)
        for name, call in calls.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps * 1000)
    return best


def device_sync(device):
    """A call that waits for the device's queued work (CUDA runs asynchronously)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def build_runners(args, device):
    """One Runner per spec x dtype x compile mode x attention (x bamboo / reference: once, attention
    being the library's own), warmed up; the first step timed apart."""
    dtypes = [pick_dtype(name, device) for name in args.dtype.split(",")]
    attentions, modes = args.attention.split(","), args.compile.split(",")
    # a library compiles whole (blocks: as model); on a CPU auto times it eager and compiled
    library = dict.fromkeys(m for mode in modes for m in (
        ("off", "model") if mode == "auto" and device.type == "cpu" else
        ("model" if mode == "blocks" else mode,)))
    entries = [(spec, dtype, mode, reference, attention) for spec in args.specs for dtype in dtypes
               for reference in ((False, True) if args.against else (False,))
               for mode in (library if reference else modes)
               for attention in (attentions[:1] if reference else attentions)]
    runners = [Runner(parse_spec(entry[0]), args, device, *entry[1:]) for entry in entries]
    sync = device_sync(device)
    for (spec, dtype, *_), runner in zip(entries, runners):  # warm-up: allocator, compile, ...
        print(f"first step of {spec} ({runner.name}, {str(dtype).replace('torch.', '')}, "
              f"{runner.compiled}): ", end="", flush=True)  # said before a long compilation
        t0 = time.perf_counter()
        runner.step()
        sync()  # the first step's kernels too, not only their compilation and launch
        runner.first_step_s = time.perf_counter() - t0  # compilation shows up here
        print(f"{runner.first_step_s:.1f} s", flush=True)
        for _ in range(args.warmup - 1):
            runner.step()
    warm_until = time.perf_counter() + WARM_S  # a machine settles in its first seconds of work
    while time.perf_counter() < warm_until:
        for runner in runners:
            runner.step()
    return entries, runners, {dtype: fast.peak_tflops(device, dtype) for dtype in dtypes}


def peak_memory(device, runner):
    """Peak MiB of one step: CUDA's max allocated; None where torch counts none."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    runner.step()
    return torch.cuda.max_memory_allocated(device) / 2 ** 20


def print_table(args, device, entries, runners, step_ms, memory, peaks):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    for dtype, peak in peaks.items():  # a GPU in fast.PEAK_BF16_TFLOPS, or no MFU
        print(f"peak {str(dtype).replace('torch.', '')}: {peak:.3g} TFLOP/s ({name}, table peak)"
              if peak else f"peak: {name} (peak unknown: no MFU)")
    print(f"device {device}, batch {args.batch_size}, {args.rounds} rounds x {args.steps} "
          f"steps (fastest round), {torch.get_num_threads()} threads")
    header = (f"{'config':<34} {'impl':<22} {'dtype':<8} {'cmp':<6} {'attn':<8} {'params':>8} "
              f"{'step ms':>9} {'samples/s':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU %':>6} "
              f"{'peak MiB':>9} {'1st s':>6} {'vs first':>8}")
    print(header, "-" * len(header), sep="\n")
    rows = []
    for i, ((spec, dtype, *_), runner, mem) in enumerate(zip(entries, runners, memory)):
        c, step, peak = runner.config, step_ms[i] / 1000, peaks[dtype]
        tokens = c.num_patches() if c.is_image else c.seq_len
        tflops = training_flops(c) * args.batch_size / step / 1e12
        params = sum(p.numel() for p in runner.model.parameters()) / 1e6
        rows.append({"spec": spec, "impl": runner.name, "dtype": str(dtype).replace("torch.", ""),
                     "compiled": runner.compiled, "attention": runner.attention,
                     "step_ms": step * 1000, "samples_s": args.batch_size / step,
                     "tokens_s": args.batch_size * tokens / step, "tflops": tflops,
                     "mfu": 100 * tflops / peak if peak else None, "peak_mib": mem,
                     "params_m": params, "first_step_s": runner.first_step_s})
        r = rows[-1]
        print(f"{spec:<34} {r['impl']:<22} {r['dtype']:<8} {r['compiled']:<6} {r['attention']:<8} "
              f"{params:>7.2f}M {step * 1000:>9.1f} {r['samples_s']:>10.1f} {r['tokens_s']:>10.0f} "
              f"{tflops:>8.3f} {r['mfu'] or float('nan'):>6.1f} {mem or float('nan'):>9.0f} "
              f"{runner.first_step_s:>6.1f} {rows[0]['step_ms'] / r['step_ms']:>7.2f}x")
    for spec, dtype in dict.fromkeys((r["spec"], r["dtype"]) for r in rows) if args.against else ():
        ours, theirs = (min((r for r in rows if (r["spec"], r["dtype"]) == (spec, dtype)
                             and (r["impl"] == "bamboo") == mine), key=lambda r: r["step_ms"])
                        for mine in (True, False))  # each at its fastest
        print(f"{spec} {dtype}: bamboo ({ours['compiled']}) "
              f"{theirs['step_ms'] / ours['step_ms']:.2f}x as fast as {theirs['impl']} at its "
              f"fastest ({theirs['compiled']})")
    return rows


def run(args):
    device = pick_device(args.device, 0)
    if args.threads:
        torch.set_num_threads(args.threads)
    entries, runners, peaks = build_runners(args, device)
    step_ms = fastest_ms({i: runner.step for i, runner in enumerate(runners)}, args.rounds,
                         args.steps, device_sync(device))
    memory = [peak_memory(device, runner) for runner in runners]
    rows = print_table(args, device, entries, runners, step_ms, memory, peaks)
    if args.profile:
        for row, runner in zip(rows, runners):
            profile_step(runner, f"{row['spec']} ({row['impl']}, {row['dtype']})", args.profile)
    if args.json:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else fast.cpu_model()
        report = {"device": name or device.type, "torch": torch.__version__,
                  "batch_size": args.batch_size, "rows": rows}
        atomic_write(args.json, lambda f: f.write(json.dumps(report, indent=1).encode()))
    return rows


def profile_step(runner, title, rows):
    """torch.profiler on one training step: the operators that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        runner.step()
        device_sync(runner.device)()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\nprofile of one step: {title}")
    print(prof.key_averages().table(sort_by=sort, row_limit=rows))


def build_parser():
    p = argparse.ArgumentParser(description="Benchmark training steps of bamboo configs.",
                                allow_abbrev=False, epilog="--dtype (autocast), --compile "
                                "(operations/fast.py), --attention: a comma list compares each")
    add = p.add_argument
    add("specs", nargs="+", help="OBJECTIVE:PRESET[,key=value,...], e.g. cls:bamboo-b,neutreno=0.6")
    add("--batch_size", type=int, default=8, help="samples per step (default: 8)")
    add("--steps", type=int, default=2, help="timed steps per round (default: 2)")
    add("--rounds", type=int, default=5, help="round-robin rounds; the fastest counts (default: 5)")
    add("--warmup", type=int, default=2, help="untimed steps, the first timed apart (default: 2)")
    add("--device", default="auto", help="auto picks cuda, then mps, then cpu (default: auto)")
    add("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    add("--compile", default="auto", help="auto, off, model, blocks or graphs (default: auto)")
    add("--attention", default="auto", help="auto, sdpa or explicit (default: auto)")
    add("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    add("--against", action="store_true", help="also time timm / HF / vit-pytorch equivalents")
    add("--profile", type=int, default=0, metavar="N", help="N slowest operators (default: 0)")
    add("--json", default="", help="also write the table's rows here, with the device's name")
    return p


def check_args(args):
    """Raise ValueError for the first bad argument, before any model is built or timed."""
    if min(args.batch_size, args.steps, args.rounds, args.warmup) < 1:
        raise ValueError("--batch_size, --steps, --rounds and --warmup must be at least 1")
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads} must be at least 1, or 0 for torch's choice")
    for spec in args.specs:
        parse_spec(spec)
    for flag, names, known in (("--dtype", args.dtype, fast.DTYPES),
                               ("--compile", args.compile, fast.COMPILE_MODES),
                               ("--attention", args.attention, fast.ATTENTION_CHOICES)):
        for name in names.split(","):
            if name not in known:
                raise ValueError(f"unknown {flag} {name!r}; use {', '.join(known)}")
    if args.json:
        check_output_path("--json", args.json)


def main(argv=None):
    args = build_parser().parse_args(argv)
    with one_line_errors() as outcome:
        check_args(args)
        run(args)
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
