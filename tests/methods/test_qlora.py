"""QLoRA (methods/qlora.py): NF4 bytes and values against bitsandbytes 0.50.2, the model
against LoRA over bitsandbytes' dequantized weights (float64), what autograd saves, and
memory by category from tracked runs against the byte formula."""
import pytest
import torch

from bench import models
from bench.job import CATEGORIES
from bench.measure import runner
from bench.method import MethodError, load
from conftest import lm_batch, saved_bytes
from methods import qlora
from methods.lora import LoRALinear, select_targets
from methods.qlora import NF4Linear, packed_bytes

bnb = pytest.importorskip("bitsandbytes.functional")


@pytest.fixture(autouse=True, scope="module")
def eager_bitsandbytes():
    """bitsandbytes dequantizes an odd last dimension in PyTorch wrapped in torch.compile
    (seconds to compile on this host); run it eagerly: the same operations, value for value."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


def bnb_quantize(w):
    """bitsandbytes' NF4 with double quantization on the CPU (float32 or bfloat16 input)."""
    return bnb.quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=True)


def bnb_dequantized(weight):
    """bitsandbytes' dequantized values of a (d_out x d_in) weight; a float64 weight is
    quantized as its float32 rounding (bitsandbytes takes no float64), as qlora does."""
    w = weight.detach().float() if weight.dtype == torch.float64 else weight.detach()
    q, state = bnb_quantize(w)
    return bnb.dequantize_4bit(q, state, quant_type="nf4")


def ours(w):
    books = qlora.CodeBooks(w.device)
    stored = qlora.quantize(w, books)
    values = qlora.dequantize(*stored.values(), books.pairs, books.dynamic, tuple(w.shape), w.dtype)
    return stored, values


def test_code_books_are_bitsandbytes():
    nf4 = bnb.get_4bit_type("nf4", device="cpu")
    assert torch.equal(torch.tensor(qlora.NF4), nf4)
    pairs = qlora.CodeBooks("cpu").pairs  # byte b -> (NF4[b >> 4], NF4[b & 15])
    b = torch.arange(256)
    assert torch.equal(pairs, torch.stack([nf4[b >> 4], nf4[b & 15]], 1))
    assert torch.equal(torch.tensor(qlora.DYNAMIC), bnb.create_dynamic_map(signed=True))


