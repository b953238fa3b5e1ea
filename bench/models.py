"""Models of the suite: Hugging Face GPT-2, BERT and LLaMA built from configs, random init.

Nothing is downloaded. Every family has a CPU-tiny size (byte vocabulary, for the quick
profile and the tests) and the sizes the papers use. `MODELS` is plain data so the
Snakefile and the config check can read it without importing torch.
"""
from __future__ import annotations

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


def family(name: str) -> str:
    return MODELS[name][0]


def vocab_size(name: str) -> int:
    fam, overrides = MODELS[name]
    return overrides.get("vocab_size", _FAMILY_DEFAULTS[fam]["vocab_size"])


def max_positions(name: str) -> int:
    fam, overrides = MODELS[name]
    key = "n_positions" if fam == "gpt2" else "max_position_embeddings"
    return overrides.get(key, _FAMILY_DEFAULTS[fam][key])


def build(name: str, attn_implementation: str = "sdpa", dropout: float | None = None):
    """Build model `name` on the current default device, random init.

    `dropout` overrides the family's dropout probabilities (None keeps them: 0.1 for
    GPT-2 and BERT, 0 for LLaMA). Seed torch before calling for a deterministic init.
    """
    import transformers as tf

    tf.logging.set_verbosity_error()
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    fam, overrides = MODELS[name]
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


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
