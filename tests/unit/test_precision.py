"""float16 and mixed precision: the dtypes and bytes each precision states (tracked tier,
checked against numel x element size), the float16 loss scaler, simulated against
tracked, and the combinations refused before any job."""
import copy

import pytest
import torch
import yaml

from bench import suite as plan
from bench.job import CATEGORIES, Job
from bench.measure import runner, step
from bench.measure.tracker import MemoryTracker
from bench.method import LossScaler, Method, accumulate, available, load, precision_of
from conftest import REPO

# Element sizes written out, not read from the code under test.
FP16, BF16, FP32 = 2, 2, 4
# Pure float16 AdamW at torch's eps of 1e-8 diverges (eps rounds to 0 in float16, so an
# entry with no gradient yet, e.g. an unused token's embedding row, steps by 0/0): the
# jobs that must run to the end take float16's own eps.
FP16_EPS = {"eps": 1e-4}


def job(**kw) -> Job:
    base = dict(kind="memory", method="adamw", model="gpt2-tiny", batch_size=4, seq_len=32)
    return Job(**{**base, **kw})


def built(j: Job):
    """The job's model (as every kind builds it), its method, optimizer and a batch."""
    method = load(j.method, j.hparams)
    model, stream = step.setup(j, method)
    return model, method, method.make_optimizer(model), step.next_batch(stream, j.device)


def tracked_categories(model, method, optimizer, batch) -> tuple[dict, dict]:
    """Live bytes per category after the default step's backward (its gradients alive),
    and after its update (the optimizer state alive), from the tracker on real tensors."""
    scaler = precision_of(model).scaler
    tracker = MemoryTracker()
    tracker.register_model(model)
    with tracker:
        accumulate(model, batch, 1, loss_scale=scaler.scale if scaler else 1.0)
        after_backward = tracker.live_split()
        scaler.step(optimizer) if scaler else optimizer.step()
        tracker.label(method.state_tensors(optimizer), "optimizer")
        after_update = tracker.live_split()
    return after_backward, after_update


def n_params(model) -> tuple[int, int]:
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def test_pure_float16_holds_everything_in_float16():
    model, method, optimizer, batch = built(job(dtype="float16", hparams=FP16_EPS))
    n, tensors = n_params(model)
    grads, state = tracked_categories(model, method, optimizer, batch)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float16}
    moments = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert len(moments) == 2 * tensors and {v.dtype for v in moments} == {torch.float16}
    assert grads.param == FP16 * n and grads.grad == FP16 * n
    # exp_avg and exp_avg_sq in float16, and AdamW's step count: a 0-d float32 per tensor
    assert state.optimizer == 2 * FP16 * n + FP32 * tensors


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_keeps_float32_master_weights_grads_and_state(dtype):
    model, method, optimizer, batch = built(job(dtype=dtype, precision="mixed"))
    n, tensors = n_params(model)
    grads, state = tracked_categories(model, method, optimizer, batch)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert grads.param == FP32 * n and grads.grad == FP32 * n
    assert state.optimizer == 2 * FP32 * n + FP32 * tensors


def saved_dtypes(model, batch) -> list[tuple[torch.dtype, tuple]]:
    """What autograd saves for backward in the model's loss (`lm_loss`, as every step)."""
    from bench.method import lm_loss

    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model, batch)
    return saved


