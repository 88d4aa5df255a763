"""Drop-in replacements for ``torch.nn.Conv2d`` and ``torch.nn.GRU`` that run
on ddpx's ops, and ``convert`` / ``revert`` to swap them into a model.

``TiledConv2d`` and ``FusedGRU`` subclass the torch modules: same constructor
arguments, parameter names, shapes and initialisation, so state_dicts load
either way and ``isinstance(m, nn.Conv2d)`` still holds. Only ``forward``
differs: it calls ``torch.ops.ddpx.tiled_conv2d`` (eager: the same op through
``ddpx._C``, see ``ddpx.ops``) / ``torch.ops.ddpx.fused_gru``.
Both script (``torch.jit.script``), trace, ``torch.compile`` and
``torch.export`` (the ops have autograd and Meta kernels).
"""
from typing import Final, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.common_types import _size_2_t
from torch.overrides import has_torch_function

from . import ops as _ops

__all__ = ["TiledConv2d", "FusedGRU", "convert", "revert"]


class TiledConv2d(nn.Conv2d):
    """``nn.Conv2d`` on ``torch.ops.ddpx.tiled_conv2d``.

    Every ``nn.Conv2d`` argument works: ``padding`` an int, a pair, ``'same'``
    or ``'valid'``; every ``padding_mode``; unbatched ``[C_in, H, W]`` input.
    The op takes only a symmetric zero padding, so whatever else the padding
    asks for is done first by ``F.pad``, as ``nn.Conv2d`` does for a
    non-``'zeros'`` padding_mode.
    """

    # Derived once from nn.Conv2d's attributes by _setup_padding(), as
    # nn.Conv2d derives _reversed_padding_repeated_twice (Final: TorchScript
    # bakes them into the scripted code as constants):
    _pre_pad: Final[List[int]]  # F.pad amounts, last dim first; [] = none
    _pre_pad_mode: Final[str]  # F.pad mode: "constant" or padding_mode
    _op_padding: Final[List[int]]  # the op's symmetric zero padding [pH, pW]

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size_2_t,
                 stride: _size_2_t = 1, padding: Union[str, _size_2_t] = 0,
                 dilation: _size_2_t = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device=device, dtype=dtype)
        self._setup_padding()

    def _setup_padding(self) -> None:
        """Splits the padding into F.pad + the op's padding, once: the same
        split nn.Conv2d._conv_forward and F.conv2d(padding='same') make."""
        pre: List[int] = []
        mode = "constant"
        op = [0, 0]
        if self.padding_mode != "zeros":
            # nn.Conv2d pads with padding_mode (including 'same''s amounts)
            # and convolves with padding 0.
            if any(p != 0 for p in self._reversed_padding_repeated_twice):
                pre = list(self._reversed_padding_repeated_twice)
                mode = self.padding_mode
        elif self.padding == "same":
            # ATen's 'same': a total of d*(k-1), the smaller half on both
            # sides by the conv, the odd one extra on the right/bottom by a pad.
            # _reversed_padding_repeated_twice is [W left, W right, H top, H bottom].
            r = self._reversed_padding_repeated_twice
            op = [r[2], r[0]]
            extra = [0, r[1] - r[0], 0, r[3] - r[2]]
            if any(e != 0 for e in extra):
                pre = extra
        elif self.padding != "valid":
            op = [int(p) for p in self.padding]
        self._pre_pad = pre
        self._pre_pad_mode = mode
        self._op_padding = op

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        # input [N, C_in, H, W] or [C_in, H, W] -> [N, C_out, H', W'] or [C_out, H', W']
        if not torch.jit.is_scripting():
            if not torch.compiler.is_compiling() and has_torch_function((input, weight, bias)):
                # FX proxies, subclasses, __torch_function__ modes: no Python
                # branch on the input (FX cannot trace one); the op takes a
                # 3-D input as it is and checks the rest.
                x = F.pad(input, self._pre_pad, mode=self._pre_pad_mode) if self._pre_pad else input
                return torch.ops.ddpx.tiled_conv2d(x, weight, bias, list(self.stride),
                                                   self._op_padding, list(self.dilation),
                                                   self.groups)
        if input.dim() != 3 and input.dim() != 4:
            raise ValueError("TiledConv2d: input must be 4-D [N, C_in, H, W] or 3-D [C_in, H, W] "
                             "(unbatched), got {}-D".format(input.dim()))
        if not torch.jit.is_scripting():
            # Eager: the op's direct entry (ddpx.ops._fast_ok says when).
            if len(self._pre_pad) == 0 and _ops._fast_ok(input, weight, bias):
                return _ops._C.tiled_conv2d(input, weight, bias, self.stride, self._op_padding,
                                            self.dilation, self.groups)
        unbatched = input.dim() == 3
        x = input.unsqueeze(0) if unbatched else input
        if len(self._pre_pad) > 0:
            x = F.pad(x, self._pre_pad, mode=self._pre_pad_mode)
        out = torch.ops.ddpx.tiled_conv2d(x, weight, bias, list(self.stride), self._op_padding,
                                          list(self.dilation), self.groups)
        return out.squeeze(0) if unbatched else out

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight, self.bias)


