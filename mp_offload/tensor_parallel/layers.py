"""Megatron-style parallel layers: column/row-parallel linear and vocab-parallel embedding.

Initialisation is TP-invariant: each layer builds the *full* master weight in fp32
on the CPU from the default generator, then keeps its own slice, so a model built
with TP=1 and one built with TP=k from the same seed hold identical weights.

With ``sequence_parallel`` the activations between the layers are sequence shards
[b, s/T, h]: a column-parallel layer gathers its input along the sequence (and keeps
only the shard for backward), a row-parallel layer reduce-scatters its output, and the
vocab-parallel embedding can reduce-scatter too. Parameters that then see only a shard
of the tokens while being replicated (row-parallel biases; the norms built by the model)
carry ``sequence_parallel = True``; ``register_sequence_parallel_grad_hooks`` sums
their gradients over the TP group (DESIGN.md §2, reader 4).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state as ps
from .mappings import (
    _all_reduce,
    copy_to_tp_region,
    gather_from_tp_region,
    gather_sequence,
    reduce_from_tp_region,
    reduce_scatter_from_tp_region,
    reduce_scatter_sequence,
    scatter_to_tp_region,
)
from .utils import divide, set_tensor_model_parallel_attributes, split_for_rank

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_normal(std: float) -> InitMethod:
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def scaled_init_normal(std: float, num_layers: int) -> InitMethod:
    """GPT-2's residual-projection init: std / sqrt(2 * layers)."""
    return init_normal(std / math.sqrt(2.0 * num_layers))


def resolve_tp_group(group: ps.ParallelGroup | None) -> ps.ParallelGroup:
    """``None``: the TP group of the initialised parallel state (raises before it exists)."""
    if group is None:
        return ps.get_tensor_model_parallel_group()
    if not isinstance(group, ps.ParallelGroup):
        raise TypeError(f"tp_group must be a ParallelGroup, got {type(group).__name__}")
    return group


def _init_partition(
    param: torch.Tensor,
    full_shape: tuple[int, ...],
    partition_dim: int,
    stride: int,
    init_method: InitMethod | None,
    group: ps.ParallelGroup,
    valid_rows: int | None = None,
) -> None:
    """Build the full weight once, keep this rank's slice.

    ``valid_rows``: only the first rows are drawn and the rest (vocabulary padding) are
    zero, so the draw does not depend on how much padding this TP size needs.
    """
    if param.device.type == "meta":
        return
    full = torch.zeros(full_shape, dtype=torch.float32)
    if init_method is not None:
        init_method(full[:valid_rows] if valid_rows is not None else full)
    part = split_for_rank(full, partition_dim, group.size, group.rank, stride)
    with torch.no_grad():
        param.copy_(part)


def _replicated_param(
    shape, dtype, device, zero: bool = True, sequence_parallel: bool = False
) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    if zero and p.device.type != "meta":
        with torch.no_grad():
            p.zero_()
    set_tensor_model_parallel_attributes(p, False, -1, 1)
    p.sequence_parallel = sequence_parallel
    return p


