"""timm and Hugging Face transformers as probe.py sees a Bamboo: the papers' figures on real models.

A spec `timm:NAME[,key=value,...]` or `hf:NAME[,key=value,...]` builds the model (pretrained=0:
random weights from the configuration, no network; for Hugging Face, NAME may then be a model type
such as gpt2, bert, opt, vit or vit_mae, the other keys its configuration's fields; ViT-MAE is run
unmasked unless the probe's --mask asks for its masking). Foreign wraps it with what
the probe reads: a config (depth, is_image, image_size, seq_len, vocab_size); the blocks, each with
its W_Q, W_K, W_V, W_O per head from the library's own weight layout (timm's fused qkv, GPT-2's
transposed Conv1D, separate projections elsewhere) and its attention LayerNorm's gain; and
hidden_states: the first block's input and every block's output, taken with hooks on the block list
(a library's own hidden states can differ: GPT-2's last one has the final norm applied). Attention
probabilities are computed again from each block's input and its Q and K projections, since fused
kernels return none; a test checks them against the libraries' explicit attention.

Hugging Face tokenizers (hf:NAME) stand in for tiktoken's Encoding where a run or the probe asks.

Run: python probe.py timm:vit_base_patch16_224,pretrained=0 --dataset folder --data_dir DIR
"""
import os
import pickle
import socket
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from neutreno import Attention, attention_probabilities
from operations import cli
from operations.files import DataError

FAMILIES = ("vit (timm)", "gpt2", "bert", "opt", "vit and vit_mae (Hugging Face)")


def parse(spec):
    """(library, name, settings) of 'timm:NAME,key=value,...'; values are int, float, a bool
    (true, false, yes, no in any case: never a text that reads as True) or text."""
    library, _, rest = spec.partition(":")
    name, settings = cli.split_spec(rest)
    for key, value in settings.items():
        if value.lower() in cli.BOOLEANS and not value.isdigit():
            settings[key] = cli.BOOLEANS[value.lower()]
            continue
        for kind in (int, float):
            try:
                settings[key] = kind(value)
                break
            except ValueError:
                pass
    return library, name, settings


def load(spec):
    """A Foreign model in eval mode for a timm: or hf: spec; one line for what cannot be had."""
    library, name, settings = parse(spec)
    pretrained = bool(settings.pop("pretrained", 1))
    offline = pretrained and hub_unreachable()
    torch.manual_seed(0)  # random weights (pretrained=0) alike in every run, as init: specs are
    try:
        if library == "timm":
            model = timm_model(name, pretrained, settings)
            cfg = model.pretrained_cfg
            return Foreign(model.eval(), spec, statistics=(cfg["mean"], cfg["std"]))
        model = hf_model(name, pretrained, settings)
        statistics = hf_image_statistics(name) if pretrained and is_image(model.config) else None
        return Foreign(model.eval(), spec, statistics, hf_tokenizer(model.config, name, pretrained))
    except ImportError as e:
        raise ValueError(f"{spec} needs {e.name}; pip install timm transformers") from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused it: no code ran
        raise ValueError(f"{spec}: its weights are a pickle with more than tensors, which is not "
                         "loaded (it could run code); use safetensors or plain tensor weights") \
            from None
    except RuntimeError as e:  # timm's checkpoint_path: a refused pickle, or another model's
        if "checkpoint_path" not in settings:
            raise
        raise ValueError(f"{spec}: could not load its checkpoint_path "
                         f"({' '.join(str(e).split())[:160]}); give this model's weights as plain "
                         "tensors") from None
    except OSError as e:  # offline, or a name the hub does not know
        advice = "check the name and the network, or pass pretrained=0" if pretrained else (
            f"with pretrained=0 the name must be a model type ({', '.join(FAMILIES)})")
        if offline:
            advice = ("huggingface.co cannot be reached and the weights are not in the local "
                      "cache (~/.cache/huggingface): connect once, or pass pretrained=0")
        what = "the weights" if pretrained else "its configuration"
        raise ValueError(f"{spec}: could not load {what} ({str(e).splitlines()[0][:120]}); "
                         f"{advice}") from None


