"""timm and Hugging Face models and tokenizers from a spec, `timm:NAME[,key=value,...]` or
`hf:NAME[,...]` (pretrained=0: random weights, no network; hf NAME may be a model type), wrapped as
adapters.Foreign. Offline, each fails in seconds with one line.

Run: python probe.py timm:vit_base_patch16_224,pretrained=0 --dataset folder --data_dir DIR
"""
import os
import pickle
import socket
import sys

import torch

from operations import cli
from operations.adapters import FAMILIES, Foreign, is_image
from operations.files import DataError


def load(spec):
    """A Foreign model in eval mode for a timm: or hf: spec; one line for what cannot be had."""
    library, _, rest = spec.partition(":")
    name, settings = cli.split_spec(rest)  # the values' texts
    pretrained = cli.typed("pretrained", settings.pop("pretrained", "1"), bool)
    offline = pretrained and hub_unreachable()
    torch.manual_seed(0)  # random weights (pretrained=0) alike in every run, as init: specs are
    try:
        if library == "timm":
            model = timm_model(name, pretrained, settings)
            cfg = model.pretrained_cfg
            return Foreign(model.eval(), spec, statistics=(cfg["mean"], cfg["std"]))
        model, statistics = hf_model(name, pretrained, settings), None
        if pretrained and is_image(model.config):  # the mean and std it was trained with
            from transformers import AutoImageProcessor

            processor = AutoImageProcessor.from_pretrained(name)
            statistics = processor.image_mean, processor.image_std
        return Foreign(model.eval(), spec, statistics, hf_tokenizer(model.config, name, pretrained))
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused it: no code ran
        raise ValueError(f"{spec}: its weights are a pickle with more than tensors, which is not "
                         "loaded (it could run code); use safetensors or tensor weights") from None
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
        return timm.create_model(name, pretrained=pretrained,
                                 **{k: cli.typed(k, v) for k, v in settings.items()})
    except TypeError as e:  # a key the model does not take, or a value of the wrong type
        raise ValueError(f"timm's {name} refuses the settings {settings} "
                         f"({str(e).splitlines()[0][:120]}); give its constructor's arguments, "
                         "e.g. depth=6,embed_dim=192,num_heads=3") from None


def hf_model(name, pretrained, settings):
    """A Hugging Face model from the hub, or of a model type's configuration with settings (the
    spec's texts, each typed as its default is)."""
    import transformers

    if pretrained:  # its warnings say what was not loaded
        return transformers.AutoModel.from_pretrained(
            name, attn_implementation="eager", **{k: cli.typed(k, v) for k, v in settings.items()})
    transformers.logging.set_verbosity_error()  # a fresh config's warnings are not the probe's
    try:
        default = transformers.AutoConfig.for_model(name)
    except ValueError:  # not a model type: a hub name, whose configuration needs the network
        default = transformers.AutoConfig.from_pretrained(name)
    known = default.to_dict()  # the keys this family takes, with their default values
    for key in settings:
        if key not in known:
            raise ValueError(f"{name} takes no setting {key!r}; it takes: "
                             f"{', '.join(sorted(known))}")
    kinds = {k: type(v) if type(v) in cli.KINDS else None for k, v in known.items()}
    config = type(default).from_dict(
        {**known, **{k: cli.typed(k, v, kinds[k]) for k, v in settings.items()}})
    config._attn_implementation = "eager"
    return transformers.AutoModel.from_config(config)


def hf_tokenizer(config, name, pretrained):
    """The --tokenizer a Hugging Face text model reads: tiktoken's r50k_base for GPT-2 (its BPE in
    one cached file), the hub's tokenizer (hf:NAME) for other pretrained models; none for random
    weights of another family, whose user chooses one."""
    if is_image(config):
        return None
    if config.model_type == "gpt2" and config.vocab_size == 50257:
        return "r50k_base"
    return f"hf:{name}" if pretrained else None


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
            raise DataError(f"could not load the Hugging Face tokenizer {name!r} ("
                            f"{str(e).splitlines()[0][:120]}); it needs the network once (then the "
                            "cache), or pass --tokenizer bytes or a tiktoken encoding") from None
        self.name = "hf-" + "".join(c if c.isalnum() or c in "-." else "_" for c in name)
        self.n_vocab = len(self.tokenizer)

    def encode_ordinary(self, text):
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids):
        return self.tokenizer.decode(ids)
