"""The simulated tier's fake tensors: PyTorch's `FakeTensorMode`, with its dispatch cache's
key built faster and a cache hit's output made faster.

A fake tensor runs each operator on metadata alone, and FakeTensorMode caches an
operator's output metadata by a key made of the operator and its arguments' metadata. On a
simulated training step that key costs about as much as the operator itself: for each
tensor argument PyTorch fills a `TensorMetadata` record and walks it field by field, and
its shape and strides element by element, through its general argument walk. `FakeMode`
builds the same key (the same values in the same order) directly for the arguments a step
passes: plain values (numbers, dtypes, devices, None, strings), lists and tuples of them,
and this mode's own dense fake tensors whose sizes are concrete. Anything else (another
mode's tensor, a constant, a sparse tensor, symbolic sizes, callables) takes PyTorch's own
walk, unchanged. A key equal to PyTorch's means the same cache entries, hits and misses,
hence the same tensors: tests/unit/test_fake.py checks every operator's key of training
steps against PyTorch's (torch 2.13, the pinned version: a torch that builds its key
differently fails that test, not a result).

On a hit, PyTorch makes each output tensor through general code (a generator per size, a
context manager per call, `FakeTensor.__new__` checking its arguments and setting each of
its attributes through descriptors). `FakeMode` makes the same tensor directly where the
sizes are concrete and the output is a new dense tensor (a view shares its input's storage,
as PyTorch's does): the same meta tensor, subclassed with the same dispatch keys, given the
attributes `FakeTensor.__new__` gives it. The same test file checks every hit's output of
those steps against PyTorch's (type, sizes, strides, storage, dispatch keys, attributes).
Per operator it also skips what only debugging reads: the debug log line PyTorch prepares
(a context manager) where that log is off, and its call counter; and, as the tracker, the
guard that keeps torch.compile out of a dispatch mode's frames (no simulated step compiles).

Three operators a step calls often take PyTorch's slow path (outside the cache, an operator
implementation in Python) for reasons that do not hold for them there; `FakeMode` gives each
what that path would: `aten._unsafe_view` (left out of the cache; PyTorch runs its
decomposition, `aten.view`, which `FakeMode` runs through the cache); `item()` of a constant
(`aten._local_scalar_dense`: an optimizer's step count; PyTorch runs it on the number the
constant holds, as `FakeMode` does, without the key); and in-place foreach arithmetic with a
number per tensor (AdamW's step sizes, new at each step: a miss every step), which makes and
returns no tensor and whose checks read the numbers' types, keyed by those types rather than
the values. The same test file checks each against PyTorch's own dispatch at every call of
the training steps."""
from __future__ import annotations

import functools
import logging

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default
_ITEM = torch.ops.aten._local_scalar_dense.default  # `Tensor.item()`
# The types PyTorch's walk keys as (type, value) (its last branch)
_PLAIN = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