@pytest.mark.parametrize("dtype, low", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_mixed_saves_low_precision_activations_and_weight_copies(dtype, low):
    model, _, _, batch = built(job(dtype=dtype, precision="mixed"))
    saved = saved_dtypes(model, batch)
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    # the matmuls save their low-precision input, and autocast's cast of their weight
    assert any(d == low and s not in weight_shapes for d, s in saved)
    assert any(d == low and s in weight_shapes for d, s in saved)
    model, _, _, batch = built(job())
    pure_saved = saved_dtypes(model, batch)
    assert {d for d, _ in pure_saved if d.is_floating_point} == {torch.float32}


def test_mixed_activations_are_low_precision_and_loss_close_to_float32():
    """At 16 x 64 the activations make the peak: mixed bfloat16's are at least pure
    bfloat16's (plus the weight copies autograd saves, and what autocast leaves in
    float32: the residual stream, the loss), far below float32's."""
    rows = {name: runner.run(job(batch_size=16, seq_len=64, **kw)) for name, kw in {
        "fp32": {}, "bf16": dict(dtype="bfloat16"),
        "mixed": dict(dtype="bfloat16", precision="mixed")}.items()}
    assert all(r["status"] == "ok" for r in rows.values()), {k: r["message"] for k, r in rows.items()}
    act = {k: r["memory"]["activation_bytes"] for k, r in rows.items()}
    assert act["bf16"] < act["mixed"] < 0.75 * act["fp32"]
    assert rows["mixed"]["memory"]["param_bytes"] == FP32 * rows["mixed"]["n_params"]
    assert rows["mixed"]["loss"] == pytest.approx(rows["fp32"]["loss"], abs=0.02)
    assert rows["mixed"]["job"]["precision"] == "mixed"


def test_loss_scaler_skips_a_step_with_an_inf_gradient_and_halves_the_scale():
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    param.grad = torch.tensor([8.0, float("inf"), 8.0], dtype=torch.float16)
    assert scaler.step(optimizer) is False
    assert param.tolist() == [1.0, 1.0, 1.0]  # not updated
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    param.grad = torch.tensor([4.0, 4.0, 8.0], dtype=torch.float16)  # scale 4: g = 1, 1, 2
    assert scaler.step(optimizer) is True
    assert param.tolist() == [0.5, 0.5, 0.0]


def test_loss_scaler_doubles_after_its_growth_interval_of_clean_steps():
    scaler = LossScaler(init_scale=16.0, growth_interval=3)
    for finite in (True, True, False, True, True):  # an inf restarts the count
        scaler.update(finite)
    assert scaler.scale == 8.0
    scaler.update(True)
    assert scaler.scale == 16.0 and scaler.clean_steps == 0


def test_loss_scaler_follows_torch_grad_scaler_on_float32_gradients():
    """The same steps, one with an overflow, through torch.amp.GradScaler and ours: the
    same scale after each and the same parameters."""
    torch.manual_seed(0)
    grads = [torch.randn(4) * 100 for _ in range(6)]
    grads[2][1] = float("inf")
    sides = []
    for ours in (True, False):
        param = torch.nn.Parameter(torch.zeros(4))
        optimizer = torch.optim.SGD([param], lr=0.1)
        scaler = (LossScaler(init_scale=2.0 ** 8, growth_interval=2) if ours else
                  torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2))
        scales = []
        for g in grads:
            param.grad = g * 2.0 ** 8 if not scales else g * scales[-1]
            if ours:
                scaler.step(optimizer)
                scales.append(scaler.scale)
            else:
                scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor here
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
        sides.append((scales, param.detach().clone()))
    assert sides[0][0] == sides[1][0] == [256.0, 512.0, 256.0, 256.0, 512.0, 512.0]
    torch.testing.assert_close(sides[0][1], sides[1][1])


def test_default_step_skips_an_overflowing_float16_step_and_backs_off():
    """A scale that overflows float16's gradients (the real mechanism, not an injected
    inf): the update is skipped and the scale halved; a sane scale then updates."""
    model, method, optimizer, batch = built(job(dtype="float16", hparams=FP16_EPS))
    scaler = precision_of(model).scaler
    assert scaler.scale == 2.0 ** 16  # GradScaler's initial scale
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale = 2.0 ** 60
    loss = method.train_step(model, optimizer, batch)
    assert torch.isfinite(loss)  # the loss is reported unscaled
    assert scaler.scale == 2.0 ** 59 and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scaler.scale = 2.0 ** 10
    method.train_step(model, optimizer, batch)
    assert scaler.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_float16_results_state_their_loss_scaling():
    scaled = runner.run(job(dtype="float16", hparams=FP16_EPS))
    unscaled = runner.run(job(dtype="float16", method="lomo"))
    assert scaled["status"] == unscaled["status"] == "ok", (scaled["message"], unscaled["message"])
    assert scaled["loss_scaler"] == {"scaling": "dynamic", "scale": 2.0 ** 16, "skipped_steps": 0}
    assert unscaled["loss_scaler"]["scaling"].startswith("none")
    assert "loss_scaler" not in runner.run(job(dtype="bfloat16"))


