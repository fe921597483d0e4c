"""A decoding call's replay entered at :func:`sparse_attn.attention`, above its checks and op layers.

:mod:`.replay` launches a recorded short forward again from inside ``launch.forward``; before it gets there a
decoding call has passed ``attention()``'s checks, ``device_plan_attention_op``'s prologue and ``forward_op``: about
half of the call's host time on the H200 (benchmarks/NOTES.md, "The integration's host path in eager decoding").
Each of those steps is a function of the call's geometry and arguments alone. So the first call of a geometry takes
them, and ``launch.forward`` reports the replay key it computed (:func:`launch.take_replay_key`); the geometry's
later calls (a model's other layers within a step) look that key up here, by their own arguments, and run the kept
recipe (:func:`replay.kept`) directly: the same kernels on the same arguments as the path, so the same bits.

The key here holds what those steps read: the three inputs' shapes, strides, dtypes, devices and 16-byte alignment,
which of them are one tensor, the call's ``causal`` / ``scale`` / ``return_lse`` / ``window`` / ``num_sink``, the
launch module's settings and the current device. Only forward-only 16-bit CUDA calls without a layout reach it
(``api.attention`` checks the rest), of at most ``launch.SMALL_Q_ROWS`` query rows, outside torch.compile, with
plain argument types. During a streak of new geometries (a cache growing under one call a step, where nothing
replays) it computes no key at all. ``replay.ENABLED`` turns it off with the replay.
"""
from __future__ import annotations

import torch

from ...plan_cache import PlanCache
from .. import fast_launch
from . import launch, replay

_keys = PlanCache(replay.MAX_KEPT)  # this module's key -> the launch's replay key
_stand_ins: dict = {}  # device -> the int32 stand-in the device plan passes for its schedule (never read)


def key(q, k, v, causal, scale, return_lse, window, num_sink) -> tuple | None:
    """This call's key, or None where the entry does not serve it (the caller takes its path)."""
    if not replay.ENABLED or replay.streaking():
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if (type(causal) is not bool or (scale is not None and type(scale) is not float)
            or (window is not None and type(window) is not int) or type(num_sink) is not int):
        return None
    if q.dim() != 4 or not 0 < q.shape[2] <= launch.SMALL_Q_ROWS or torch.compiler.is_compiling():
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():  # (the stand-in is allocated outside captures)
        return None
    launch.take_replay_key()  # an earlier call's, left where its path computed one and nothing took it
    return (replay.geometry(q), replay.geometry(k), replay.geometry(v), k is q, v is q, v is k, causal, scale,
            bool(return_lse), window, num_sink, launch._replay_settings(), fast_launch._device() if q.is_cuda else None)


def run(k: tuple, q, kk, v, return_lse):
    """The call of key ``k`` (from :func:`key`) through its kept recipe, or None (not learnt, not kept, or replay
    unusable now)."""
    launch_key = _keys.find(k)
    recipe = None if launch_key is None else replay.kept(launch_key)
    if recipe is None or not replay.usable():
        return None
    st = _stand_in(q.device)
    out, lse = replay.run(recipe, (q, kk, v, st, st, st, st, st, st, None, None), q.device)
    return (out, lse) if return_lse else out


def learn(k: tuple, q, kk, v) -> None:
    """After the path ran the call of key ``k``: remember the replay key ``launch.forward`` computed for it, if it
    ran on these very tensors (the op's prologue copies a tensor whose head dim is not unit-stride) with the other
    inputs :func:`run` hands the recipe: one int32 ``[1]`` stand-in in the six schedule places, no offsets."""
    last = launch.take_replay_key()
    if last is None or last[1] != (id(q), id(kk), id(v)):
        return
    if last[0][0][3:] == (replay.geometry(_stand_in(q.device)), 3, 3, 3, 3, 3, None, None):
        _keys.put(k, last[0])


def _stand_in(device: torch.device) -> torch.Tensor:
    st = _stand_ins.get(device)
    if st is None:
        st = _stand_ins[device] = torch.empty(1, dtype=torch.int32, device=device)
    return st


def clear() -> None:
    _keys.clear()
