"""A decoding call's replay entered at :func:`sparse_attn.attention`, above its checks and op layers.

:mod:`.replay` launches a recorded short forward again from inside ``launch.forward``; before it gets there a
decoding call has passed ``attention()``'s checks, ``device_plan_attention_op``'s prologue and ``forward_op``: about
half of the call's host time on the H200 (benchmarks/NOTES.md, "The integration's host path in eager decoding").
Each of those steps is a function of the call's geometry and arguments alone. So the first call of a geometry takes
them, and ``launch.forward`` reports the replay key it computed (:func:`launch.take_replay_key`); the geometry's
later calls (a model's other layers within a step) look that key up here, by their own arguments, and run the kept
recipe (:func:`replay.kept`, then held in a :class:`Learnt`) directly: the same kernels on the same arguments as the
path, so the same bits. A padded batch's in-place call (integrations._unpad.in_place) is served the same way, what it
learns kept on the batch's Packing (:func:`learn_pairs`, :func:`run_pairs`). A call whose key length is new (a growing
cache's next step, at its first layer) runs the recipe of its family's latest length rewritten for this length
(:func:`_derive`, launch.derive_for_length), where that is shown to be what the path would launch.

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

_keys = PlanCache(replay.MAX_KEPT)  # this module's key -> its Learnt
# a key without the key length (_family) -> the Learnt of its latest length: what a new length derives from
_families = PlanCache(16)
_stand_ins: dict = {}  # device -> the int32 stand-in the device plan passes for its schedule (never read)


def key(q, k, v, causal, scale, return_lse, window, num_sink) -> tuple | None:
    """This call's key, or None where the entry does not serve it (the caller takes its path). Also the key of a
    padded batch's in-place call (integrations._unpad.in_place, ``return_lse`` False: :func:`learn_pairs`), whose
    caller keeps what it learns per batch (the Packing, where the pairs, ``max_q`` / ``max_k`` and the free queries
    are fixed), so the key needs only the call's own geometry and arguments there too."""
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


class Learnt:
    """What the entry keeps for a key: the launch's replay key and, once :mod:`.replay` has kept its recipe, the
    recipe itself, so that a served call hashes no replay key (its ~90 parts took 4.5 us a call on the H200). A
    recipe derived for a new key length (:func:`_derive`) has no replay key: a replay.clear() forgets it."""
    __slots__ = ("launch_key", "recipe", "generation")

    def __init__(self, launch_key: tuple | None, recipe: replay.Recipe | None = None):
        self.launch_key, self.recipe, self.generation = launch_key, recipe, replay.generation()

    def recipe_now(self) -> replay.Recipe | None:
        """The recipe to run now, or None (not recorded yet, or forgotten by replay.clear())."""
        if self.recipe is not None and replay.fresh(self.generation):
            replay.hit()
            return self.recipe
        if self.launch_key is None:
            return None
        self.recipe, self.generation = replay.kept(self.launch_key), replay.generation()
        return self.recipe

    def peek(self) -> replay.Recipe | None:
        """The recipe :meth:`recipe_now` would run, counting no hit (what a new length derives from: a derivation that
        fails leaves replay's streak of new geometries going)."""
        if self.recipe is not None and replay.fresh(self.generation):
            return self.recipe
        found = None if self.launch_key is None else replay._kept.get(self.launch_key)
        return found if type(found) is replay.Recipe else None


def run(k: tuple, q, kk, v, return_lse):
    """The call of key ``k`` (from :func:`key`) through its kept recipe, or None (not learnt, not kept, or replay
    unusable now)."""
    learnt = _keys.find(k)
    if learnt is None:
        learnt = _derive(k, q, kk, v)
    recipe = None if learnt is None else learnt.recipe_now()
    if recipe is None or not replay.usable():
        return None
    st = _stand_in(q.device)
    out, lse = replay.run(recipe, (q, kk, v, st, st, st, st, st, st, None, None), q.device, return_lse)
    return (out, lse) if return_lse else out


def learn(k: tuple, q, kk, v) -> None:
    """After the path ran the call of key ``k``: remember the replay key ``launch.forward`` computed for it, if it
    ran on these very tensors (the op's prologue copies a tensor whose head dim is not unit-stride) with the other
    inputs :func:`run` hands the recipe: one int32 ``[1]`` stand-in in the six schedule places, no offsets."""
    last = launch.take_replay_key()
    if last is None or last[1] != (id(q), id(kk), id(v)):
        return
    if last[0][0][3:] == (replay.geometry(_stand_in(q.device)), 3, 3, 3, 3, 3, None, None):
        learnt = Learnt(last[0])
        _keys.put(k, learnt)
        _families.put(_family(k, kk.shape[2]), learnt)


