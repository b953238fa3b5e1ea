"""LoRA (methods/lora.py) against the base model, Hugging Face peft and hand formulas."""
import warnings

import pytest
import torch

from bench import models
from bench.job import CATEGORIES
from bench.measure import runner
from bench.method import MethodError, load
from conftest import lm_batch
from methods.lora import LoRALinear, select_targets

peft = pytest.importorskip("peft")

# the layers "all-linear" adapts, per family: every Linear/Conv1D inside the blocks
DEFAULT_TARGETS = {
    "gpt2-tiny": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
    "bert-tiny": ["attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense", "intermediate.dense", "output.dense"],
    "llama-tiny": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
}


def base_model(name, dtype=torch.float64):
    torch.manual_seed(0)
    return models.build(name, dropout=0.0).to(dtype)


def batch(name, n=2, t=16):
    return lm_batch(n, t, models.vocab_size(name), seed=1)


def shapes(name):
    """(d_in, d_out) of every default target, read from the config (not from the model)."""
    _, c = models.config_of(name)
    d = c.get("n_embd") or c["hidden_size"]
    ff = c.get("n_inner") or c.get("intermediate_size") or 4 * d
    layers = c.get("n_layer") or c["num_hidden_layers"]
    per_block = {"gpt2-tiny": [(d, 3 * d), (d, d), (d, ff), (ff, d)],
                 "bert-tiny": [(d, d)] * 4 + [(d, ff), (ff, d)],
                 "llama-tiny": [(d, d)] * 4 + [(d, ff), (d, ff), (ff, d)]}[name]
    return per_block * layers


@pytest.mark.parametrize("name", sorted(DEFAULT_TARGETS))
def test_default_targets_and_trainable_count_by_hand(name):
    model = base_model(name)
    chosen = select_targets(model, "all-linear")
    assert sorted({n.split(".", 3)[-1] if name != "bert-tiny" else n.split(".", 4)[-1] for n in chosen}) \
        == sorted(DEFAULT_TARGETS[name])
    method = load("lora")
    lora = method.transform_model(model)
    r = method.hp["rank"]
    expected = sum(r * (d_in + d_out) for d_in, d_out in shapes(name))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == expected == method.report["trainable_params"]
    assert len(trainable) == 2 * len(chosen)
    for module in lora.modules():
        if isinstance(module, LoRALinear):
            assert not module.base_layer.weight.requires_grad
            assert module.lora_B.weight.eq(0).all() and module.scaling == 32 / 16
            bound = 1 / module.lora_A.weight.shape[1] ** 0.5
            assert module.lora_A.weight.abs().max() <= bound


