"""Models of the suite: Hugging Face GPT-2, BERT and LLaMA built from configs, random init.

Nothing is downloaded. Every family has a CPU-tiny size (byte vocabulary, for the quick
suite and the tests) and the sizes the papers use. `MODELS` is plain data so the
Snakefile and the config check can read it without importing torch.

A model may also be a path to a Hugging Face `config.json` of any architecture transformers
builds from its config alone (Mistral, Qwen2, Gemma, GPT-NeoX, OPT, ...): its family is the
config's `model_type`, its objective causal unless the config is a masked LM (see
`_objective_of`), its vocabulary and positions the config's (`load_config`).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re

from bench.errors import first_line

# name -> (family, config overrides). Paper sizes keep their real vocabularies.
MODELS: dict[str, tuple[str, dict]] = {
    # GPT-2 (Radford et al. 2019): small 124M ... XL 1.5B
    "gpt2-tiny": ("gpt2", dict(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=512)),
    "gpt2-small": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12)),
    "gpt2-medium": ("gpt2", dict(n_layer=24, n_embd=1024, n_head=16)),
    "gpt2-large": ("gpt2", dict(n_layer=36, n_embd=1280, n_head=20)),
    "gpt2-xl": ("gpt2", dict(n_layer=48, n_embd=1600, n_head=25)),
    # larger shapes of the GPT-3 paper (Brown et al. 2020, Table 2.1) on the GPT-2 architecture
    "gpt2-2.7b": ("gpt2", dict(n_layer=32, n_embd=2560, n_head=32)),
    "gpt2-6.7b": ("gpt2", dict(n_layer=32, n_embd=4096, n_head=32)),
    # GPT-3 13B's width is 5140 in the paper; 5120 here, so that its 40 heads divide it
    "gpt2-13b": ("gpt2", dict(n_layer=40, n_embd=5120, n_head=40)),
    # BERT (Devlin et al. 2019), masked-LM head
    "bert-tiny": ("bert", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                               intermediate_size=512, vocab_size=256, max_position_embeddings=512)),
    "bert-base": ("bert", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                               intermediate_size=3072)),
    "bert-large": ("bert", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                intermediate_size=4096)),
    # Megatron-BERT sizes (Shoeybi et al. 2019, Table 4)
    "bert-1.3b": ("bert", dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=32,
                               intermediate_size=8192)),
    "bert-3.9b": ("bert", dict(num_hidden_layers=48, hidden_size=2560, num_attention_heads=40,
                               intermediate_size=10240)),
    # LLaMA sizes of GaLore (Zhao et al. 2024, configs/llama_*.json)
    "llama-tiny": ("llama", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                 intermediate_size=344, vocab_size=256)),
    "llama-60m": ("llama", dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8,
                                intermediate_size=1376)),
    "llama-130m": ("llama", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                 intermediate_size=2048)),
    "llama-350m": ("llama", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                 intermediate_size=2736)),
    "llama-1b": ("llama", dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=32,
                               intermediate_size=5461)),
    "llama-7b": ("llama", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                               intermediate_size=11008)),
    # larger LLaMA sizes (Touvron et al. 2023, Table 2)
    "llama-13b": ("llama", dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
                                intermediate_size=13824)),
    "llama-33b": ("llama", dict(num_hidden_layers=60, hidden_size=6656, num_attention_heads=52,
                                intermediate_size=17920)),
    "llama-65b": ("llama", dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                                intermediate_size=22016)),
}

# Objective each family trains with.
OBJECTIVE = {"gpt2": "causal", "bert": "masked", "llama": "causal"}

_FAMILY_DEFAULTS = {
    "gpt2": dict(vocab_size=50257, n_positions=1024, bos_token_id=0, eos_token_id=0),
    "bert": dict(vocab_size=30522, max_position_embeddings=512, pad_token_id=0),
    "llama": dict(vocab_size=32000, max_position_embeddings=2048, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0, tie_word_embeddings=False),
}


# Shape names: any width and depth of a family, built as the family builds its sizes
# ("llama-d3072-l28"; "-v256" keeps a tiny model's byte vocabulary). The capacity ladder
# (`ladder`) names its intermediate sizes so, and configs may too.
SHAPE_NAME = re.compile(r"^(gpt2|bert|llama)-d([1-9][0-9]*)-l([1-9][0-9]*)(?:-v([1-9][0-9]*))?$")
# The width of one attention head: 64 in GPT-2 and BERT, 128 in LLaMA.
HEAD_WIDTH = {"gpt2": 64, "bert": 64, "llama": 128}
# Config keys of the width and the depth.
_WIDTH = {"gpt2": "n_embd", "bert": "hidden_size", "llama": "hidden_size"}
_DEPTH = {"gpt2": "n_layer", "bert": "num_hidden_layers", "llama": "num_hidden_layers"}


def shape_overrides(fam: str, width: int, layers: int) -> dict:
    """Config overrides of a `width` x `layers` model of family `fam`, by the family's rules:
    heads of HEAD_WIDTH (64 where the width is not a multiple of 128 in LLaMA), a
    feed-forward of 4x the width (GPT-2's is built in), LLaMA's 8/3 x rounded up to 256."""
    if width % 64:
        raise ValueError(f"width {width} of a {fam} shape must be a multiple of 64")
    heads = width // (HEAD_WIDTH[fam] if width % HEAD_WIDTH[fam] == 0 else 64)
    if fam == "gpt2":
        return dict(n_layer=layers, n_embd=width, n_head=heads)
    ffn = 4 * width if fam == "bert" else 256 * math.ceil(8 * width / 3 / 256)
    return {_DEPTH[fam]: layers, _WIDTH[fam]: width, "num_attention_heads": heads,
            "intermediate_size": ffn}


# A model at another depth: its name, "@l", the number of blocks ("llama-7b@l3"). What
# `membench fit` builds to read a deep model's step from shallow ones (`bench.measure.trace_depth`).
DEPTH_SUFFIX = re.compile(r"^(.+)@l([1-9][0-9]*)$")


def at_depth(name: str, layers: int) -> str:
    """The name of model `name` with `layers` blocks (everything else as `name`)."""
    return f"{_split_depth(name)[0]}@l{layers}"


def _split_depth(name: str) -> tuple[str, int | None]:
    match = DEPTH_SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, None)


def is_config_file(name: str) -> bool:
    """A model named by the path of an existing .json file (a Hugging Face config.json)."""
    path = _split_depth(name)[0]
    return path.endswith(".json") and os.path.isfile(path)


def load_config(path: str):
    """The transformers config of a config.json, and the family it registers in OBJECTIVE;
    ValueError, in one line, when transformers cannot build it offline from the file. A
    depth suffix (`at_depth`) sets its number of blocks (and cuts a per-block list of
    layer kinds to it)."""
    import copy

    path, layers = _split_depth(path)
    stat = os.stat(path)
    config, fam = _load_config(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if layers is not None:
        config = copy.deepcopy(config)
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:layers]
        config.num_hidden_layers = layers
    return config, fam


@functools.lru_cache(maxsize=32)
def _load_config(path: str, mtime_ns: int, size: int):
    import transformers as tf

    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON file: {e}") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(f"{path} is not a Hugging Face config.json: it has no model_type")
    values = {k: v for k, v in values.items() if k not in ("dtype", "torch_dtype", "auto_map")}
    model_type = values.pop("model_type")
    if model_type not in tf.CONFIG_MAPPING:
        raise ValueError(f"{path}: transformers {tf.__version__} does not know model_type "
                         f"{model_type!r}, so it cannot build that architecture")
    try:
        config = tf.AutoConfig.for_model(model_type, **values)
    except Exception as e:  # noqa: BLE001 - any failure of the config class is the answer
        raise ValueError(f"{path}: transformers cannot make a {model_type} config of it "
                         f"({type(e).__name__}: {first_line(e)})") from None
    objective = _objective_of(config, values.get("architectures"))
    fam = model_type if OBJECTIVE.get(model_type, objective) == objective else f"{model_type}-{objective}"
    OBJECTIVE.setdefault(fam, objective)
    return config, fam


def _objective_of(config, architectures) -> str:
    """`masked` for a masked LM (its architectures say ...ForMaskedLM; without them, a
    model type that has a masked-LM head and is not marked a decoder), else `causal`;
    ValueError if transformers has a head for neither."""
    from transformers.models.auto import modeling_auto as auto

    causal = config.model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = config.model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if not (causal or masked):
        raise ValueError(f"transformers has no causal or masked language-model head for "
                         f"model_type {config.model_type!r}")
    named = " ".join(architectures) if isinstance(architectures, list) else ""
    if masked and ("ForMaskedLM" in named or not causal or not named and not config.is_decoder):
        return "masked"
    return "causal"


def config_of(name: str) -> tuple[str, dict]:
    """(family, config overrides) of a named size, a shape name or a config.json path (its
    values); KeyError if none of these, ValueError for a config transformers cannot build."""
    if name in MODELS:
        return MODELS[name]
    base, layers = _split_depth(name)
    if layers is not None and not is_config_file(name):
        fam, overrides = config_of(base)
        return fam, {**overrides, _DEPTH[fam]: layers}
    if is_config_file(name):
        config, fam = load_config(name)
        return fam, config.to_diff_dict()
    match = SHAPE_NAME.match(name)
    if not match:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}, or a shape "
                       f"<family>-d<width>-l<layers>[-v<vocab>] such as llama-d3072-l28")
    fam, width, layers, vocab = match.groups()
    overrides = shape_overrides(fam, int(width), int(layers))
    return fam, {**overrides, **({"vocab_size": int(vocab)} if vocab else {})}


def is_known(name: str) -> bool:
    try:
        config_of(name)
    except (KeyError, ValueError):
        return False
    return True


def family(name: str) -> str:
    return config_of(name)[0]


def vocab_size(name: str) -> int:
    if is_config_file(name):
        return load_config(name)[0].vocab_size
    fam, overrides = config_of(name)
    return overrides.get("vocab_size", _FAMILY_DEFAULTS[fam]["vocab_size"])


# Config keys a config.json may state its positions under (none: positions are unbounded).
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")


def max_positions(name: str) -> int:
    if is_config_file(name):
        config = load_config(name)[0]
        return next((getattr(config, k) for k in _POSITION_KEYS
                     if isinstance(getattr(config, k, None), int)), 2**31)
    fam, overrides = config_of(name)
    key = "n_positions" if fam == "gpt2" else "max_position_embeddings"
    return overrides.get(key, _FAMILY_DEFAULTS[fam][key])


def shape(name: str) -> tuple[int, int]:
    """(width, layers) of a model."""
    if is_config_file(name):
        config = load_config(name)[0]
        return config.hidden_size, config.num_hidden_layers
    fam, overrides = config_of(name)
    return overrides[_WIDTH[fam]], overrides[_DEPTH[fam]]


# The ladder's step: each size has about this many times the previous one's layer weights.
LADDER_GROWTH = 1.25


def ladder(start: str) -> list[str]:
    """Sizes of `start`'s family from `start` up to the family's largest named size,
    scaled as the family scales: its named sizes (the published ones) are the anchors,
    and between two anchors width and depth grow geometrically together, in steps of
    about LADDER_GROWTH x the layer weights (layers x width^2), widths rounded to a
    multiple of 64 (128 for LLaMA). Sizes between anchors get shape names; a tiny start
    keeps its vocabulary in all of them. Layer weights grow strictly along the ladder."""
    if is_config_file(start):
        raise ValueError(f"{start} is a config.json: it has no family ladder of sizes")
    fam = family(start)
    vocab = vocab_size(start)
    suffix = "" if vocab == _FAMILY_DEFAULTS[fam]["vocab_size"] else f"-v{vocab}"
    weights = lambda s: s[1] * s[0] ** 2  # noqa: E731
    anchors = sorted((n for n in MODELS if MODELS[n][0] == fam and not n.endswith("-tiny")),
                     key=lambda n: weights(shape(n)))
    out = [start]
    for anchor in (n for n in anchors if weights(shape(n)) > weights(shape(start))):
        (w0, l0), (w1, l1) = shape(out[-1]), shape(anchor)
        steps = max(1, round(math.log(weights((w1, l1)) / weights((w0, l0))) / math.log(LADDER_GROWTH)))
        grain = 64 if fam != "llama" or w0 % 128 else 128
        for i in range(1, steps):
            t = i / steps
            width = max(grain, grain * round(w0 * (w1 / w0) ** t / grain))
            layers = max(1, round(l0 * (l1 / l0) ** t))
            if weights(shape(out[-1])) < weights((width, layers)) < weights((w1, l1)):
                out.append(f"{fam}-d{width}-l{layers}{suffix}")
        out.append(anchor if not suffix else f"{fam}-d{w1}-l{l1}{suffix}")
    return out


def build(name: str, attn_implementation: str = "sdpa", dropout: float | None = None):
    """Build model `name` on the current default device, random init.

    `dropout` overrides the family's dropout probabilities (None keeps them: 0.1 for
    GPT-2 and BERT, 0 for LLaMA). Seed torch before calling for a deterministic init.
    """
    import transformers as tf

    tf.logging.set_verbosity_error()
    if is_config_file(name):
        return _build_from_config(name, attn_implementation, dropout)
    fam, overrides = config_of(name)
    kwargs = {**_FAMILY_DEFAULTS[fam], **overrides}
    if dropout is not None:
        keys = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
                "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
                "llama": ("attention_dropout",)}[fam]
        kwargs.update(dict.fromkeys(keys, dropout))
    config_cls, model_cls = {
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
        "bert": (tf.BertConfig, tf.BertForMaskedLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }[fam]
    config = config_cls(**kwargs)
    config._attn_implementation = attn_implementation
    return model_cls(config)


def _build_from_config(path: str, attn_implementation: str, dropout: float | None):
    """A config.json's model, with the causal (or masked) LM head of its objective, in the
    default dtype (the file's dtype is not used)."""
    import copy

    import torch
    import transformers as tf

    base, fam = load_config(path)
    config = copy.deepcopy(base)
    if dropout is not None:  # every dropout probability the config has
        for key, value in config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, dropout)
    auto = tf.AutoModelForMaskedLM if OBJECTIVE[fam] == "masked" else tf.AutoModelForCausalLM
    try:
        return auto.from_config(config, dtype=torch.get_default_dtype(),
                                attn_implementation=attn_implementation)
    except Exception as e:  # noqa: BLE001 - one line naming why, not a traceback
        raise ValueError(f"{path}: transformers cannot build a {config.model_type} model from it "
                         f"({type(e).__name__}: {first_line(e)})") from None


def n_params(model) -> int:
    """The model's weights: each parameter's elements, or for a parameter that packs
    weights (QLoRA's NF4 codes: two a byte) the count it says it holds (`holds_weights`)."""
    return sum(getattr(p, "holds_weights", p.numel()) for p in model.parameters())
