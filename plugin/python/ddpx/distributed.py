"""DDP communication hooks on ddpx's codecs, for PyTorch's own
``DistributedDataParallel``::

    model = DDP(model)
    model.register_comm_hook(ddpx.distributed.CodecState("int8"), ddpx.distributed.codec_hook)
    # or, with the codec named by the hook (state None: the DDP's group, no overlap)
    model.register_comm_hook(None, ddpx.distributed.int8_hook)

The codecs are GradSync's (one implementation: ``torch.ops.ddpx.compressed_allreduce_packed``),
over any backend (Gloo, NCCL, ddpx_mpi). Each tensor of a bucket is compressed
on its own -- int8's chunks start at its first element, top-k's budget is its
own, PowerSGD works on its matrix -- so what a gradient becomes does not depend
on how DDP bucketed it. Error feedback is kept per bucket (keyed by the
bucket's parameters) and PowerSGD's warm start per parameter. When DDP
rebuilds its buckets after the first step, a bucket whose parameters changed
starts with a zero residual (the first step's leftover is dropped, as
PyTorch's PowerSGD hook does); warm starts carry over.

``CodecState(..., overlap=True)`` (the default but over NCCL) runs the codec
on a thread of its own, over a process group of its own made at construction
(collective: create the state on every rank, as the model), so that
compressing and sending a bucket overlaps the rest of backward as DDP's own
allreduce does. A CUDA bucket is reduced there on a CUDA stream of the
state's own, after the work queued so far on backward's stream (an event),
and DDP's stream waits for the result's event, not the host: the codec
encodes on the GPU and its message goes through host memory (Gloo, ddpx_mpi);
``none`` stages the bucket in 4 MiB chunks whose copies are pipelined with
the wire. Over NCCL (overlap off) the codec runs on the calling thread,
ordered on its current stream.

``none`` is the uncompressed mean: DDP's result bit for bit on two ranks.
"""
import contextlib
import itertools
import queue
import signal
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["CodecState", "codec_hook", "none_hook", "fp16_hook", "bf16_hook", "int8_hook",
           "topk_hook", "powersgd_hook", "dump_trace", "dump_trace_on_signal"]

_serial = itertools.count()


