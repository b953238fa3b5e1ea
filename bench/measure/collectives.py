"""What a data-parallel training step sends between ranks: per step and per rank, the bytes
of each collective of a scheme (FSDP2, DeepSpeed ZeRO 1-3, DDP-style replicas), from the
parameters' sizes alone. Pure arithmetic: `bench.estimate.collective_seconds` turns the
bytes into an estimated time.

A collective is counted twice over (`Collective`):

- `buffer_bytes`: the collective's whole tensor, summed over its calls in one
  forward-backward pass (FSDP2's groups, DeepSpeed's and DDP's buckets): an all-gather's
  output, a reduce-scatter's input, an all-reduce's tensor;
- `wire_bytes`: what each rank sends per step (as much again arrives) under a ring
  algorithm (NCCL's ring) on W ranks, `times` calls a step:

      all-gather, reduce-scatter:  (W - 1) / W x buffer
      all-reduce (a reduce-scatter, then an all-gather):  2 (W - 1) / W x buffer

  in whole bytes, rounded down. W = 1 sends nothing.

`times` is per training step. A step of `passes` forward-backward passes (the method's
`micro_batches`, `bench.method.accumulate`) gathers and reduces in each pass, as each scheme
does when its skip-sync switch is not used (FSDP2 `set_requires_gradient_sync(False)`, DDP
`no_sync`), except ZeRO stage 1, which reduces once, at the accumulation boundary
(DeepSpeed `engine.py` `allreduce_gradients`).

The schemes, as the suite runs or models them:

- FSDP2 (`fsdp`; torch 2.13 `torch/distributed/fsdp/_fully_shard/`), sharded as torchtitan
  shards (`bench.measure.sharded.shard`: every transformer block, then the root).
  `reshard_after_forward` is left at its default, None, which FSDP2 resolves to True for
  the blocks and False for the root (`FSDPState._lazy_init`: the root's parameters would be
  gathered again at once). Per pass: the forward all-gathers every group (`foreach_all_gather`:
  W x the group's padded shards, `padded_numel` x element size); backward all-gathers the
  blocks again (resharded after forward), not the root; backward reduce-scatters each group's
  gradients (`foreach_reduce`: each gradient padded to ceil(d0 / W) x W rows, W x the rank's
  gradient shards), of the trainable parameters only. Parameters are gathered in their
  dtype, or under mixed precision in the compute dtype (FSDP2's `MixedPrecisionPolicy` as
  `sharded.shard` sets it: `gather_itemsize`); gradients are reduced in the parameters'
  dtype (float32 under mixed precision).
- DeepSpeed ZeRO (`zero`; 0.19.8 with its defaults, read in `deepspeed/runtime/zero/`, and the
  layout of `bench.measure.zero`: one flat group, frozen parameters whole on every rank):
  stage 1 and 2 all-reduce the gradients (`use_multi_rank_bucket_allreduce` true by default:
  `stage_1_and_2.py` `average_tensor` puts every slice into one all-reduce per bucket; with it
  false, a reduce to each partition's owner: a reduce-scatter's volume) and, after the
  optimizer step, all-gather the updated flat parameter partitions (`all_gather_dp_groups`:
  the flat buffer padded to 2 x W, `zero.flat_padded_numel`). Stage 3 all-gathers each
  parameter (padded to a multiple of W) before its forward and again before its backward, as
  the ZeRO paper counts it, and reduce-scatters its gradient (`reduce_scatter_coalesced`);
  parameters of at most `param_persistence_threshold` elements stay whole, are not gathered
  for use, and are all-gathered once after the step (`stage3.py` `_post_step`). DeepSpeed
  keeps a gathered parameter whose next use lies within `stage3_max_reuse_distance` (1e9
  elements by default: `partitioned_param_coordinator.py` `__params_to_release`), which
  skips the backward gather of a model under about half a billion parameters (from a
  block's forward to its backward the trace holds fewer elements; everything stays gathered
  through the step): stage 3's figure is then an upper bound, 3/2 of what DeepSpeed sends. Gradients are
  communicated in the model's dtype (`communication_data_type` by default).
- Replicas (`sharding: none`, DDP): one all-reduce of the trainable gradients per pass
  (bucketed, `bucket_cap_mb` 25, the same bytes).

The ZeRO paper's volumes (Rajbhandari et al. 2020, section 7): data parallelism and ZeRO
stage 1/2 send 2 x the parameters' bytes a step per rank (W large), stage 3 3 x. DeepSpeed
0.19.8's default all-reduce makes stage 1/2 3 x (2 x with `multi_rank_allreduce=False`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from bench.measure import zero

# op -> the multiple of (W - 1) / W x buffer each rank sends, ring algorithm
RING = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclass(frozen=True)
class Collective:
    op: str  # all_gather, reduce_scatter, all_reduce
    when: str  # forward, backward, after_step
    buffer_bytes: int  # one pass's buffers (all groups or buckets together)
    times: int  # calls per training step


def wire_bytes(op: str, buffer_bytes: int, world_size: int) -> int:
    """Bytes each rank sends for one collective of `buffer_bytes` on `world_size` ranks,
    ring algorithm (`RING`); rounded down."""
    return RING[op] * buffer_bytes * (world_size - 1) // world_size


def summary(collectives: list[Collective], world_size: int, scheme: str) -> dict:
    """A step's collectives as a result's `sharding.collectives`: each (with its
    `wire_bytes` per step), and the step's totals, `buffer_bytes` and `wire_bytes`."""
    rows = [{**asdict(c), "wire_bytes": c.times * wire_bytes(c.op, c.buffer_bytes, world_size)}
            for c in collectives if c.buffer_bytes and c.times]
    return {"scheme": scheme, "world_size": world_size, "per": "training step, one rank", "ops": rows,
            "buffer_bytes": sum(r["buffer_bytes"] * r["times"] for r in rows),
            "wire_bytes": sum(r["wire_bytes"] for r in rows)}


