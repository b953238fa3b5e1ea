"""Named model sizes match their published parameter counts (built on the meta device)."""
import pytest
import torch

from bench import models

PUBLISHED = {  # millions of parameters, as the model's authors count them
    "gpt2-small": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558,
    "bert-base": 110, "bert-large": 335,
    "llama-60m": 60, "llama-130m": 130, "llama-350m": 350, "llama-1b": 1340, "llama-7b": 6740,
    "gpt2-2.7b": 2700, "gpt2-6.7b": 6700, "gpt2-13b": 13000, "bert-1.3b": 1300, "bert-3.9b": 3900,
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


# The family rules of `models.shape_overrides` rebuild the published sizes from their
# width and depth alone (not GaLore's llama-1b: its feed-forward is 5461, not LLaMA's 8/3 x
# rounded up to 256; nor the GPT-3 shapes, whose heads are 80 and 128 wide, not GPT-2's 64).
@pytest.mark.parametrize("name", ["gpt2-small", "gpt2-xl", "bert-base", "bert-large",
                                  "bert-3.9b", "llama-7b", "llama-13b", "llama-33b", "llama-65b"])
def test_a_shape_name_builds_the_named_size(name):
    width, layers = models.shape(name)
    fam = models.family(name)
    with torch.device("meta"):
        named, shaped = models.build(name), models.build(f"{fam}-d{width}-l{layers}")
    assert models.n_params(shaped) == models.n_params(named)
    assert shaped.config.to_dict() | {"_name_or_path": ""} == named.config.to_dict() | {"_name_or_path": ""}


@pytest.mark.parametrize("start", ["gpt2-tiny", "bert-base", "llama-60m", "llama-tiny"])
def test_the_ladder_climbs_through_the_family_sizes(start):
    ladder = models.ladder(start)
    fam = models.family(start)
    assert ladder[0] == start and len(ladder) == len(set(ladder))
    with torch.device("meta"):
        sizes = [models.n_params(models.build(name)) for name in ladder]
    assert all(a < b for a, b in zip(sizes, sizes[1:]))  # strictly growing
    shapes = [models.shape(name) for name in ladder]
    named = [models.shape(n) for n in models.MODELS
             if models.family(n) == fam and not n.endswith("-tiny")
             and models.shape(n)[1] * models.shape(n)[0] ** 2 > shapes[0][1] * shapes[0][0] ** 2]
    assert set(named) <= set(shapes)  # every larger published size is a rung
    assert {models.vocab_size(n) for n in ladder} == {models.vocab_size(start)}
    for (w0, l0), (w1, l1) in zip(shapes, shapes[1:]):  # steps of about 1.25x, never huge
        assert l1 * w1 ** 2 / (l0 * w0 ** 2) < 5


def test_a_bad_shape_name_says_what_a_shape_is():
    assert not models.is_known("llama-d100-l2") and not models.is_known("gpt3-d128-l2")
    with pytest.raises(KeyError, match="<family>-d<width>-l<layers>"):
        models.config_of("gpt3-d128-l2")