class _SequenceParallelLinear(torch.autograd.Function):
    """y = gather_sequence(x) @ W^T + b for a sequence shard x, keeping only the shard for
    backward (Megatron's sequence-parallel linear): backward gathers x again for the
    weight gradient and reduce-scatters the input gradient. Saving the gathered input
    instead would keep T times the activation memory the shard needs.
    Backward computes in the gradient's dtype, as autocast would."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_sequence(grad.matmul(weight.to(grad.dtype)), ctx.group)
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            full = gather_sequence(x, ctx.group).to(grad.dtype)
            grad_w = flat.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(dim=0)
        return grad_x, grad_w, grad_b, None


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: ps.ParallelGroup
) -> torch.Tensor:
    """A TP-split linear layer fed by sequence shards (see ``_SequenceParallelLinear``)."""
    if group.size == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group)


def register_sequence_parallel_grad_hooks(module: nn.Module, group: ps.ParallelGroup) -> int:
    """Sum the gradients of ``module``'s ``sequence_parallel`` parameters over TP.

    Such a parameter is replicated but each TP rank sees only its shard of the tokens,
    so its gradient is partial. A tensor hook on the parameter (``register_hook``) gets
    the gradient *before* it is accumulated into ``.grad``, so the all-reduced sum is
    what ``.grad`` and every post-accumulate hook (the ZeRO reducer's bucket copy) see:
    nothing downstream has to know about sequence parallelism. Every TP rank runs the
    same graph, so the hooks fire, and their all-reduces are issued, in the same order.
    Returns the number of hooked parameters.
    """
    if group.size == 1:
        return 0
    hooked = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    for p in hooked:
        p.register_hook(functools.partial(_all_reduce, group=group))
    return len(hooked)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split along its output (column) dimension.

    Weight is [output/tp, input]; the input is replicated (its gradient is
    all-reduced in backward); the output stays split unless ``gather_output``.
    ``stride`` is the number of equal blocks a fused weight stacks along the output
    (3 for [q; k; v]): each block is split across the ranks separately, so rank r
    holds [q_r; k_r; v_r] and its output columns are its own heads' q, k and v.
    ``tp_group``: a ``ParallelGroup``; None takes the initialised TP group.
    ``sequence_parallel``: the input is this rank's sequence shard (gathered here).
    ``num_valid``: draw only the first output rows, the rest (vocabulary padding) zero.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        tp_group=None,
        params_dtype=torch.float32,
        device=None,
        sequence_parallel: bool = False,
        num_valid: int | None = None,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        world = self.tp_group.size
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and world > 1
        self.output_size_per_partition = divide(output_size, world, "output size")
        self.weight = nn.Parameter(
            torch.empty(
                self.output_size_per_partition, input_size, dtype=params_dtype, device=device
            )
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        _init_partition(
            self.weight,
            (output_size, input_size),
            0,
            stride,
            init_method or init_normal(0.02),
            self.tp_group,
            valid_rows=num_valid,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, self.tp_group)
        else:
            y = F.linear(copy_to_tp_region(x, self.tp_group), self.weight, self.bias)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split along its input (row) dimension.

    Weight is [output, input/tp]; partial products are all-reduced; the bias is
    replicated and added once, after the reduction. ``sequence_parallel``: the sum is
    reduce-scattered along the sequence instead (the output is this rank's shard), and
    the bias, added to the shard only, is marked ``sequence_parallel``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: InitMethod | None = None,
        tp_group=None,
        params_dtype=torch.float32,
        device=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        world = self.tp_group.size
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear needs input_is_parallel")
        self.input_size_per_partition = divide(input_size, world, "input size")
        self.weight = nn.Parameter(
            torch.empty(
                output_size, self.input_size_per_partition, dtype=params_dtype, device=device
            )
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        _init_partition(
            self.weight,
            (output_size, input_size),
            1,
            1,
            init_method or init_normal(0.02),
            self.tp_group,
        )
        self.bias = (
            _replicated_param(
                (output_size,), params_dtype, device, sequence_parallel=self.sequence_parallel
            )
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        reduce = reduce_scatter_from_tp_region if self.sequence_parallel else reduce_from_tp_region
        y = reduce(F.linear(x, self.weight), self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the (padded) vocabulary.

    Each rank looks up the ids in its own range [start, end), writes zeros for the
    others, and the partial results are summed across the TP group (``reduce_scatter``:
    summed and split along the sequence, for sequence parallelism).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None = None,
        tp_group=None,
        params_dtype=torch.float32,
        device=None,
        num_valid: int | None = None,
        reduce_scatter: bool = False,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        self.reduce_scatter = reduce_scatter
        world, rank = self.tp_group.size, self.tp_group.rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = divide(num_embeddings, world, "padded vocabulary size")
        self.vocab_start, self.vocab_end = rank * per, (rank + 1) * per
        self.weight = nn.Parameter(
            torch.empty(per, embedding_dim, dtype=params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        _init_partition(
            self.weight,
            (num_embeddings, embedding_dim),
            0,
            1,
            init_method or init_normal(0.02),
            self.tp_group,
            valid_rows=num_valid,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        reduce = reduce_scatter_from_tp_region if self.reduce_scatter else reduce_from_tp_region
        return reduce(out, self.tp_group)
