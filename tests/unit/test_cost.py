"""The exact cost of a step (bench.measure.cost): FLOPs against hand counts and torch's own
FlopCounterMode, the bytes rule, the phases, and fake tensors against real ones."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.job import Job
from bench.measure import runner
from bench.measure.cost import StepCost, _svd_flops
from bench.method import available
from conftest import memory_pair, pair_group

BATCH, SEQ = 4, 16
_RUNS: dict = {}
LLAMA_RUNS = pytest.mark.xdist_group("cost-llama-runs")  # the tests that share run(): one worker


def run(method: str, simulate: bool = False) -> dict:
    """A memory job on llama-tiny (each run once per process: the tests that share them are
    LLAMA_RUNS, on one worker)."""
    key = (method, simulate)
    if key not in _RUNS:
        _RUNS[key] = runner.run(Job(kind="memory", method=method, model="llama-tiny",
                                    batch_size=BATCH, seq_len=SEQ, simulate=simulate))
    return _RUNS[key]


def _linear_step(m, k, n, bias=True):
    layer = torch.nn.Linear(k, n, bias=bias)
    x = torch.randn(m, k, requires_grad=True)
    with StepCost() as cost:
        layer(x).sum().backward()
    return cost.result()


def test_linear_layer_flops_forward_and_backward():
    m, k, n = 8, 16, 12
    cost = _linear_step(m, k, n)
    fwd, bwd = cost["phases"]["forward"], cost["phases"]["backward"]
    assert fwd["flops"] == 2 * m * n * k  # y = x W^T + b: m n k multiply-adds
    assert bwd["flops"] == 2 * (2 * m * n * k)  # dL/dx and dL/dW, one matmul each
    assert cost["flops"] == 6 * m * n * k and "optimizer" not in cost["phases"]
    # the bytes rule: addmm reads b, x, W (its transpose is a view: 0 bytes, no op), writes y
    addmm = [r for r in cost["per_op"] if r[0] == "forward" and r[1] == "addmm"]
    assert addmm == [["forward", "addmm", "float32", 2 * m * n * k, 4 * (n + m * k + n * k + m * n), 1]]
    assert not any(r[1] in ("t", "transpose", "view", "detach") for r in cost["per_op"])


def test_bytes_rule_in_place_and_write_only():
    a, b = torch.randn(100), torch.randn(100)
    with StepCost() as cost:
        a.add_(b)  # reads a and b, writes a
        a.copy_(b)  # reads b, writes a (the destination is not read)
        a.zero_()  # writes a
        torch.empty(1000)  # an allocation without a fill moves nothing
    rows = {r[1]: r for r in cost.result()["per_op"]}
    assert rows["add_"][4] == 3 * 400 and rows["copy_"][4] == 2 * 400 and rows["zero_"][4] == 400
    assert "empty" not in rows and cost.result()["ops"] == 3


def test_optimizer_phase_and_torch_flop_counter_agree():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 32)
    model(x).sum().backward()
    opt.step()  # the state exists: the measured step is a second step
    counter = FlopCounterMode(display=False)
    with StepCost() as cost, counter:
        model(x).sum().backward()
        opt.step()
    result = cost.result()
    assert result["flops"] == counter.get_total_flops()
    optimizer = result["phases"]["optimizer"]
    n_params = sum(p.numel() for p in model.parameters())
    assert optimizer["flops"] == 0 and optimizer["ops"] > 0
    assert optimizer["bytes_moved"] >= 4 * 4 * n_params  # reads p, g, m, v at least once


@LLAMA_RUNS
def test_checkpointing_adds_the_recomputed_forward():
    """Checkpointing's step costs AdamW's plus the recomputation inside backward, and that
    recomputation is each block's forward up to the last saved tensor: non-reentrant
    checkpointing stops recomputing early, so the block's last matmul (LLaMA's down_proj),
    whose output backward does not need, is not rerun; nor are the embedding and LM head,
    outside the blocks. So the extra is less than "one forward" (72% of it here). The
    reference counts come from torch's FlopCounterMode on the model's forward."""
    from bench import models

    base, ckpt = run("adamw"), run("checkpointing")
    assert base["status"] == ckpt["status"] == "ok"
    b, c = base["cost"], ckpt["cost"]
    extra = c["flops"] - b["flops"]
    assert extra == c["recompute"]["flops"] > 0
    assert c["phases"]["forward"]["flops"] == b["phases"]["forward"]["flops"]
    # independent reference: torch's counter per module over one forward
    torch.manual_seed(0)
    model = models.build("llama-tiny")
    ids = torch.randint(0, 100, (BATCH, SEQ))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids)
    per_module = counter.get_flop_counts()
    blocks = sum(per_module[f"LlamaForCausalLM.model.layers.{i}"][op]
                 for i in range(model.config.num_hidden_layers)
                 for op in per_module[f"LlamaForCausalLM.model.layers.{i}"])
    down = sum(sum(per_module[f"LlamaForCausalLM.model.layers.{i}.mlp.down_proj"].values())
               for i in range(model.config.num_hidden_layers))
    # torch's counter has no formula for the CPU's fused attention: 4 B T^2 d per layer
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    attention = layers * 4 * ids.shape[0] * ids.shape[1] ** 2 * hidden
    assert extra == blocks + attention - down
    assert b["phases"]["forward"]["flops"] == counter.get_total_flops() + attention


@LLAMA_RUNS
def test_galore_amortizes_its_svd_over_the_refresh_interval():
    from bench import models
    from methods.galore import GaLore, split_params

    record = run("galore")
    assert record["status"] == "ok", record.get("message")
    periodic = record["cost"]["phases"]["periodic"]
    with torch.device("meta"):
        projected, _ = split_params(models.build("llama-tiny"), GaLore.defaults["target_modules"])
    gap = GaLore.defaults["update_proj_gap"]
    expected = sum(_svd_flops(tuple(p.shape)) for p in projected) / gap
    assert periodic["flops"] == pytest.approx(expected, rel=1e-9)
    svd_rows = [r for r in record["cost"]["per_op"] if r[1] == "_linalg_svd"]
    assert svd_rows and all(r[0] == "periodic" for r in svd_rows)  # the measured step has none


@LLAMA_RUNS
def test_adama_updates_inside_backward():
    """AdamA folds each gradient into its moments inside backward: that work is backward's."""
    base, adama = run("adamw"), run("adama")
    assert adama["cost"]["phases"]["backward"]["bytes_moved"] > base["cost"]["phases"]["backward"]["bytes_moved"]
    assert adama["cost"]["phases"]["optimizer"]["bytes_moved"] < base["cost"]["phases"]["optimizer"]["bytes_moved"]
    assert adama["cost"]["flops"] == base["cost"]["flops"]