# (d_out, d_in): 64-blocks only; an odd count with a partial 64-block; a partial 256-group
# (llama-tiny's MLP: 688 scales); several 256-groups
SHAPES = [(128, 128), (3, 37), (344, 128), (96, 2560)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_codes_scales_values_and_bytes_equal_bitsandbytes(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * shape[1])
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    w[0, :min(shape[1], 70)] = 0  # a zero block (its scale's code, its values)
    q, state = bnb_quantize(w)
    stored, values = ours(w)
    assert torch.equal(stored["weight_nf4"], q.view(-1))  # packed codes, nibble order, pad
    assert torch.equal(stored["absmax_codes"], state.absmax)  # 8-bit codes of the scales
    assert torch.equal(stored["absmax_scales"], state.state2.absmax)  # second-level scales
    assert torch.equal(stored["absmax_offset"], state.offset)  # the mean offset
    assert state.state2.blocksize == qlora.BLOCK2 and state.blocksize == qlora.BLOCK
    expected = bnb.dequantize_4bit(q, state, quant_type="nf4")
    assert values.dtype == expected.dtype == dtype
    assert torch.equal(values, expected)  # bit for bit
    # the same bytes: bitsandbytes' packed weight, scale codes, scales and offset
    theirs = q.numel() + state.absmax.numel() + 4 * state.state2.absmax.numel() + state.offset.numel() * 4
    mine = sum(t.untyped_storage().nbytes() for t in stored.values())  # what the tracker counts
    n = shape[0] * shape[1]
    blocks = -(-n // 64)
    assert mine == theirs == packed_bytes(n) == -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4
    # (bitsandbytes also keeps both code books in every QuantState; qlora keeps one pair a device)
    assert state.code.numel() * 4 + state.state2.code.numel() * 4 == 4 * (16 + 256)


def test_chunks_give_the_same_bytes(monkeypatch):
    """Quantized and dequantized in chunks of 128 weights (the last odd, with a partial
    block): the same bytes and values as in one piece, and as bitsandbytes'."""
    w = torch.randn(33, 65, generator=torch.Generator().manual_seed(3))
    whole, values = ours(w)
    monkeypatch.setattr(qlora, "CHUNK", 128)
    chunked, chunked_values = ours(w)
    q, state = bnb_quantize(w)
    for key in whole:
        assert torch.equal(chunked[key], whole[key]), key
    assert torch.equal(chunked["weight_nf4"], q.view(-1))
    assert torch.equal(chunked_values, values)
    assert torch.equal(values, bnb.dequantize_4bit(q, state, quant_type="nf4"))


def test_the_second_level_is_bitsandbytes_cpu_rule_not_the_nearest_code():
    """Guards the comparison: the exact nearest code (bucketize on the midpoints, bitsandbytes'
    pure-PyTorch fallback) differs from bitsandbytes' CPU library in a few scale codes, by
    one step; qlora follows the library."""
    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(4))
    q, state = bnb_quantize(w)
    stored, _ = ours(w)
    assert torch.equal(stored["absmax_codes"], state.absmax)
    absmax = w.view(-1, 64).abs().amax(-1)
    centred = (absmax - absmax.mean()).view(-1, 256)
    code = torch.tensor(qlora.DYNAMIC)
    nearest = torch.bucketize((centred * (1.0 / centred.abs().amax(-1, keepdim=True))).view(-1),
                              (code[:-1] + code[1:]) / 2).to(torch.uint8)
    differ = nearest != state.absmax
    assert 0 < differ.sum() < 0.01 * differ.numel()
    assert (nearest.int() - state.absmax.int())[differ].abs().max() == 1


def base_model(name, dtype=torch.float64):
    torch.manual_seed(0)
    return models.build(name, dropout=0.0).to(dtype)


def batch(name, n=2, t=16):
    return lm_batch(n, t, models.vocab_size(name), seed=1)


def dequantized_model(name, method="lora"):
    """`method` ("lora", or "adamw": no adapters) on the base model whose target weights are
    bitsandbytes' dequantized NF4 weights (Conv1D's transposed back), in float64."""
    model = load(method).transform_model(base_model(name))
    for full in select_targets(base_model(name), "all-linear"):
        module = model.get_submodule(full)
        layer = module.base_layer if isinstance(module, LoRALinear) else module
        linear = isinstance(layer, torch.nn.Linear)
        w = layer.weight if linear else layer.weight.t()
        with torch.no_grad():
            value = bnb_dequantized(w.contiguous()).double()
            layer.weight.copy_(value if linear else value.t())
    return model


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_zero_B_gives_the_dequantized_base_models_outputs(name):
    b = batch(name)
    want = dequantized_model(name, "adamw")(input_ids=b["input_ids"]).logits
    got = load("qlora").transform_model(base_model(name))(input_ids=b["input_ids"]).logits
    # nn.Linear's op exactly; GPT-2's Conv1D is addmm(b, x, W) there, linear(x, W^T, b) here
    tol = 1e-12 if name == "gpt2-tiny" else 0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # and the quantization is visible (the comparison could fail)
    assert not torch.allclose(got, base_model(name)(input_ids=b["input_ids"]).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_equals_lora_over_dequantized_weights_fp64(name):
    mine, ref = load("qlora").transform_model(base_model(name)), dequantized_model(name)
    g = torch.Generator().manual_seed(2)
    pairs = [(m, ref.get_submodule(full)) for full, m in mine.named_modules() if isinstance(m, LoRALinear)]
    assert pairs and all(isinstance(m.base_layer, NF4Linear) for m, _ in pairs)
    for m, r in pairs:
        assert torch.equal(m.lora_A.weight, r.lora_A.weight)  # the same draws as lora
        with torch.no_grad():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g, dtype=torch.float64) * 0.1)
            r.lora_B.weight.copy_(m.lora_B.weight)
    b = batch(name)
    outs = []
    for model in (mine, ref):
        logits = model(input_ids=b["input_ids"]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100).backward()
        outs.append(logits.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for m, r in pairs:
        for a, c in ((m.lora_A, r.lora_A), (m.lora_B, r.lora_B)):
            assert a.weight.grad is not None and a.weight.grad.abs().sum() > 0
            torch.testing.assert_close(a.weight.grad, c.weight.grad, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in mine.parameters() if not p.requires_grad)  # the base gets none


def test_layers_parameters_and_report():
    name = "llama-tiny"
    method = load("qlora")
    model = method.transform_model(base_model(name, torch.float32))
    lora = load("lora").transform_model(base_model(name, torch.float32))
    trainable = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (model, lora)]
    assert trainable[0] == trainable[1] == method.report["trainable_params"]
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    weights = [m.in_features * m.out_features for m in layers]
    assert len(layers) == method.report["quantized_layers"] == 14 and sum(weights) == method.report["quantized_weights"]
    for m, n in zip(layers, weights):
        stored = [m.weight_nf4, m.absmax_codes, m.absmax_scales, m.absmax_offset]
        assert [t.dtype for t in stored] == [torch.uint8, torch.uint8, torch.float32, torch.float32]
        assert all(isinstance(t, torch.nn.Parameter) and not t.requires_grad for t in stored)
        assert sum(t.untyped_storage().nbytes() for t in stored) == packed_bytes(n)
        assert m.compute_dtype == torch.float32 and m.dequantize().dtype == torch.float32
    assert method.report["nf4_bytes"] == sum(packed_bytes(n) for n in weights)
    # one pair of code books for the model, shared by every layer
    assert len({m.nf4_pairs.untyped_storage().data_ptr() for m in layers}) == 1
    assert method.report["code_book_bytes"] == 4 * (2 * 256 + 256)
    # embeddings, norms and the LM head are left in the model's dtype
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    # adapters only where `targets` says; every block linear is quantized all the same
    partial = load("qlora@targets=q_proj|v_proj,rank=2")
    partial_model = partial.transform_model(base_model(name, torch.float32))
    assert partial.report["quantized_layers"] == 14 and partial.report["layers"] == 4
    assert sum(isinstance(m, LoRALinear) for m in partial_model.modules()) == 4