def _family(k: tuple, lk: int) -> tuple:
    """Key ``k`` (of a call whose K/V have ``lk`` tokens) without what the key length sets: K's and V's length and
    their batch and head strides; with the length's specialization class (ops.fast_launch), so that the lengths
    16 divides and the others derive each from their own latest."""
    def without_length(g):
        shape, stride = g[0], g[1]
        return shape[:2], shape[3:], stride[2:], g[2:]
    return k[0], without_length(k[1]), without_length(k[2]), k[3:], fast_launch._int_class(lk)


def _derive(k: tuple, q, kk, v) -> Learnt | None:
    """A decoding call whose key length is new (a growing cache's next step): the recipe of the latest length of
    its family (:func:`_family`), rewritten for this length by launch.derive_for_length where that shows it is
    what the path would launch; kept under ``k`` (the step's later layers find it) and as the family's latest."""
    learnt = _from_family(_family(k, kk.shape[2]), (q, kk, v))
    if learnt is not None:
        _keys.put(k, learnt)
    return learnt


def _from_family(family: tuple, inputs: tuple, max_k: int | None = None) -> Learnt | None:
    """The recipe of ``family``'s latest rewritten for ``inputs`` (q, k, v; with ``max_k`` packed token views) by
    launch.derive_for_length, kept as the family's latest; or None (no latest, or the derivation refused)."""
    latest = _families.find(family)
    recipe = None if latest is None else latest.peek()
    derived = None if recipe is None else launch.derive_for_length(recipe, *inputs, max_k=max_k)
    if derived is None:
        return None
    learnt = Learnt(None, derived)
    _families.put(family, learnt)
    return learnt


def learn_pairs(views: tuple, q_pairs: torch.Tensor, k_pairs: torch.Tensor, family: tuple | None = None
                ) -> Learnt | None:
    """After the in-place path ran on token ``views`` (q, k, v) with these pairs: what to keep for the call (the
    launch's replay key), if ``launch.forward`` computed one over exactly these tensors (the pairs in the schedule's
    six places and as the query offsets, the key pairs as the key offsets), else None; also the latest of its
    ``family`` (:func:`pairs_family`), what the next step derives from."""
    last = launch.take_replay_key()
    if last is None or last[1] != (id(views[0]), id(views[1]), id(views[2])):
        return None
    if last[0][0][3:] != (replay.geometry(q_pairs), 3, 3, 3, 3, 3, 3, replay.geometry(k_pairs)):
        return None
    learnt = Learnt(last[0])
    if family is not None:
        _families.put(family, learnt)
    return learnt


def pairs_family(k: tuple, q_pairs: torch.Tensor, k_pairs: torch.Tensor, max_q: int, max_k: int) -> tuple:
    """The family (:func:`_family`) of a padded batch's in-place call of key ``k`` (from :func:`key`, over the padded
    tensors) with these pairs and longest sequences: the next step's batch, one key longer, derives from it. The
    pairs' geometry (their count, alignment) and ``max_q`` are part of it; their values are inputs of the launch."""
    return "pairs", _family(k, max_k), replay.geometry(q_pairs), replay.geometry(k_pairs), max_q


def derive_pairs(family: tuple, views: tuple, max_k: int) -> Learnt | None:
    """A padded batch's in-place call on token ``views`` whose key length (``max_k``) or batch is new (a decoding
    step's first layer): the recipe of its family's latest (:func:`pairs_family`), rewritten for ``max_k`` and the
    views by launch.derive_for_length where that shows it is what the path would launch; the family's latest then.
    Run it with :func:`run_pairs` on this batch's pairs."""
    return _from_family(family, views, max_k)


def run_pairs(learnt: Learnt, views: tuple, q_pairs: torch.Tensor, k_pairs: torch.Tensor):
    """The in-place call through ``learnt``'s recipe (from :func:`learn_pairs`): its output, packed ``[T, Hq, Dv]``
    over the query view's tokens, or None (not kept, or replay unusable now)."""
    recipe = learnt.recipe_now()
    if recipe is None or not replay.usable():
        return None
    q, k, v = views
    out, _ = replay.run(recipe, (q, k, v, q_pairs, q_pairs, q_pairs, q_pairs, q_pairs, q_pairs, q_pairs, k_pairs),
                        q.device, lse_wanted=False)
    return out


def _stand_in(device: torch.device) -> torch.Tensor:
    st = _stand_ins.get(device)
    if st is None:
        st = _stand_ins[device] = torch.empty(1, dtype=torch.int32, device=device)
    return st


def clear() -> None:
    _keys.clear()
    _families.clear()