class FusedGRU(nn.GRU):
    """``nn.GRU`` on ``torch.ops.ddpx.fused_gru`` (``torch._VF.gru``'s
    semantics), for Tensor input, batched ``[T, B, I]`` (``[B, T, I]`` with
    ``batch_first``) or unbatched ``[T, I]``; ``forward(input, hx=None)``
    returns ``(output, h_n)``.

    The parameter list is built from the attributes on every call, never
    kept: a list attribute (what nn.GRU's ``_flat_weights`` is once scripted)
    holds the tensors it was made with and misses a parameter replaced later
    (assigned a new tensor, from Python or C++).
    Not supported: ``PackedSequence`` input (the op has no packed path) and
    ``proj_size`` (nn.GRU has none either).

    ``torch.compile`` breaks the graph at any ``nn.GRU`` instance, this one
    included, and runs it eagerly (on the op all the same); set
    ``torch._dynamo.config.allow_rnn = True`` to compile it into the graph
    (``fullgraph=True`` needs that). ``torch.export`` needs nothing.
    """

    #: TorchScript cannot read attributes by a computed name, so the scripted
    #: parameter list (_script_flat_weights) is written out up to this depth.
    SCRIPT_MAX_LAYERS: Final[int] = 4

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, device=None, dtype=None) -> None:
        if proj_size != 0:
            raise ValueError("FusedGRU: proj_size must be 0 (a GRU has no projection, nor has "
                             "ddpx.fused_gru), got {}".format(proj_size))
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device=device, dtype=dtype)

    def __prepare_scriptable__(self) -> "FusedGRU":
        # torch.jit.script calls this first: refuse what _script_flat_weights
        # does not cover here rather than fail later with a wrong list.
        if self.num_layers > self.SCRIPT_MAX_LAYERS:
            raise ValueError("FusedGRU: torch.jit.script supports num_layers <= {}, got {} "
                             "(eager, torch.compile and torch.export have no limit)".format(
                                 self.SCRIPT_MAX_LAYERS, self.num_layers))
        return self

    def _script_flat_weights(self) -> List[Tensor]:
        """The _flat_weights order (per layer and direction: w_ih, w_hh[, b_ih,
        b_hh]) with literal names: hasattr on a module is resolved when
        scripting, so the scripted code reads exactly this layer's parameters."""
        p: List[Tensor] = []
        if hasattr(self, "weight_ih_l0"):
            p += [self.weight_ih_l0, self.weight_hh_l0]
        if hasattr(self, "bias_ih_l0"):
            p += [self.bias_ih_l0, self.bias_hh_l0]
        if hasattr(self, "weight_ih_l0_reverse"):
            p += [self.weight_ih_l0_reverse, self.weight_hh_l0_reverse]
        if hasattr(self, "bias_ih_l0_reverse"):
            p += [self.bias_ih_l0_reverse, self.bias_hh_l0_reverse]
        if hasattr(self, "weight_ih_l1"):
            p += [self.weight_ih_l1, self.weight_hh_l1]
        if hasattr(self, "bias_ih_l1"):
            p += [self.bias_ih_l1, self.bias_hh_l1]
        if hasattr(self, "weight_ih_l1_reverse"):
            p += [self.weight_ih_l1_reverse, self.weight_hh_l1_reverse]
        if hasattr(self, "bias_ih_l1_reverse"):
            p += [self.bias_ih_l1_reverse, self.bias_hh_l1_reverse]
        if hasattr(self, "weight_ih_l2"):
            p += [self.weight_ih_l2, self.weight_hh_l2]
        if hasattr(self, "bias_ih_l2"):
            p += [self.bias_ih_l2, self.bias_hh_l2]
        if hasattr(self, "weight_ih_l2_reverse"):
            p += [self.weight_ih_l2_reverse, self.weight_hh_l2_reverse]
        if hasattr(self, "bias_ih_l2_reverse"):
            p += [self.bias_ih_l2_reverse, self.bias_hh_l2_reverse]
        if hasattr(self, "weight_ih_l3"):
            p += [self.weight_ih_l3, self.weight_hh_l3]
        if hasattr(self, "bias_ih_l3"):
            p += [self.bias_ih_l3, self.bias_hh_l3]
        if hasattr(self, "weight_ih_l3_reverse"):
            p += [self.weight_ih_l3_reverse, self.weight_hh_l3_reverse]
        if hasattr(self, "bias_ih_l3_reverse"):
            p += [self.bias_ih_l3_reverse, self.bias_hh_l3_reverse]
        return p

    def forward(self, input: Tensor, hx: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        # input [T, B, I] ([B, T, I] batch_first) or [T, I]; hx [L*D, B, H] or [L*D, H]
        # -> output [T, B, D*H] ([B, T, D*H]) or [T, D*H]; h_n like hx. D = 2 if bidirectional.
        if not torch.jit.is_scripting():
            if isinstance(input, nn.utils.rnn.PackedSequence):
                raise TypeError(
                    "FusedGRU: input must be a Tensor; ddpx.fused_gru has no PackedSequence path. "
                    "Pad it (torch.nn.utils.rnn.pad_packed_sequence) and pass the padded tensor, "
                    "or run this layer as torch.nn.GRU (ddpx.nn.revert)")
        if input.dim() != 2 and input.dim() != 3:
            raise ValueError("FusedGRU: input must be 3-D [seq, batch, input_size] ([batch, seq, "
                             "input_size] with batch_first) or 2-D [seq, input_size] (unbatched), "
                             "got {}-D".format(input.dim()))
        if hx is not None and hx.dim() != input.dim():
            raise ValueError("FusedGRU: hx must be {}-D like input [num_layers*num_directions, "
                             "{}hidden_size], got {}-D".format(
                                 input.dim(), "batch, " if input.dim() == 3 else "", hx.dim()))
        if torch.jit.is_scripting():
            params = self._script_flat_weights()
        else:
            # Not compiled by TorchScript (is_scripting() is resolved then).
            # getattr rather than self._flat_weights: right under parametrizations too.
            params = [getattr(self, name) for name in self._flat_weights_names]
        return torch.ops.ddpx.fused_gru(input, hx, params, self.bias, self.num_layers,
                                        float(self.dropout), self.training, self.bidirectional,
                                        self.batch_first)


# The swaps of convert() and revert(): the exact class -> its replacement.
_TO_DDPX = {nn.Conv2d: TiledConv2d, nn.GRU: FusedGRU}
_TO_TORCH = {TiledConv2d: nn.Conv2d, FusedGRU: nn.GRU}
_DDPX_ONLY_ATTRS = ("_pre_pad", "_pre_pad_mode", "_op_padding")


def _swap_class(module: nn.Module, table: dict) -> None:
    new_cls = table.get(type(module))
    if new_cls is None:
        return
    # The subclass adds no parameter or buffer, so changing the class of the
    # very object keeps its Parameters (an optimizer built before still
    # works), hooks, training mode, device and dtype, and needs no copy.
    module.__class__ = new_cls
    if new_cls is TiledConv2d:
        module._setup_padding()
    elif new_cls is nn.Conv2d:
        for name in _DDPX_ONLY_ATTRS:
            module.__dict__.pop(name, None)


def _walk(module: nn.Module, table: dict) -> nn.Module:
    for child in module.modules():  # the root and every descendant, each once
        _swap_class(child, table)
    return module


def convert(module: nn.Module) -> nn.Module:
    """Turns every ``nn.Conv2d`` into a ``TiledConv2d`` and every ``nn.GRU``
    into a ``FusedGRU`` in ``module`` and its descendants, in place, and
    returns the root (itself a converted layer if it was one), like
    ``nn.SyncBatchNorm.convert_sync_batchnorm``.

    Only those exact classes are converted (a subclass may override forward);
    the layers keep the very same Parameter objects, training mode, device,
    dtype and hooks. Call it before ``torch.jit.script`` / ``torch.compile``.
    """
    return _walk(module, _TO_DDPX)


def revert(module: nn.Module) -> nn.Module:
    """The inverse of ``convert``: ``TiledConv2d`` -> ``nn.Conv2d`` and
    ``FusedGRU`` -> ``nn.GRU`` in place, e.g. before ``torch.save(model)``
    so that a checkpoint loads where ddpx is not installed."""
    return _walk(module, _TO_TORCH)