def hub_unreachable(timeout=3):
    """Whether huggingface.co cannot be reached; if so, the hub's own offline switch is set, so
    a model missing from the local cache fails in seconds, not after half a minute of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return True
    if any(os.environ.get(v) for v in ("HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return False  # a mirror or a proxy: only the hub's own requests can tell
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # already imported: its constant is what the hub reads
            constants.HF_HUB_OFFLINE = True
        return True


def timm_model(name, pretrained, settings):
    import timm

    if name not in timm.list_models(pretrained=False) and not timm.is_model(name.split(".")[0]):
        raise ValueError(f"timm knows no model {name!r}; timm.list_models('*vit*') lists them")
    try:
        return timm.create_model(name, pretrained=pretrained, **settings)
    except TypeError as e:  # a key the model does not take, or a value of the wrong type
        raise ValueError(f"timm's {name} refuses the settings {settings} "
                         f"({str(e).splitlines()[0][:120]}); give its constructor's arguments, "
                         "e.g. depth=6,embed_dim=192,num_heads=3") from None


def hf_model(name, pretrained, settings):
    import transformers

    if pretrained:
        return transformers.AutoModel.from_pretrained(name, attn_implementation="eager", **settings)
    try:
        default = transformers.AutoConfig.for_model(name)
    except ValueError:  # not a model type: a hub name, whose configuration needs the network
        default = transformers.AutoConfig.from_pretrained(name)
    known = default.to_dict()  # the keys this family takes, with their default values
    for key, value in settings.items():
        if key not in known:
            raise ValueError(f"{name} takes no setting {key!r}; it takes: "
                             f"{', '.join(sorted(known))}")
        kind = type(known[key])
        if kind is bool and value not in (0, 1):  # True and False are 1 and 0
            raise ValueError(f"{name}'s {key} takes true or false, not {value!r}")
        if kind is not bool and isinstance(value, bool):
            raise ValueError(f"{name}'s {key} is not true or false (its default: {known[key]!r})")
        if kind in (int, float) and not isinstance(value, (int, float)):
            raise ValueError(f"{name}'s {key} takes a number, not {value!r}")
        if kind in (bool, float):
            settings[key] = kind(value)  # 1 where a float or a bool is due
    config = type(default).from_dict({**known, **settings})
    config._attn_implementation = "eager"
    return transformers.AutoModel.from_config(config)


def hf_image_statistics(name):
    """The mean and std a pretrained Hugging Face image model was trained with (its processor)."""
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(name)
    return processor.image_mean, processor.image_std


def hf_tokenizer(config, name, pretrained):
    """The --tokenizer a Hugging Face text model reads: tiktoken's r50k_base for GPT-2 (its BPE in
    one cached file), the hub's tokenizer (hf:NAME) for other pretrained models; none for random
    weights of another family, whose user chooses one."""
    if is_image(config):
        return None
    if config.model_type == "gpt2" and config.vocab_size == 50257:
        return "r50k_base"
    return f"hf:{name}" if pretrained else None


def is_image(config):
    return config is None or hasattr(config, "image_size")


# ----------------------------------------------------------------------------- the block layouts

def linear(module):
    """(W (out, in), b (out,)) of an nn.Linear, or of a GPT-2 Conv1D (which stores W transposed)."""
    weight = module.weight if isinstance(module, torch.nn.Linear) else module.weight.T
    bias = module.bias if module.bias is not None else weight.new_zeros(weight.shape[0])
    return weight, bias


def block_layout(model, block):
    """What the probe needs of one block: q, k, v, o as (W, b) in nn.Linear's convention, the norm
    before attention (None where the block is post-norm) and the output's per-channel scale."""
    kind = type(block).__name__
    if hasattr(block, "attn") and hasattr(block.attn, "qkv"):  # timm's ViT (and bamboo's Block)
        from timm.models.vision_transformer import Attention as TimmAttention  # in every timm

        if not isinstance(block.attn, (TimmAttention, Attention)):  # biases of its own, relative
            raise ValueError(f"{kind}'s attention ({type(block.attn).__module__}) is more than "
                             "softmax(q k^T) (relative positions, rotary embeddings, biases of "
                             "its own), which the probe recomputes; probe a model with timm's "
                             "plain Attention, such as vit_base_patch16_224 or deit_*")
        normed = [n for n in ("q_norm", "k_norm", "norm") if not isinstance(
            getattr(block.attn, n, None), (type(None), nn.Identity))]
        if normed:  # the maps would be plain softmax(q k^T); W_O would follow a norm
            raise ValueError(f"{kind} normalises inside attention ({', '.join(normed)}), which "
                             "the probe's attention maps (q_norm, k_norm) and W_V W_O (norm) do "
                             "not; probe a model without qk_norm or scale_norm")
        w, b = linear(block.attn.qkv)  # rows: W_Q, W_K, W_V, each head's rows together
        q, k, v = zip(w.chunk(3), b.chunk(3))
        scale = getattr(getattr(block, "ls1", None), "gamma", None)  # LayerScale, if there is one
        norm = getattr(block, "norm1", None) or block.ln1
        return dict(q=q, k=k, v=v, o=linear(block.attn.proj), norm=norm, out_scale=scale)
    if kind == "GPT2Block":
        c = model.config
        if c.scale_attn_by_inverse_layer_idx or not c.scale_attn_weights:
            raise ValueError("this GPT-2 scales its attention otherwise than by 1/sqrt(head size) "
                             "(scale_attn_by_inverse_layer_idx, scale_attn_weights), which the "
                             "probe's attention maps do not; probe a GPT-2 with the defaults")
        w, b = linear(block.attn.c_attn)
        q, k, v = zip(w.chunk(3), b.chunk(3))
        return dict(q=q, k=k, v=v, o=linear(block.attn.c_proj), norm=block.ln_1, out_scale=None)
    if kind == "BertLayer":
        s = block.attention.self
        return dict(q=linear(s.query), k=linear(s.key), v=linear(s.value),
                    o=linear(block.attention.output.dense), norm=None, out_scale=None)
    if kind == "OPTDecoderLayer":
        s = block.self_attn
        norm = block.self_attn_layer_norm if model.config.do_layer_norm_before else None
        return dict(q=linear(s.q_proj), k=linear(s.k_proj), v=linear(s.v_proj),
                    o=linear(s.out_proj), norm=norm, out_scale=None)
    if kind in ("ViTLayer", "ViTMAELayer"):  # pre-norm; projections named q_proj or query
        a = block.attention
        if hasattr(a, "q_proj"):  # transformers 5
            q, k, v, o = a.q_proj, a.k_proj, a.v_proj, a.o_proj
        else:
            q, k, v, o = a.attention.query, a.attention.key, a.attention.value, a.output.dense
        return dict(q=linear(q), k=linear(k), v=linear(v), o=linear(o),
                    norm=block.layernorm_before, out_scale=None)
    raise ValueError(f"no adapter for blocks of type {kind}; the probe knows {', '.join(FAMILIES)}")


