"""Families of steps: one structure, other sizes (a batch padded to its own length).

Steps with the same events (kinds, which saved tensor is which, in the same order) and tensors of
other sizes are one *family*. Within a family each tensor's bytes follow the step's size exactly,
mostly linearly in the varying dimension, quadratically for attention scores, and so do the
compute gaps, roughly. :class:`FamilyFit` fits each tensor's bytes (and the static and other
bytes) as a polynomial in ``s``, the bytes of the step's first saved tensor, over the family's
profiled traces, and evaluates it at a new ``s``: the trace of a shape never profiled.
Other bytes (R3) are fitted over the traces that measured them (whole profiled steps; a step
handed over mid-step only samples them): through them where two or more did, and from a single
one in proportion to ``s`` (they are activations' kin: outputs not saved, activations' gradients,
an op's scratch; the weights' gradients are static bytes). A step profiled mid-step gets at least
those bytes too (:func:`with_family_other`).
Times are measured, so noisy: each gap (and the tail) is interpolated between the two timed
sizes around ``s`` (profiled, or executed since: those are timed without the profiling's
copies), or, beyond them, scaled from the nearest in proportion to ``s`` (compute grows with
the varying dimension). A line through two close, noisy sizes extrapolated far would not: on a
padded-batch run it predicted 355 ms for steps of 30.
The runtime checks the prediction as the step runs (every saved tensor's bytes against it) and
leaves it where it is wrong, as it leaves any trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from swapsched.errors import present
from swapsched.runtime.transients import OTHER_MEASURED
from swapsched.trace import GRADIENTS_BORN, Trace

__all__ = ["structure", "first_bytes", "FamilyFit", "predicted_trace", "with_family_other"]


def structure(trace: Trace) -> tuple[tuple[bool, int], ...]:
    """What steps of one family share: each event's kind and tensor, in order."""
    return tuple((e.kind == "unpack", e.tensor) for e in trace.events)


def first_bytes(trace: Trace) -> int:
    """``s``: the bytes of the step's first saved tensor, the first size a running step shows."""
    return int(trace.tensor_bytes[trace.events[0].tensor])


def _coef(s: np.ndarray, y: np.ndarray, degree: int) -> tuple[float, np.ndarray]:
    """Per column of ``y`` (one row per trace), the polynomial in ``s`` of ``degree`` through the
    rows (least squares), as (scale, coefficients) for :func:`_eval`. ``s`` is rescaled first:
    byte counts squared overflow nothing but make the system ill-conditioned."""
    scale = float(s.max())
    coef, *_ = np.linalg.lstsq(np.vander(s / scale, degree + 1), y, rcond=None)
    return scale, coef


def _eval(fit: tuple[float, np.ndarray], at: float) -> np.ndarray:
    """The polynomials of :func:`_coef` at ``at``, one value per column (Horner's rule, elementwise:
    no BLAS call, whose thread pool wakes beside torch's on the training loop's thread)."""
    scale, coef = fit
    x = at / scale
    out = coef[0].copy()
    for c in coef[1:]:
        out *= x
        out += c
    return out


def _timed(s: np.ndarray, y: np.ndarray, at: int) -> np.ndarray:
    """Per column of ``y`` (times, one row per size in ascending ``s``): interpolated between the
    sizes around ``at``, or the nearest size's scaled by ``at / s`` beyond them. Never negative,
    and never steeper than the measurements allow (see the module docstring)."""
    above = int(np.searchsorted(s, at))
    if above == 0 or above == len(s):  # beyond the profiled sizes: in proportion to the size
        k = 0 if above == 0 else len(s) - 1
        return np.maximum(y[k] * (at / s[k]), 0.0)
    w = (at - s[above - 1]) / (s[above] - s[above - 1])
    return np.maximum((1.0 - w) * y[above - 1] + w * y[above], 0.0)