class FakeMode(FakeTensorMode):
    """`FakeTensorMode` with `_prep_args_for_hash` (the key's argument walk) done directly for
    the common arguments, and a cache hit's output tensors made directly; see the module
    docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a cached output's device -> (the device its FakeTensor keeps, the attributes it gets)
        self._outputs_on: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: `__torch_dispatch__` is not wrapped in PyTorch's guard that keeps
        torch.compile out of a mode's frames (a guard per operator). No simulated step
        compiles: a method that compiles runs eagerly under a dispatch mode
        (methods/_common/torchao.py)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=fake_tensor.immutable_dict()):
        # FakeTensorMode's, without its call counter (a debugging statistic, a wrapper per
        # operator) and the logging of a TypeError on its way out
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            raise AssertionError(f"FakeTensorMode should not be set when dispatching {func}")
        return self.dispatch(func, types, args, kwargs)

    def dispatch(self, func, types, args=(), kwargs=fake_tensor.immutable_dict()):
        # PyTorch's `dispatch` without its debug log line (a context manager per operator):
        # the same branches in the same order where the log is off
        if (not self.cache_enabled or func in fake_tensor._DISPATCH_META_HANDLERS
                or func in fake_tensor._DISPATCH_HANDLE_DIRECTLY or fake_tensor.log.isEnabledFor(logging.DEBUG)):
            return super().dispatch(func, types, args, kwargs)
        if func is _UNSAFE_VIEW and not kwargs and self._plain(args[0]) and self.shape_env is None:
            # PyTorch leaves it out of the cache and runs its decomposition, `aten.view` (under
            # this mode): that view, through the cache
            return self.dispatch(_VIEW, types, args)
        lists = args and type(args[0]) is list and _number_lists(func)  # (a foreach operator's first is a list)
        if lists and not kwargs and self.shape_env is None and all(
                self._plain(t) for a in args if type(a) is list for t in a if isinstance(t, torch.Tensor)):
            # in-place foreach arithmetic with a number per tensor (AdamW's step sizes, new at
            # every step, so every step would miss the cache): it makes and returns no tensor,
            # and its output (none) and its checks depend on the numbers' types, not values
            args = tuple([type(x)(1) for x in a] if i in lists else a for i, a in enumerate(args))
        if func is _ITEM and not kwargs and self._constant(args[0]):
            # PyTorch leaves an operator on constants out of the cache and runs it on them: the
            # number this one holds (an optimizer's step count)
            with torch._C._DisableTorchDispatch():
                return func(args[0].constant)
        return self._cached_dispatch_impl(func, types, args, kwargs or {})

    def _constant(self, t) -> bool:
        """A fake tensor of this mode with concrete sizes that holds a constant (a tensor made
        from a Python number or list, whose value the mode keeps)."""
        return (type(t) is FakeTensor and t.fake_mode is self and t.constant is not None
                and not t._has_symbolic_sizes_strides)

    def _plain(self, t) -> bool:
        """A dense fake tensor of this mode with concrete sizes and no constant: what the
        key is built directly for (`_metadata`)."""
        return (type(t) is FakeTensor and t.fake_mode is self and t.constant is None
                and t.layout is torch.strided and not t._has_symbolic_sizes_strides)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        """A cache hit's output tensor: what PyTorch's method makes, made directly where
        sizes are concrete (no shape environment) and the output is a new dense tensor."""
        metadata = entry.metadata
        if (self.shape_env is not None or entry.inplace_idx is not None or metadata is None
                or metadata.layout is not torch.strided or metadata.is_conj or metadata.is_neg
                or fake_tensor.FakeTensorConfig.debug):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        made = self._outputs_on.get(metadata.device)
        if made is None:  # the device a FakeTensor keeps for this one, and what __new__ sets
            made = self._outputs_on[metadata.device] = _new_on(self, metadata.device)
        device, attributes = made
        if device.type == "meta":
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        shape, stride = metadata.shape, metadata.stride
        storage = (args[entry.view_idx].untyped_storage()
                   if isinstance(func, torch._ops.OpOverload) and func.is_view else None)
        # a plain meta tensor, made with no mode seeing it (PyTorch's kernel context also
        # marks the fake mode as in a kernel, which only a FakeTensor's reads would see)
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(shape, stride, dtype=metadata.dtype, layout=torch.strided,
                                        device="meta", requires_grad=metadata.requires_grad)
            if storage is not None:  # a view: the input's storage
                empty.set_(storage, metadata.storage_offset, shape, stride)
        out = torch.Tensor._make_subclass(FakeTensor, empty, empty.requires_grad, dispatch_device=True,
                                          device_for_backend_keys=device)
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
        else:
            torch._C._set_throw_on_mutable_data_ptr(out)
        out.__dict__.update(attributes)
        return out

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if not isinstance(args, (list, tuple)):  # a dict of keyword arguments, or its keys and values
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        append = result.append
        append(type(args))
        append(f"length_{len(args)}")
        for arg in args:
            kind = type(arg)
            if kind in _PLAIN:
                append(kind)
                append(arg)
            elif kind is FakeTensor and self._plain(arg):
                _metadata(result, arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                # one argument as an iterator, not a sequence: PyTorch's walk keys it without a
                # sequence's type and length
                FakeTensorMode._prep_args_for_hash(self, result, iter((arg,)), state, id_hashed_objects)


# In-place foreach arithmetic whose checks read its numbers' types alone (`pow_`, `clamp_*`
# and the like are left out: some of their checks read a value, e.g. a negative integer power)
_BY_TYPE = frozenset(f"aten::_foreach_{name}_" for name in ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp"))


@functools.cache
def _number_lists(func) -> tuple[int, ...]:
    """The positions of the lists of numbers (`Scalar[]`) of an in-place foreach arithmetic
    operator that returns nothing (`aten._foreach_div_.ScalarList`); () for any other operator."""
    schema = getattr(func, "_schema", None)
    if not (isinstance(func, torch._ops.OpOverload) and schema.name in _BY_TYPE
            and schema.is_mutable and not schema.returns):
        return ()
    return tuple(i for i, a in enumerate(schema.arguments) if str(a.type) == "List[number]")


def _new_on(mode: FakeMode, device: torch.device) -> tuple[torch.device, dict]:
    """The device a FakeTensor of `mode` keeps for `device` (normalized), and the attributes
    `FakeTensor.__new__` gives a new one (no constant, no real tensor, every memo cleared),
    in its order."""
    device = FakeTensor._normalize_fake_device(device)
    return device, {"_fake_device": device, "fake_mode": mode, "constant": None, "pytype": None,
                    "dispatch_keys": None, "real_tensor": None, **_CLEARED_MEMOS}


# what `FakeTensor.__new__` sets each memo to (a memo is cleared in three attributes)
_CLEARED_MEMOS = {f"_{name}{part}": None
                  for name in ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")
                  for part in ("", "_vc", "_epoch")}


def _metadata(result: list, t: FakeTensor) -> None:
    """What `extract_tensor_metadata(t)._flatten_into(result, ...)` appends for a dense tensor
    of concrete sizes: its fields in order, the shape and strides as the walk keys a
    sequence (its type, its length, then (int, value) per element)."""
    shape, stride = t.shape, t.stride()
    # (a tensor of other than 4 or 5 dimensions has no channels-last format to suggest)
    memory_format = suggest_memory_format(t) if len(shape) in (4, 5) else torch.contiguous_format
    if not t.is_contiguous(memory_format=memory_format):
        memory_format = None
    sizes = [int] * (2 * len(shape))  # (int, n) per dimension
    sizes[1::2] = shape
    result += (t.dtype, torch.Size, f"length_{len(shape)}")
    result += sizes
    sizes[1::2] = stride
    result += (tuple, f"length_{len(stride)}")
    result += sizes
    # device (outside a kernel: its fake device), layout, memory format, storage offset and
    # bytes, requires_grad, is_quantized, is_conj, is_neg, is_inference, is_sparse,
    # is_coalesced, dense_dim, sparse_dim
    result += (t._fake_device, torch.strided, memory_format, t.storage_offset(), t.untyped_storage().nbytes(),
               t.requires_grad, t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(), False, None, None, None)