class _Worker:
    """One thread that runs the state's codec calls in the order they came:
    every rank issues the same collectives in the same order on the state's
    own group.

    The thread ends when the worker is collected or, at the latest, at exit,
    after the calls already queued: a daemon thread still inside a torch call
    when the interpreter finalizes is ended by a forced unwind through that
    call's GIL guard, which aborts the process (the quick start's exit code
    134 when its last bucket's future was set just before the exit)."""

    _STOP = object()
    _EXIT_JOIN_S = 60.0  # bounds an exit behind a call stuck on a lost peer

    def __init__(self):
        self._queue: "queue.Queue" = queue.Queue()
        # The thread holds the queue, not the worker: the worker stays collectable.
        thread = threading.Thread(target=_Worker._serve, args=(self._queue,),
                                  name="ddpx-comm-hook", daemon=True)
        thread.start()
        weakref.finalize(self, _Worker._stop, self._queue, thread)

    def submit(self, fn, stream=None) -> torch.futures.Future[torch.Tensor]:
        """fn() on the worker; with `stream` (a CUDA stream), under it: the
        future, made CUDA-aware, records an event on it when completed, which
        the waiter's current stream then waits for."""
        devices = [stream.device] if stream is not None else None
        fut: torch.futures.Future = torch.futures.Future(devices=devices)
        self._queue.put((fn, fut, stream))
        return fut

    @staticmethod
    def _stop(q: "queue.Queue", thread: threading.Thread) -> None:
        q.put(_Worker._STOP)
        if thread is not threading.current_thread():
            thread.join(_Worker._EXIT_JOIN_S)

    @staticmethod
    def _serve(q: "queue.Queue") -> None:
        while True:
            item = q.get()
            if item is _Worker._STOP:
                return
            fn, fut, stream = item
            del item
            if stream is not None:
                # The thread's device is the stream's: leaving the stream's
                # context would otherwise go back to device 0, and make a
                # CUDA context there in a rank that trains on another GPU.
                torch.cuda.set_device(stream.device)
            on = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with on:
                try:
                    # The op releases the GIL while it encodes and waits on the wire.
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001  (handed to DDP's wait)
                    fut.set_exception(e)
            del fn, fut, stream


class CodecState:
    """The state of a ddpx comm hook: the codec (``none``, ``fp16``, ``bf16``,
    ``int8[:chunk]``, ``topk:ratio``, ``powersgd:rank``), the group it reduces
    over (None: the default group) and the keys of the codec's per-bucket and
    per-parameter state.

    overlap: reduce buckets on a thread and a process group of the state's
    own (made here, so every rank must construct the state, in the same
    order), CUDA buckets on a CUDA stream of its own. None: on when the
    group's backend is not NCCL."""

    def __init__(self, codec: str, process_group: Optional[dist.ProcessGroup] = None,
                 overlap: Optional[bool] = None):
        torch.ops.ddpx.codec_stats(codec, "")  # checks the spec: a clear error now
        self.codec = codec
        self.process_group = process_group
        group = process_group if process_group is not None else dist.group.WORLD
        if overlap is None:
            overlap = dist.get_backend(group) != "nccl"
        self._wire_group = None
        self._worker = None
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        if overlap:
            ranks = dist.get_process_group_ranks(group)
            self._wire_group = dist.new_group(ranks=ranks, backend=dist.get_backend(group))
            self._worker = _Worker()
        self._prefix = f"ddp{next(_serial)}"
        # By identity (a tensor's == is elementwise), without keeping it alive.
        self._param_index = WeakIdKeyDictionary()
        self._bucket_keys: Dict[int, str] = {}

    # -- keys ------------------------------------------------------------------
    def _index(self, p: torch.Tensor) -> int:
        i = self._param_index.get(p)
        if i is None:  # first seen in DDP's bucket order: the same on every rank
            i = self._param_index[p] = len(self._param_index)
        return i

    def _keys(self, bucket: dist.GradBucket) -> Tuple[str, List[str]]:
        idx = [self._index(p) for p in bucket.parameters()]
        part_keys = [f"{self._prefix}:p{i}" for i in idx]
        key = f"{self._prefix}:b" + ",".join(map(str, idx))
        old = self._bucket_keys.get(bucket.index())
        if old is not None and old != key:  # DDP rebuilt its buckets
            torch.ops.ddpx.codec_reset(self.codec, old, self._group_name(bucket))
        self._bucket_keys[bucket.index()] = key
        return key, part_keys

    def _group_name(self, bucket: dist.GradBucket) -> str:
        # By name, not "" (which under mpirun is a ddpx_mpi world of its own):
        # the DDP's group, or the state's copy of it.
        group = self._wire_group if self._uses_worker(bucket) else self.process_group
        return (group if group is not None else dist.group.WORLD).group_name

    def _uses_worker(self, bucket: dist.GradBucket) -> bool:
        return self._worker is not None

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The worker's stream on a CUDA device (one per state and device: its
        reductions run one after another, in DDP's bucket order)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    # -- what a user reads -----------------------------------------------------
    def stats(self) -> Dict[str, float]:
        """calls, bytes_sent, bytes_raw (float32) and compression
        (bytes_raw / bytes_sent) of this state's codec on its group so far.
        (Shared by every state with the same codec and group.)"""
        group = self._wire_group if self._worker is not None else self.process_group
        group = group if group is not None else dist.group.WORLD
        calls, sent, raw = torch.ops.ddpx.codec_stats(self.codec, group.group_name)
        return {"calls": calls, "bytes_sent": sent, "bytes_raw": raw,
                "compression": raw / sent if sent else 0.0}

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        flat = bucket.buffer()
        grads = bucket.gradients()
        sizes = [s for g in grads for s in g.shape]
        dims = [g.dim() for g in grads]
        key, part_keys = self._keys(bucket)
        group = self._group_name(bucket)
        codec = self.codec

        def run():
            # Into the bucket, as PyTorch's own hooks leave it: a wrapper that
            # reads the bucket once the future is done (ddp_zero_hook's
            # hook_with_zero_step steps ZeroRedundancyOptimizer on it) sees the mean.
            mean = torch.ops.ddpx.compressed_allreduce_packed(flat, sizes, dims, part_keys, codec,
                                                              key, group)
            return flat.copy_(mean)

        if self._uses_worker(bucket):
            if not flat.is_cuda:
                return self._worker.submit(run)
            # The bucket is complete on backward's current stream once the
            # work queued there so far has run: the worker's stream waits for
            # that, and neither thread blocks for the other.
            stream = self._stream(flat.device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(flat.device))

            def run_after_ready():
                stream.wait_event(ready)
                return run()
            return self._worker.submit(run_after_ready, stream)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(run())
        return fut


def codec_hook(state: CodecState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook of a ``CodecState``: the bucket's mean over the
    state's group through its codec."""
    if not isinstance(state, CodecState):
        raise TypeError("ddpx.distributed.codec_hook: state must be a ddpx.distributed.CodecState, "
                        f"got {type(state).__name__}; or use a named hook (int8_hook, ...)")
    return state.reduce(bucket)


# The named hooks' states when DDP passes None or a process group: one per
# (codec, group), without overlap (it would need a group made collectively).
_default_states: Dict[Tuple[str, Optional[str]], CodecState] = {}


def _named(family: str, default_spec: str):
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if isinstance(state, CodecState):
            if state.codec.split(":")[0] != family:
                raise ValueError(f"ddpx.distributed.{family}_hook: the state's codec is "
                                 f"'{state.codec}'; use codec_hook for it")
            return state.reduce(bucket)
        if state is not None and not isinstance(state, dist.ProcessGroup):
            raise TypeError(f"ddpx.distributed.{family}_hook: state must be None, a "
                            f"ProcessGroup or a CodecState, got {type(state).__name__}")
        k = (default_spec, None if state is None else state.group_name)
        if k not in _default_states:
            _default_states[k] = CodecState(default_spec, state, overlap=False)
        return _default_states[k].reduce(bucket)

    hook.__name__ = f"{family}_hook"
    hook.__qualname__ = hook.__name__
    hook.__doc__ = (f"DDP comm hook: the bucket's mean through ddpx's {family} codec "
                    f"(state None or a process group: '{default_spec}'; a CodecState "
                    f"for another setting or for overlap).")
    return hook


none_hook = _named("none", "none")
fp16_hook = _named("fp16", "fp16")
bf16_hook = _named("bf16", "bf16")
int8_hook = _named("int8", "int8")
topk_hook = _named("topk", "topk:0.01")
powersgd_hook = _named("powersgd", "powersgd:1")


def dump_trace(path: Optional[str] = None) -> str:
    """Writes this process's flight recorder -- its recent collectives on
    ddpx_mpi groups and GradSync's bucket reductions -- in PyTorch's
    flight-recorder dump format, to ``path`` (default
    ``<TORCH_FR_DUMP_TEMP_FILE><rank>``), and returns the path. PyTorch's
    analyzer (``python -m torch.distributed.flight_recorder.fr_trace DIR``)
    and ``ddpx-trace analyze DIR`` read a directory of them."""
    return torch.ops.ddpx.dump_trace(path or "")


def dump_trace_on_signal(signum: int = signal.SIGUSR1) -> None:
    """From now on, signal ``signum`` (default SIGUSR1) makes this process
    write ``dump_trace()``: ``kill -USR1 <pid>`` on a rank that seems stuck."""
    torch.ops.ddpx.dump_trace_on_signal(int(signum))


# ddpx_mpi records its own collectives (and dumps them on a timeout): torch's
# own recorder hook would record them a second time into a buffer of its own.
if hasattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS"):
    dist.distributed_c10d._FR_SELF_RECORDING_BACKENDS.add("ddpx_mpi")
