"""The ddpx ops with keyword arguments and the defaults of the functions they
mirror (``F.conv2d``, ``torch._VF.gru``, ``dist.all_reduce``). Each is one
call of ``torch.ops.ddpx.*``: traceable and ``torch.compile``-able as the op
itself is. An eager ``tiled_conv2d`` reaches the same op through
``ddpx._C``'s direct entry (``_fast_ok``), as ``F.conv2d`` reaches ATen's."""
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

# The direct entries (plugin/python/fast_ops.cpp), created by the library's
# Python glue; None where the glue was not built (no MPI or no Python
# headers): then every call takes torch.ops.
_C = sys.modules.get("ddpx._C")

__all__ = ["tiled_conv2d", "fused_gru", "compressed_allreduce", "codec_stats", "codec_reset"]


def _fast_ok(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether an eager call may take ddpx._C's direct entry: the same
    dispatcher call as torch.ops less its Python argument matching (7-16 us a call on our 2-core machine).
    Not while torch.compile traces the caller (it must see the op), nor with
    a __torch_function__ override or mode in play (FX's proxies, tensor
    subclasses): torch.ops dispatches those. Callers check
    torch.jit.is_scripting() first (TorchScript cannot compile this)."""
    return (_C is not None and not torch.compiler.is_compiling()
            and not has_torch_function((input, weight, bias)))

_IntOr2 = Union[int, Sequence[int]]


def _pair(v: _IntOr2, name: str) -> List[int]:
    if isinstance(v, int):
        return [v, v]
    v = list(v)
    if len(v) == 1:
        return [v[0], v[0]]
    if len(v) != 2:
        raise ValueError(f"ddpx.ops.tiled_conv2d: {name} must be an int or 2 ints, got {v}")
    return v


def tiled_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 stride: _IntOr2 = 1, padding: _IntOr2 = 0, dilation: _IntOr2 = 1,
                 groups: int = 1) -> torch.Tensor:
    """``F.conv2d`` on ddpx's tiled kernels (CPU and CUDA), with autograd.

    input [N, C_in, H, W] (or unbatched [C_in, H, W]), weight
    [C_out, C_in / groups, kH, kW], bias [C_out] or None. ``padding`` is an
    int or a pair (for ``"same"``/``"valid"`` or another ``padding_mode`` use
    ``ddpx.nn.TiledConv2d``)."""
    if isinstance(padding, str):
        raise ValueError("ddpx.ops.tiled_conv2d: padding must be an int or 2 ints; "
                         "ddpx.nn.TiledConv2d takes 'same' and 'valid'")
    if _fast_ok(input, weight, bias):
        return _C.tiled_conv2d(input, weight, bias, stride, padding, dilation, groups)
    unbatched = input.dim() == 3
    if unbatched:
        input = input.unsqueeze(0)
    out = torch.ops.ddpx.tiled_conv2d(input, weight, bias, _pair(stride, "stride"),
                                      _pair(padding, "padding"), _pair(dilation, "dilation"),
                                      groups)
    return out.squeeze(0) if unbatched else out


def fused_gru(input: torch.Tensor, hx: Optional[torch.Tensor], params: Sequence[torch.Tensor],
              has_biases: bool = True, num_layers: int = 1, dropout: float = 0.0,
              train: bool = False, bidirectional: bool = False,
              batch_first: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch._VF.gru(input, hx, params, has_biases, num_layers, dropout,
    train, bidirectional, batch_first)`` on ddpx's fused kernels, with
    autograd: returns (output, h_n). ``params`` in ``nn.GRU._flat_weights``
    order (per layer and direction: w_ih, w_hh[, b_ih, b_hh]); hx None is
    zeros."""
    return torch.ops.ddpx.fused_gru(input, hx, list(params), has_biases, num_layers, dropout,
                                    train, bidirectional, batch_first)


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    if group is None:
        return ""  # the world: ddpx_mpi under mpirun, else the default group
    return group.group_name


def compressed_allreduce(tensor: torch.Tensor, codec: str = "none", key: str = "",
                         group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks of ``group``, sent through
    ``codec`` (``none``, ``fp16``, ``bf16``, ``int8[:chunk]``, ``topk:ratio``,
    ``powersgd:rank``). Unlike ``dist.all_reduce`` it returns a new tensor
    (the mean, not the sum) and leaves ``tensor`` alone. ``key`` names the
    codec's state kept between calls (error feedback, PowerSGD's warm
    start): one key per tensor, the same on every rank; "" is stateless.
    Every rank calls it in the same order with the same shape and codec."""
    return torch.ops.ddpx.compressed_allreduce(tensor, codec, key, _group_name(group))


def codec_stats(codec: str = "none",
                group: Optional[dist.ProcessGroup] = None) -> Tuple[int, int, int]:
    """(calls, bytes sent, float32 bytes) of ``codec`` on ``group`` so far in
    this process; bytes sent / float32 bytes is the measured compression."""
    calls, sent, raw = torch.ops.ddpx.codec_stats(codec, _group_name(group))
    return calls, sent, raw


def codec_reset(codec: str = "none", key: str = "",
                group: Optional[dist.ProcessGroup] = None) -> None:
    """Drops ``key``'s state ("" : every key) of ``codec`` on ``group``."""
    torch.ops.ddpx.codec_reset(codec, key, _group_name(group))