def test_every_method_that_owns_its_step_states_its_loss_scaling():
    for name in available():
        cls = type(load(name))
        if cls.train_step is Method.train_step:
            assert cls.loss_scaling is True, name
            continue
        owner = next(c for c in cls.__mro__ if "train_step" in vars(c))
        declarer = next(c for c in cls.__mro__ if "loss_scaling" in vars(c))
        assert declarer is not Method and issubclass(declarer, owner), name


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("kw", [dict(dtype="float16", hparams=FP16_EPS),
                                dict(dtype="float16", precision="mixed"),
                                dict(dtype="bfloat16", precision="mixed")],
                         ids=["float16", "mixed-float16", "mixed-bfloat16"])
def test_simulated_equals_tracked(model, kw):
    real = runner.run(job(model=model, **kw))
    fake = runner.run(job(model=model, simulate=True, **kw))
    assert real["status"] == fake["status"] == "ok", (real.get("message"), fake.get("message"))
    assert fake["memory"]["tier"] == "simulated"
    for c in CATEGORIES:
        assert fake["memory"][f"{c}_bytes"] == real["memory"][f"{c}_bytes"], c


MIXED_FP32 = "precision: mixed needs dtype bfloat16 or float16"


def test_mixed_with_float32_is_a_config_error_naming_the_key():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["suites"]["quick"].update(precision="mixed")  # dtype left at float32
    plan.validate_schema(config)
    with pytest.raises(plan.ConfigError, match=f"config key suites/quick/precision: {MIXED_FP32}"):
        plan.plan(config)
    good = copy.deepcopy(config)
    good["suite"] = "smoke"
    good["suites"]["smoke"].update(precision="mixed", dtype="bfloat16")
    jobs = plan.plan(good)
    assert jobs and all("-mixed" in p for p in jobs)
    assert {(j.precision, j.dtype) for j in jobs.values()} == {("mixed", "bfloat16")}


def test_mixed_with_float32_is_refused_by_run_and_fit(capsys):
    from bench import fit, run

    with pytest.raises(SystemExit):
        run.job_from_args(run.parser().parse_args(
            ["--kind", "memory", "--method", "adamw", "--model", "gpt2-tiny", "--batch-size", "2",
             "--seq-len", "8", "--precision", "mixed", "--out", "x.json"]))
    assert MIXED_FP32 in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit.main(["--model", "gpt2-tiny", "--dtype", "float32", "--precision", "mixed"])
    assert f"--precision: {MIXED_FP32}" in capsys.readouterr().err
    record = runner.run(job(precision="mixed"))  # a job built by hand: an error row
    assert record["status"] == "error" and MIXED_FP32 in record["message"]


def test_fit_takes_float16_and_mixed_and_says_so():
    from bench import fit

    args = fit.parser().parse_args(["--model", "gpt2-tiny", "--dtype", "float16", "--precision", "mixed"])
    assert (args.dtype, args.precision) == ("float16", "mixed")
    row = {"model": "gpt2-tiny", "method": "adamw", "batch_size": 2, "seq_len": 8, "dtype": "float16",
           "precision": "mixed", "n_params": 10, "status": "ok", "memory_gb": 1, "fits": True,
           "predicted_gpu_bytes": 2**20, "largest_batch": 4, "peak_bytes": 100,
           **{f"{c}_bytes": 20 for c in CATEGORIES}}
    text = fit.table([row])
    assert "mixed precision (float32 parameters" in text and "float16 compute under autocast" in text
