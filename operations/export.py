"""A trained model out to the library it equals, as a folder: cls or MAE for timm's
create_model (VisionTransformer weights, and its config: input size, mean, std, classes), next as
Hugging Face's GPT-2. What has no counterpart there (NeuTRENO, smooth/sharpen, mlm, CLS pooling) is
refused.

Run: python -m operations.export out/ckpt.pt --out vit/    (cls, mae: timm)
     python -m operations.export out/ckpt.pt --out gpt2/   (next: save_pretrained)
"""
import argparse
import base64
import json
import os
import sys
import tempfile
from functools import partial

import torch.nn as nn

from data import get_tokenizer
from operations.checkpoint import atomic_write, model_from_checkpoint
from operations.cli import RUN_FILES, one_line_errors
from operations.streaming import eval_crop

LAYER_NORM_EPS = 1e-5  # torch's default, which every LayerNorm of ours uses


def check_exportable(config):
    """One line for a model the libraries have no counterpart of."""
    if config.objective == "mlm":
        raise ValueError("an mlm model has no export here (its head is BERT's, its trunk GPT-2's "
                         "without the causal mask); export cls, mae or next models")
    if config.neutreno > 0:
        raise ValueError(f"this model uses NeuTRENO (lambda {config.neutreno}), which timm and "
                         "Hugging Face do not have; only softmax-attention models export")
    if config.vo_param != "free":
        raise ValueError(f"this model's W_V W_O is {config.vo_param}, which timm and Hugging Face "
                         "do not have; only vo_param free exports")
    if config.is_image and config.pool != "mean":
        raise ValueError("a CLS-token pool has no position in timm's layout here; only --pool "
                         "mean models export")


def timm_kwargs(config):
    """VisionTransformer's arguments for this model (besides norm_layer, see timm_model)."""
    return dict(img_size=config.image_size, patch_size=config.patch_size,
                in_chans=config.channels, embed_dim=config.width, depth=config.depth,
                num_heads=config.heads, mlp_ratio=config.mlp_ratio, class_token=False,
                global_pool="avg", fc_norm=config.objective == "cls",
                num_classes=config.num_classes if config.objective == "cls" else 0)


def timm_model(config):
    """timm's VisionTransformer of this model's shape, with our LayerNorm eps."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**timm_kwargs(config), norm_layer=partial(nn.LayerNorm,
                                                                       eps=LAYER_NORM_EPS))


def to_timm(model):
    """Our state dict in timm's names. The patch embedding is a linear map of patches in (p, p, C)
    order: timm's stride-p convolution holds the same numbers as (D, C, p, p). The fixed sin-cos
    positions become timm's pos_embed."""
    c, ours = model.config, model.state_dict()
    p, width = c.patch_size, c.width
    out = {"pos_embed": model.pos_embed.detach().clone(),
           "patch_embed.proj.weight": ours["patch_embed.weight"].view(width, p, p, c.channels)
           .permute(0, 3, 1, 2).contiguous(),
           "patch_embed.proj.bias": ours["patch_embed.bias"]}
    names = {"ln1": "norm1", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "ln2": "norm2",
             "mlp.fc": "mlp.fc1", "mlp.proj": "mlp.fc2"}
    pairs = [(f"blocks.{i}.{mine}", f"blocks.{i}.{theirs}") for i in range(c.depth)
             for mine, theirs in names.items()]
    last = {"fc_norm": "fc_norm", "head": "head"} if c.objective == "cls" else {"ln_f": "norm"}
    for mine, theirs in [*pairs, *last.items()]:
        for kind in ("weight", "bias"):
            out[f"{theirs}.{kind}"] = ours[f"{mine}.{kind}"]
    return out