class FamilyFit:
    """A family's profiled traces fitted once, to predict the trace at any size ``s`` (:meth:`at`):
    the least-squares fits do not depend on ``s``, so a run that meets a new size every step pays
    for them once per set of profiled sizes, not once per step."""

    def __init__(self, family: Sequence[Trace]):
        sizes = sorted({first_bytes(t): t for t in family}.items())
        self.traces = [t for _, t in sizes]
        self.xs = np.array([k for k, _ in sizes], dtype=np.float64)
        self.largest = int(self.xs[-1]) if len(sizes) else 0
        measured = [(x, t) for x, t in zip(self.xs, self.traces, strict=True) if t.meta.get(OTHER_MEASURED)]
        # what other bytes are fitted over: the measured traces, else (none measured) every one
        fitted = measured or list(zip(self.xs, self.traces, strict=True))
        self.other_xs = np.array([x for x, _ in fitted], dtype=np.float64)
        # R3: the weights' gradients born in a gap are the same at every size; the rest scales
        self.born = fitted[0][1].gradients_born_so_far if fitted else np.zeros(0, dtype=np.int64)
        self.others = np.array([t.other_bytes - self.born for _, t in fitted], dtype=np.float64)
        if len(fitted) >= 2:
            self.other_coef = _coef(self.other_xs, self.others, min(2, len(fitted) - 1))
        self.ok = len(sizes) >= 2
        if not self.ok:
            return
        xs, traces = self.xs, self.traces
        degree = min(2, len(traces) - 1)
        nbytes = np.array([t.tensor_bytes for t in traces], dtype=np.float64)
        self.bytes_coef = _coef(xs, nbytes, degree)
        if len(traces) > degree + 1:  # more traces than the degree needs: the fit must reproduce them
            back = np.vstack([_eval(self.bytes_coef, float(x)) for x in xs])
            if np.abs(back - nbytes).max() > 0.5:
                self.ok = False
                return
        self.gaps = np.array([t.gaps for t in traces], dtype=np.float64)
        self.scalars = np.array([[t.tail_compute_s, t.static_bytes] for t in traces], dtype=np.float64)
        # size -> (gaps, tail) of the profiled traces: the times executed steps may replace
        self.times = {int(x): (gaps, float(sc[0])) for x, gaps, sc in zip(xs, self.gaps, self.scalars, strict=True)}

    def other_at(self, s: int) -> np.ndarray | None:
        """Each event's other bytes (R3) at size ``s`` (see the module docstring), or None where no
        trace has them to say."""
        if len(self.other_xs) == 0:
            return None
        one = len(self.other_xs) == 1
        o = self.others[0] * (s / self.other_xs[0]) if one else _eval(self.other_coef, s)
        return np.maximum(np.rint(o), 0).astype(np.int64) + self.born

    def at(self, s: int, executed: dict[int, tuple[np.ndarray, float]] | None = None) -> Trace | None:
        """The trace of the family's step whose first saved tensor has ``s`` bytes, or None where
        the family cannot say: fewer than two sizes profiled, ``s`` beyond twice the largest, or
        bytes that the fit does not reproduce on the profiled traces themselves (sizes that are no
        polynomial of ``s`` of the degree the sizes allow: 1 with two traces, 2 from three on).
        ``executed``: size -> (gaps, tail) measured by executed steps of the family; they time the
        trace where they are, in preference to the profiled traces' own, which the profiling's
        copies stretch (see retime.timed_by_execution)."""
        if not self.ok or s > 2 * self.largest or s <= 0:
            return None
        xs, traces = self.xs, self.traces
        pred = np.rint(_eval(self.bytes_coef, s)).astype(np.int64)
        if (pred < 0).any() or int(pred[traces[0].events[0].tensor]) != s:
            return None
        near = np.argsort(np.abs(xs - s), kind="stable")[:2]
        times = {**self.times, **executed} if executed else self.times
        # only the timed sizes around s enter _timed (it reads no others): stacking every size's
        # gaps would cost the loop's thread a row per size the run has met
        at_sizes = np.array(sorted(times), dtype=np.float64)
        above = int(np.searchsorted(at_sizes, s))
        # the two it is interpolated between, or the nearest it is scaled from
        inside = 0 < above < len(at_sizes)
        around = at_sizes[above - 1:above + 1] if inside else at_sizes[[min(above, len(at_sizes) - 1)]]
        g = _timed(around, np.array([times[int(x)][0] for x in around]), s)
        tail = float(_timed(around, np.array([[times[int(x)][1]] for x in around]), s)[0])
        o = present(self.other_at(s), "a fitted family's other bytes")
        # static bytes through the nearest two sizes: exact where linear (the batch)
        (x0, x1), (y0, y1) = xs[near], self.scalars[near, 1]
        static = y0 + (y1 - y0) * (s - x0) / (x1 - x0)
        template = traces[int(near[0])]
        other = [oi if (e.other_bytes is not None or oi) else None for e, oi in zip(template.events, o.tolist(), strict=True)]
        return template.resized(pred.tolist(), g.tolist(), other, tail_compute_s=max(float(tail), 0.0),
                                static_bytes=max(int(round(static)), 0), name=f"{template.name}@{s}B",
                                meta={**template.meta, "predicted_from": [t.name for t in traces], "first_bytes": s,
                                      OTHER_MEASURED: False})


def predicted_trace(family: Sequence[Trace], s: int) -> Trace | None:
    """The family's trace at ``s`` from its profiled traces alone (see :meth:`FamilyFit.at`),
    fitted for this one call."""
    return FamilyFit(family).at(s)


def with_family_other(trace: Trace, family: Sequence[Trace]) -> Trace:
    """``trace`` (a step profiled mid-step, whose other bytes were sampled, not measured) with each
    event's other bytes at least what its family's measured traces predict at its size (R3; see
    the module docstring); ``trace`` itself where it measured them, or no member of ``family`` did."""
    if trace.meta.get(OTHER_MEASURED):
        return trace
    measured = [t for t in family if t.meta.get(OTHER_MEASURED) and structure(t) == structure(trace)]
    if not measured:
        return trace
    fit = FamilyFit(measured)
    o = present(fit.other_at(first_bytes(trace)), "the measured traces' other bytes")
    if GRADIENTS_BORN not in trace.meta:  # R3: its gradients are in its static bytes, not born in its gaps
        o = np.maximum(o - fit.born, 0)
    events = tuple(replace(e, other_bytes=max(e.other_bytes or 0, oi)) for e, oi in zip(trace.events, o.tolist(), strict=True))
    return replace(trace, events=events, meta={**trace.meta, "other_from": [t.name for t in fit.traces]})