@pytest.mark.parametrize("name", sorted(DEFAULT_TARGETS))
def test_zero_B_gives_the_base_models_outputs(name):
    b = batch(name)
    base = base_model(name)
    want = base(input_ids=b["input_ids"]).logits
    lora = load("lora").transform_model(base_model(name))
    got = lora(input_ids=b["input_ids"]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_targets_by_name_and_errors():
    model = base_model("llama-tiny")
    assert [n.rsplit(".", 1)[-1] for n in select_targets(model, "q_proj|v_proj")] == ["q_proj", "v_proj"] * 2
    with pytest.raises(MethodError, match="select no linear layer.*q_proj"):
        select_targets(model, "c_attn")
    with pytest.raises(MethodError, match="stands alone"):
        select_targets(model, "all-linear|q_proj")
    for bad in ({"rank": 0}, {"alpha": 0.0}, {"dropout": 1.0}):
        with pytest.raises(MethodError, match=next(iter(bad))):
            load("lora", bad)
    assert load("lora@targets=q_proj|v_proj,rank=2").hp["targets"] == "q_proj|v_proj"


def peft_pair(name, targets="all-linear", rank=4, alpha=8.0):
    """Our LoRA model and peft's on the same base weights, with the same random A and B."""
    hp = {"rank": rank, "alpha": alpha, "targets": targets}
    ours = load("lora", hp).transform_model(base_model(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = load("lora_peft", hp).transform_model(base_model(name))
    g = torch.Generator().manual_seed(2)
    for full, module in ours.named_modules():
        if isinstance(module, LoRALinear):
            layer = theirs.base_model.model.get_submodule(full)
            for mine, peft_side in ((module.lora_A, layer.lora_A["default"]), (module.lora_B, layer.lora_B["default"])):
                w = torch.randn(mine.weight.shape, generator=g, dtype=torch.float64) * 0.1
                with torch.no_grad():
                    mine.weight.copy_(w)
                    peft_side.weight.copy_(w)
            assert layer.scaling["default"] == module.scaling
    return ours, theirs


def adapter_grads(model):
    return {n.replace(".default", "").replace("base_model.model.", ""): p.grad
            for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_equals_peft_outputs_and_adapter_gradients_fp64(name):
    ours, theirs = peft_pair(name)
    b = batch(name)
    outs = []
    for model in (ours, theirs):
        logits = model(input_ids=b["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        loss.backward()
        outs.append(logits.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    mine, peers = adapter_grads(ours), adapter_grads(theirs)
    assert sorted(mine) == sorted(peers) and len(mine) > 0
    for key in mine:
        assert mine[key] is not None and mine[key].abs().sum() > 0, key
        torch.testing.assert_close(mine[key], peers[key], rtol=1e-10, atol=1e-12)
    for model in (ours, theirs):  # frozen base: no gradient anywhere else
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # and the base model's logits differ now that B is not zero (the comparison can fail)
    assert not torch.allclose(outs[0], base_model(name)(input_ids=b["input_ids"]).logits)


def test_peft_default_targets_by_name_agree():
    """peft's own default for LLaMA (q_proj, v_proj), given by name to both."""
    ours, theirs = peft_pair("llama-tiny", targets="q_proj|v_proj", rank=2, alpha=3.0)
    b = batch("llama-tiny")
    torch.testing.assert_close(ours(input_ids=b["input_ids"]).logits, theirs(input_ids=b["input_ids"]).logits,
                               rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == \
        sum(p.numel() for p in theirs.parameters() if p.requires_grad) == 2 * 2 * 2 * (128 + 128)


def test_optimizer_state_only_for_adapters():
    name = "gpt2-tiny"
    method = load("lora", {"micro_batches": 1})
    model = method.transform_model(base_model(name, torch.float32))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = method.make_optimizer(model)
    method.train_step(model, optimizer, batch(name))
    trainable = {p for p in model.parameters() if p.requires_grad}
    assert set(optimizer.state) == trainable
    moments = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                  for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    assert moments == 2 * 4 * sum(p.numel() for p in trainable)
    for n, p in model.named_parameters():  # the base is unchanged; B has moved off zero
        if p.requires_grad:
            assert "lora_" in n and p.grad is None
            if "lora_B" in n:
                assert not torch.equal(p, before[n])
        else:
            assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_lora_and_peft_jobs_equal_bytes_by_category(tiny_job, name):
    ours = runner.run(tiny_job(model=name, method="lora"))
    theirs = runner.run(tiny_job(model=name, method="lora_peft"))
    assert ours["status"] == theirs["status"] == "ok", (ours.get("message"), theirs.get("message"))
    for c in CATEGORIES:
        assert ours["memory"][f"{c}_bytes"] == theirs["memory"][f"{c}_bytes"], c
    assert ours["memory"]["peak_bytes"] == theirs["memory"]["peak_bytes"]
    assert ours["loss"] == theirs["loss"]  # same seed: peft draws the same A
    n = models.n_params(models.build(name))
    assert ours["n_params"] == theirs["n_params"] > n  # the adapters are parameters too
    r = 16
    assert ours["trainable_params"] == theirs["trainable_params"] == sum(r * (i + o) for i, o in shapes(name))
    # AdamW's two float32 moments per adapter parameter (+ a 4-byte step per tensor)
    adapters = 2 * len(shapes(name))
    assert ours["memory"]["optimizer_bytes"] == 8 * ours["trainable_params"] + 4 * adapters
    base = runner.run(tiny_job(model=name, method="adamw"))
    assert base["trainable_params"] == base["n_params"] == n
    assert ours["memory"]["param_bytes"] == 4 * ours["n_params"]
    assert ours["memory"]["optimizer_bytes"] < base["memory"]["optimizer_bytes"] / 5  # 12% of the parameters


@pytest.mark.parametrize("stack", ["lora+checkpointing", "checkpointing+lora", "lora+grad_accum",
                                   "lora+checkpointing+grad_accum", "lora+adamw_8bit",
                                   "lora+torchao_adamw8bit", "lora+mesa8bit", "lora+fewbit",
                                   "lora+approx_bp", "lora+tempo", "lora_peft+checkpointing"])
def test_stacks_build_and_run(tiny_job, stack):
    record = runner.run(tiny_job(method=stack))
    alone = runner.run(tiny_job(method="lora"))
    assert record["status"] == "ok", record.get("message")
    assert record["trainable_params"] == alone["trainable_params"]
    assert record["memory"]["param_bytes"] == alone["memory"]["param_bytes"]
    if "checkpointing" in stack:
        assert record["memory"]["activation_bytes"] < alone["memory"]["activation_bytes"]
    if "8bit" in stack and "mesa" not in stack:
        assert record["memory"]["optimizer_bytes"] < alone["memory"]["optimizer_bytes"]