def gpt2_config(config):
    """Hugging Face's GPT2Config of this model: exact GELU, our eps, no dropout, tied embeddings."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len,
                      n_embd=config.width, n_layer=config.depth, n_head=config.heads,
                      n_inner=int(config.mlp_ratio * config.width), activation_function="gelu",
                      layer_norm_epsilon=LAYER_NORM_EPS, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, tie_word_embeddings=True)


def to_gpt2(model):
    """Our state dict in GPT2LMHeadModel's names: its Conv1D layers hold our Linear weights
    transposed; [MASK]'s embedding row (never used by a next-token model) is left out."""
    c, ours = model.config, model.state_dict()
    out = {"transformer.wte.weight": ours["tok_embed.weight"][:c.vocab_size],
           "transformer.wpe.weight": ours["pos_embed"][0],
           "transformer.ln_f.weight": ours["ln_f.weight"],
           "transformer.ln_f.bias": ours["ln_f.bias"]}
    names = {"ln1": ("ln_1", False), "attn.qkv": ("attn.c_attn", True),
             "attn.proj": ("attn.c_proj", True), "ln2": ("ln_2", False),
             "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}
    for i in range(c.depth):
        for mine, (theirs, conv1d) in names.items():
            w = ours[f"blocks.{i}.{mine}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if conv1d else w
            out[f"transformer.h.{i}.{theirs}.bias"] = ours[f"blocks.{i}.{mine}.bias"]
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def exported_tokenizer(encoding):
    """The tokenizer a model trained with, for Hugging Face: an hf: one as it is; a tiktoken
    encoding through transformers' own converter (the same ids, its pattern and special tokens)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if hasattr(encoding, "tokenizer"):  # hf:NAME
        return encoding.tokenizer
    with tempfile.TemporaryDirectory() as folder:  # the converter reads tiktoken's file format
        ranks = os.path.join(folder, "ranks.tiktoken")
        with open(ranks, "w") as f:
            f.writelines(f"{base64.b64encode(token).decode()} {rank}\n"
                         for token, rank in encoding._mergeable_ranks.items())
        converted = TikTokenConverter(ranks, encoding._pat_str,
                                      extra_special_tokens=encoding._special_tokens).converted()
    if any(converted.token_to_id(t) != i for t, i in encoding._special_tokens.items()):
        raise ValueError("its special tokens' ids do not follow its ranks, as the converter needs")
    special = next(iter(encoding._special_tokens), None)  # GPT-2's <|endoftext|>
    return PreTrainedTokenizerFast(tokenizer_object=converted, unk_token=special,
                                   bos_token=special, eos_token=special)


def export(path, out):
    """Write the checkpoint at path as a folder its library loads: timm (cls, mae) or Hugging Face
    (next); returns the line that says how to load it."""
    model, ckpt = model_from_checkpoint(path)
    c = model.config
    check_exportable(c)
    library = "Hugging Face" if c.objective == "next" else "timm"
    if (os.path.exists(out) and not os.path.isdir(out)) or out.endswith(".safetensors"):
        raise ValueError(f"--out {out}: the export is a folder {library} loads; give --out a "
                         "folder's path (not a file's)")
    written = sorted(f for f in (os.listdir(out) if os.path.isdir(out) else ())
                     if f in ("config.json", "generation_config.json", *RUN_FILES)
                     or (f.startswith(("model", "pytorch_model"))
                         and f.endswith((".safetensors", ".bin")))
                     or f.endswith(".index.json"))
    if written:
        raise ValueError(f"--out {out} already holds a model ({', '.join(written)}); remove "
                         "it or export to another folder")
    if c.objective == "next":
        return export_gpt2(model, ckpt, out)
    from safetensors.torch import save

    os.makedirs(out, exist_ok=True)
    kwargs, statistics = timm_kwargs(c), ckpt.get("statistics")
    # beside the weights: the input and patch size, the pixel mean and std, the class names
    meta = {"input_size": [c.channels, c.image_size, c.image_size], "patch_size": c.patch_size,
            "classes": ckpt.get("classes"), "num_classes": kwargs["num_classes"]}
    if statistics is not None:
        meta.update(mean=statistics[0].flatten().tolist(), std=statistics[1].flatten().tolist())
    streamed = ckpt.get("train", {}).get("stream") == "on"  # else squashed whole to the input size
    tensors = save({k: v.contiguous() for k, v in to_timm(model).items()},
                   metadata={k: json.dumps(v) for k, v in meta.items()})
    atomic_write(os.path.join(out, "model.safetensors"), lambda f: f.write(tensors))
    config = {"architecture": "vit_base_patch16_224", "num_classes": kwargs["num_classes"],
              "model_args": kwargs,
              "pretrained_cfg": {**{k: meta[k] for k in ("input_size", "mean", "std") if k in meta},
                                 "label_names": meta["classes"],
                                 "interpolation": "bicubic", "fixed_input_size": True,
                                 **({"crop_pct": eval_crop(c.image_size), "crop_mode": "center"}
                                    if streamed else {"crop_pct": 1.0, "crop_mode": "squash"})}}
    atomic_write(os.path.join(out, "config.json"),
                 lambda f: f.write(json.dumps(config, indent=2).encode()))
    return (f"wrote {out}: timm.create_model('local-dir:{out}', pretrained=True) (timm's "
            f"LayerNorm eps, 1e-6; ours, exactly: VisionTransformer(**model_args, norm_layer="
            f"partial(nn.LayerNorm, eps={LAYER_NORM_EPS})))")


def export_gpt2(model, ckpt, out):
    """A next-token model as Hugging Face's GPT-2 folder, with its tokenizer where it has one."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(gpt2_config(model.config))
    hf.load_state_dict(to_gpt2(model))
    hf.save_pretrained(out)
    name = ckpt.get("train", {}).get("tokenizer", "gpt2")
    try:
        tokenizer = exported_tokenizer(get_tokenizer(name))
    except ValueError as e:  # offline, without the encoding's file
        return (f"wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({out!r}); "
                f"no tokenizer ({name}: {e}), so pass it token ids")
    tokenizer.save_pretrained(out)
    return (f"wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({out!r}), "
            f"transformers.AutoTokenizer.from_pretrained({out!r})")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Export a trained model to timm or Hugging Face.",
                                     allow_abbrev=False)
    parser.add_argument("checkpoint", help="a train.py checkpoint (ckpt.pt or best.pt)")
    parser.add_argument("--out", required=True, help="the folder to write (made if missing)")
    args = parser.parse_args(argv)
    with one_line_errors() as outcome:
        print(export(args.checkpoint, os.path.normpath(args.out)))
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