def fsdp_group(name: str) -> str:
    """The FSDP group of a parameter, from its name: the transformer block it is in (the
    name up to its first numeric part, "transformer.h.3"), or "" (the root) outside the
    blocks. The same cut as `bench.measure.sharded.blocks` for the suite's models."""
    parts = name.split(".")
    cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return "" if cut is None else ".".join(parts[:cut + 1])


def fsdp(shards: list[dict], world_size: int, passes: int = 1, grad_shard_bytes: int | None = None,
         gather_itemsize: int | None = None) -> dict:
    """FSDP2's collectives per step (module docstring), from a rank's `shards`
    (`sharded.measure_rank`: per parameter its `name`, `padded_numel`, `element_size`).
    The reduce-scatter's buffer is W x the rank's gradient shards: `grad_shard_bytes` where
    some parameters are frozen (a result's gradient bytes as the update begins), else every
    shard's padded bytes. `gather_itemsize`: the bytes of an element as gathered (mixed
    precision's compute dtype), if not the parameters' own."""
    padded, gathered = {}, {}
    for s in shards:
        group = fsdp_group(s["name"])
        padded[group] = padded.get(group, 0) + s["padded_numel"] * s["element_size"]
        gathered[group] = gathered.get(group, 0) + s["padded_numel"] * (gather_itemsize or s["element_size"])
    every = world_size * sum(gathered.values())
    blocks = world_size * sum(b for g, b in gathered.items() if g)  # the root is not resharded after forward
    grads = world_size * (sum(padded.values()) if grad_shard_bytes is None else grad_shard_bytes)
    return summary([Collective("all_gather", "forward", every, passes),
                    Collective("all_gather", "backward", blocks, passes),
                    Collective("reduce_scatter", "backward", grads, passes)], world_size, "fsdp")


def zero_stage(params: list[tuple], cfg: zero.ZeroConfig, passes: int = 1,
               multi_rank_allreduce: bool = True) -> dict:
    """DeepSpeed ZeRO's collectives per step (module docstring) for `params`, (numel,
    element size, trainable) per parameter (`zero.Timeline.params`), at stage `cfg.stage`
    on `cfg.world_size` ranks. `multi_rank_allreduce`: DeepSpeed's
    `use_multi_rank_bucket_allreduce` (stage 1/2's gradients all-reduced, else reduced to
    each partition's owner)."""
    trainable = [(n, e) for n, e, t in params if t]
    if not trainable:
        return summary([], cfg.world_size, f"zero{cfg.stage}")
    e, w = trainable[0][1], cfg.world_size
    if cfg.stage in (1, 2):
        grads = sum(n for n, _ in trainable) * e
        reduce = "all_reduce" if multi_rank_allreduce else "reduce_scatter"
        steps = [Collective(reduce, "backward", grads, 1 if cfg.stage == 1 else passes),
                 Collective("all_gather", "after_step",
                            zero.flat_padded_numel([n for n, _ in trainable], w) * e, 1)]
    else:
        def gathered(n):
            return zero.stage3_partition_numel(n, w) * w * e

        used = sum(gathered(n) for n, _ in trainable if not zero.persistent(n, cfg))
        steps = [Collective("all_gather", "forward", used, passes),
                 Collective("all_gather", "backward", used, passes),
                 Collective("reduce_scatter", "backward", sum(gathered(n) for n, _ in trainable), passes),
                 Collective("all_gather", "after_step",
                            sum(gathered(n) for n, _ in trainable if zero.persistent(n, cfg)), 1)]
    return summary(steps, w, f"zero{cfg.stage}")


def replicas(params: list[tuple], world_size: int, passes: int = 1) -> dict:
    """DDP's all-reduce of the trainable gradients per step, for `params` (numel, element
    size, trainable) per parameter."""
    grads = sum(n * e for n, e, t in params if t)
    return summary([Collective("all_reduce", "backward", grads, passes)], world_size, "none")