def test_saved_tensors_are_loras():
    """The base path saves nothing; an adapted layer saves x (N x d_in) and A's output
    (N x r), the formula of the module docstring; a whole forward saves what lora's does."""
    name, r, n_tok = "llama-tiny", 16, 2 * 16
    model = load("qlora").transform_model(base_model(name, torch.float32))
    layer = model.model.layers[0].mlp.down_proj
    base = layer.base_layer
    x = torch.randn(2, 16, base.in_features, requires_grad=True)
    packs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(t) or t, lambda t: t):
        y = base(x)
    assert packs == []
    dy = torch.randn_like(y)
    y.backward(dy)
    w = base.dequantize()
    torch.testing.assert_close(x.grad, dy @ w, rtol=0, atol=0)
    params = list(model.parameters())
    assert saved_bytes(layer, x, exclude=params) == 4 * n_tok * (base.in_features + r)
    lora = load("lora").transform_model(base_model(name, torch.float32))
    ids = batch(name)["input_ids"]
    assert saved_bytes(lambda i: model(input_ids=i).logits, ids, exclude=params) == \
        saved_bytes(lambda i: lora(input_ids=i).logits, ids, exclude=list(lora.parameters())) > 0


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tracked_memory_by_category(tiny_job, name):
    """At a step whose peak is activations (16 x 64 tokens), lora's bytes with the target
    weights (4 bytes each) replaced by their packed bytes in `param`, plus the shared code
    books in `other`; the adapters' gradients and moments and the activations are lora's."""
    mine = runner.run(tiny_job(model=name, method="qlora", batch_size=16, seq_len=64))
    theirs = runner.run(tiny_job(model=name, method="lora", batch_size=16, seq_len=64))
    assert mine["status"] == theirs["status"] == "ok", (mine.get("message"), theirs.get("message"))
    torch.manual_seed(0)
    model = models.build(name)
    weights = [model.get_submodule(n).weight.numel() for n in select_targets(model, "all-linear")]
    saved = 4 * sum(weights) - sum(packed_bytes(n) for n in weights)
    mem, ref = mine["memory"], theirs["memory"]
    assert mem["param_bytes"] == ref["param_bytes"] - saved
    assert mem["other_bytes"] == ref["other_bytes"] + 4 * (2 * 256 + 256)
    for c in ("grad", "optimizer", "activation"):
        assert mem[f"{c}_bytes"] == ref[f"{c}_bytes"], c
    assert mem["peak_bytes"] == ref["peak_bytes"] - saved + 4 * (2 * 256 + 256)
    assert mine["trainable_params"] == theirs["trainable_params"]
    # the model's size is its weights, packed or not (the packed codes say how many they hold)
    assert mine["n_params"] == theirs["n_params"] == models.n_params(model) + mine["trainable_params"]
    assert mine["method_report"]["nf4_bytes"] == sum(packed_bytes(n) for n in weights)
    assert abs(mine["loss"] - theirs["loss"]) < 0.01  # quantization moves the loss a little