SKIP_REAL = {"adamw_8bit"}  # cannot run on fake tensors (tests/methods/test_simulated.py)


SHARED = ["adamw", "checkpointing", "adama", "galore"]  # their llama-tiny runs: the tests above


def assert_same_cost(method, real, fake):
    assert real["status"] == "ok", real.get("message")
    if fake["status"] == "error" and "cannot run on fake tensors" in fake["message"]:
        pytest.skip(fake["message"])
    assert fake["status"] == "ok", fake.get("message")
    r, f = real["cost"], fake["cost"]
    assert r["flops"] > 0 and f["flops"] == r["flops"]
    for phase in r["phases"]:
        assert f["phases"][phase]["flops"] == r["phases"][phase]["flops"], phase
    if "checkpointing" not in method:
        # everything else too; on fake tensors Hugging Face materialises the causal mask, which
        # only the recomputation of checkpointing meets (tests/methods/test_simulated.py)
        assert f["per_op"] == r["per_op"]


@pytest.mark.parametrize("method", [pytest.param(m, marks=pair_group(m)) for m in available() if m not in SKIP_REAL])
def test_simulated_cost_equals_tracked_cost(method):
    """Every method on gpt2-tiny (batch 4 x 32): the pair of runs whose bytes
    tests/methods/test_simulated.py compares (conftest.memory_pair, one run each)."""
    assert_same_cost(method, *memory_pair(method))


@LLAMA_RUNS
@pytest.mark.parametrize("method", SHARED)
def test_simulated_cost_equals_tracked_cost_on_llama(method):
    """The other causal family (RMSNorm, rotary embeddings, SiLU), on the runs above."""
    assert_same_cost(method, run(method), run(method, simulate=True))