def block_list(model):
    """The model's list of transformer blocks, wherever the library keeps it."""
    paths = ("blocks", "transformer.h", "h", "layers", "encoder.layer", "decoder.layers",
             "model.decoder.layers")
    for path in paths:
        holder = model
        for part in path.split("."):
            holder = getattr(holder, part, None)
        if isinstance(holder, (torch.nn.ModuleList, torch.nn.Sequential)) and len(holder):
            return holder
    raise ValueError(f"{type(model).__name__} has no block list the probe can find")


class ForeignBlock:
    """One block as probe.py reads it: attn.weights() and ln1.weight."""

    def __init__(self, layout, heads):
        self.layout, self.heads = layout, heads
        self.attn = SimpleNamespace(weights=self.weights)
        norm = layout["norm"]
        self.ln1 = SimpleNamespace(weight=None if norm is None else norm.weight)

    def weights(self):
        """W_Q, W_K (D, D) and per head W_V (nh, D, hs), W_O (nh, hs, D), all acting as x @ W."""
        (wq, _), (wk, _), (wv, _), (wo, _) = (self.layout[n] for n in "qkvo")
        wo = wo if self.layout["out_scale"] is None else self.layout["out_scale"][:, None] * wo
        D, nh = wo.shape[0], self.heads
        return {"q": wq.detach().T, "k": wk.detach().T,
                "v": wv.detach().T.reshape(D, nh, D // nh).transpose(0, 1),
                "o": wo.detach().T.reshape(nh, D // nh, D)}


class Foreign:
    """A timm or Hugging Face transformer with the interface probe.py reads of a Bamboo model."""

    def __init__(self, model, spec, statistics=None, tokenizer=None):
        """statistics: the (mean, std) an image model expects (default 0.5, 0.5); tokenizer: the
        --tokenizer a text model reads by default (None: the user must choose)."""
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        self.statistics = statistics or ((0.5,) * 3, (0.5,) * 3)
        config = getattr(model, "config", None)
        self.is_image = getattr(config, "is_image", is_image(config))
        self.is_mae = getattr(config, "model_type", "") == "vit_mae"  # masks unless told not to
        self.causal = (type(model).__name__.startswith(("GPT2", "OPT"))
                       or getattr(config, "objective", None) == "next")
        blocks = block_list(model)
        self.heads = heads_of(model, config)
        self.blocks = [ForeignBlock(block_layout(model, b), self.heads) for b in blocks]
        self.block_modules = blocks
        timm_size = getattr(getattr(model, "patch_embed", None), "img_size", None)
        size = timm_size[0] if timm_size else getattr(config, "image_size", 224)
        seq_len = (getattr(config, "n_positions", None) or getattr(config, "seq_len", None)
                   or getattr(config, "max_position_embeddings", 512))
        patches = (size // getattr(config, "patch_size", 1)) ** 2
        self.config = SimpleNamespace(
            depth=len(blocks), is_image=self.is_image, objective="cls" if self.is_image else "next",
            image_size=size, seq_len=seq_len, vocab_size=getattr(config, "vocab_size", 0),
            mask_ratio=config.mask_ratio if self.is_mae else 0.0, num_patches=lambda: patches)
        post_norm = any(b["norm"] is None for b in (blk.layout for blk in self.blocks))
        why = ("post-norm blocks: the LayerNorm after the residual sum, not the eigenvalues of "
               "W_V W_O, decides the sign of the update")
        self.absent = {"vo_dominant": why, "vo_positive": why} if post_norm else {}

    def eval(self):
        return self

    def to(self, device):
        self.model.to(device)
        return self

    def parameters(self):
        return self.model.parameters()

    def normalize(self, pixels):
        """Images in [0, 1] normalised as the model expects (timm's data configuration, the Hugging
        Face processor's mean and std)."""
        mean, std = (torch.tensor(s, dtype=torch.float32).view(1, -1, 1, 1)
                     for s in self.statistics)
        return (pixels - mean) / std

    @torch.no_grad()
    def hidden_states(self, x, need_weights=False, mask_ratio=0.0, noise=None):
        """The first block's input and every block's output, and each block's attention
        probabilities computed again from its input (need_weights)."""
        inputs, outputs = [], []

        def keep(module, args, out):  # returns None: the block's output goes on unchanged
            inputs.append(args[0])
            outputs.append(out[0] if isinstance(out, (tuple, list)) else out)

        hooks = [b.register_forward_hook(keep) for b in self.block_modules]  # the library's own
        try:
            if hasattr(self.model, "forward_features"):  # timm: the trunk without the head
                self.model.forward_features(x)
            elif hasattr(self.model.config, "objective"):  # bamboo's own model, seen from outside
                self.model(x, x if self.causal else None)  # next: every token in, as targets too
            elif self.is_mae:  # every patch in order unless masked (noise: which are kept)
                before, self.model.config.mask_ratio = self.model.config.mask_ratio, mask_ratio
                try:
                    self.model(pixel_values=x, noise=noise if mask_ratio else
                               torch.arange(self.config.num_patches(), device=x.device)
                               .float().expand(len(x), -1))
                finally:  # the model's own setting, as it was
                    self.model.config.mask_ratio = before
            else:
                self.model(**{"pixel_values" if self.is_image else "input_ids": x})
        finally:
            for hook in hooks:
                hook.remove()
        hiddens = [inputs[0]] + outputs
        if not need_weights:
            return hiddens
        return hiddens, [self.attention(block.layout, h) for block, h in zip(self.blocks, inputs)]

    def attention(self, layout, h):
        """softmax(q k^T / sqrt(hs)) of one block for its input h (B, T, D); causal where the model
        is."""
        a = layout["norm"](h) if layout["norm"] is not None else h
        B, T, D = a.shape
        q, k = (F.linear(a, *layout[n]).view(B, T, self.heads, -1).transpose(1, 2) for n in "qk")
        return attention_probabilities(q, k, self.causal)


def heads_of(model, config):
    if config is not None:
        for key in ("num_attention_heads", "n_head", "heads"):
            if hasattr(config, key):
                return getattr(config, key)
    return block_list(model)[0].attn.num_heads


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
