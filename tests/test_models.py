"""Named model sizes match their published parameter counts (built on the meta device)."""
import pytest
import torch

from bench import models

PUBLISHED = {  # millions of parameters, as the model's authors count them
    "gpt2-small": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558,
    "bert-base": 110, "bert-large": 335,
    "llama-60m": 60, "llama-130m": 130, "llama-350m": 350, "llama-1b": 1340, "llama-7b": 6740,
    "gpt2-2.7b": 2700, "gpt2-6.7b": 6700, "bert-1.3b": 1300, "bert-3.9b": 3900,
    "llama-13b": 13000, "llama-33b": 32500, "llama-65b": 65200,
}
# GaLore's LLaMA names round loosely (60M is 58M, 350M is 368M; "1B" is 1.34B with
# untied embeddings).
# The GPT-3 shapes carry GPT-2's vocabulary and 1024 positions (GPT-3: 2048), Megatron-BERT
# rounds to one decimal: within 2.5%.
TOLERANCE = {"llama-60m": 0.05, "llama-130m": 0.05, "llama-350m": 0.06, "gpt2-2.7b": 0.025}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_paper_sizes(name):
    with torch.device("meta"):
        model = models.build(name)
    millions = models.n_params(model) / 1e6
    assert millions == pytest.approx(PUBLISHED[name], rel=TOLERANCE.get(name, 0.02))


@pytest.mark.parametrize("name", [n for n in models.MODELS if n.endswith("-tiny")])
def test_tiny_models_run_a_step(name):
    torch.manual_seed(0)
    model = models.build(name)
    ids = torch.randint(0, models.vocab_size(name) - 1, (2, 16))
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 16, models.vocab_size(name))
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