def test_bfloat16_simulates_as_it_runs(tiny_job):
    """In bfloat16 (how `membench fit` runs it) fake tensors give the tracked bytes, and
    `param` is lora's with the target weights (2 bytes each) replaced by their packed bytes."""
    job = dict(model="llama-tiny", dtype="bfloat16", batch_size=2, seq_len=16)
    real = runner.run(tiny_job(method="qlora", **job))
    fake = runner.run(tiny_job(method="qlora", simulate=True, **job))
    lora = runner.run(tiny_job(method="lora", simulate=True, **job))
    assert real["status"] == fake["status"] == lora["status"] == "ok", (real.get("message"), fake.get("message"))
    for c in CATEGORIES:
        assert fake["memory"][f"{c}_bytes"] == real["memory"][f"{c}_bytes"], c
    n = real["method_report"]["quantized_weights"]
    assert real["memory"]["param_bytes"] == lora["memory"]["param_bytes"] - 2 * n + real["method_report"]["nf4_bytes"]


def test_stacks_with_checkpointing(tiny_job):
    alone = runner.run(tiny_job(method="qlora", batch_size=8, seq_len=64))
    record = runner.run(tiny_job(method="qlora+checkpointing", batch_size=8, seq_len=64))
    assert record["status"] == "ok", record.get("message")
    assert record["memory"]["param_bytes"] == alone["memory"]["param_bytes"]
    assert record["memory"]["activation_bytes"] < alone["memory"]["activation_bytes"]
    assert record["loss"] == pytest.approx(alone["loss"], rel=1e-6)


def test_it_is_lora_already():
    for stack in ("qlora+lora", "lora_peft+qlora"):
        with pytest.raises(MethodError, match="cannot be stacked with"):
            load(stack)


def test_a_training_step_moves_only_the_adapters():
    name = "gpt2-tiny"
    method = load("qlora")
    model = method.transform_model(base_model(name, torch.float32))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = method.make_optimizer(model)
    assert torch.isfinite(method.train_step(model, optimizer, batch(name)))
    assert set(optimizer.state) == {p for p in model.parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert "lora_" in n
        else:
            assert torch.equal(p, before[n]), n

