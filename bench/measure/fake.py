"""The simulated tier's fake tensors: PyTorch's `FakeTensorMode`, with its dispatch cache's
key built faster.

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
differently fails that test, not a result)."""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# The types PyTorch's walk keys as (type, value) (its last branch)
_PLAIN = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


class FakeMode(FakeTensorMode):
    """`FakeTensorMode` with `_prep_args_for_hash` (the key's argument walk) done directly for
    the common arguments; see the module docstring."""

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
            elif (kind is FakeTensor and arg.fake_mode is self and arg.constant is None
                  and arg.layout is torch.strided and not arg._has_symbolic_sizes_strides):
                _metadata(result, arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                # one argument as an iterator, not a sequence: PyTorch's walk keys it without a
                # sequence's type and length
                FakeTensorMode._prep_args_for_hash(self, result, iter((arg,)), state, id_hashed_objects)


def _metadata(result: list, t: FakeTensor) -> None:
    """What `extract_tensor_metadata(t)._flatten_into(result, ...)` appends for a dense tensor
    of concrete sizes: its fields in order, the shape and strides as the walk keys a
    sequence (its type, its length, then (int, value) per element)."""
    shape, stride = t.shape, t.stride()
    # (a tensor of other than 4 or 5 dimensions has no channels-last format to suggest)
    memory_format = suggest_memory_format(t) if len(shape) in (4, 5) else torch.contiguous_format
    if not t.is_contiguous(memory_format=memory_format):
        memory_format = None
    append = result.append
    append(t.dtype)
    append(torch.Size)
    append(f"length_{len(shape)}")
    for n in shape:
        append(int)
        append(n)
    append(tuple)
    append(f"length_{len(stride)}")
    for n in stride:
        append(int)
        append(n)
    # device, layout, memory format, storage offset and bytes, requires_grad, is_quantized,
    # is_conj, is_neg, is_inference, is_sparse, is_coalesced, dense_dim, sparse_dim
    result += (t.device, torch.strided, memory_format, t.storage_offset(), t.untyped_storage().nbytes(),
               t.requires_grad, t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(), False, None, None, None)

