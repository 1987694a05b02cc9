"""SwapPlan: which saved tensors to evict, when to swap each out and when to prefetch it (R7)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from swapsched.trace import _Fields, open_json, write_json

if TYPE_CHECKING:
    from swapsched.trace import Trace

__all__ = ["Eviction", "SwapPlan", "PlanError", "load_plan", "save_plan"]

FORMAT = "swapsched.plan"
VERSION = 1


class PlanError(ValueError):
    """A plan file is malformed or breaks R7 for its trace."""


@dataclass(frozen=True, order=True)
class Eviction:
    """Evict ``tensor``: swap it out at event ``swap_out_at``, prefetch it at ``prefetch_at``."""

    tensor: int
    swap_out_at: int
    prefetch_at: int


@dataclass(frozen=True)
class SwapPlan:
    """The decision for one trace. Tensors not listed stay resident."""

    trace: str
    policy: str
    evictions: tuple[Eviction, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, trace: "Trace", policy: str, evictions: Iterable[Eviction], **meta: Any) -> "SwapPlan":
        return cls(trace=trace.name, policy=policy, evictions=tuple(sorted(evictions)), meta=dict(meta))

    @property
    def evicted(self) -> frozenset[int]:
        return frozenset(e.tensor for e in self.evictions)

    def validate(self, trace: "Trace", source: str = "<plan>") -> "SwapPlan":
        """Check R7 against ``trace``; raise :class:`PlanError` naming the eviction and the rule."""
        seen: set[int] = set()
        fp, fu = trace.first_pack, trace.first_unpack
        for k, ev in enumerate(self.evictions):
            where = f"{source}: evictions[{k}]"
            if not 0 <= ev.tensor < trace.n_tensors:
                raise PlanError(f"{where}.tensor: {ev.tensor} out of range: trace {trace.name!r} has {trace.n_tensors} tensors")
            if ev.tensor in seen:
                raise PlanError(f"{where}.tensor: tensor {ev.tensor} evicted twice (R7: at most once per step)")
            seen.add(ev.tensor)
            t = ev.tensor
            if not fp[t] <= ev.swap_out_at < fu[t]:
                raise PlanError(
                    f"{where}.swap_out_at: {ev.swap_out_at} must be in [{fp[t]}, {fu[t]}) "
                    f"(R7: at or after tensor {t}'s first pack, before its first unpack)"
                )
            if not ev.swap_out_at <= ev.prefetch_at <= fu[t]:
                raise PlanError(
                    f"{where}.prefetch_at: {ev.prefetch_at} must be in [{ev.swap_out_at}, {fu[t]}] "
                    f"(R7: at or after the swap-out, at most tensor {t}'s first unpack)"
                )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "trace": self.trace,
            "policy": self.policy,
            "meta": self.meta,
            "evictions": [
                {"tensor": e.tensor, "swap_out_at": e.swap_out_at, "prefetch_at": e.prefetch_at} for e in self.evictions
            ],
        }

    def save(self, path: str | Path) -> Path:
        return save_plan(self, path)


def plan_from_dict(data: Any, source: str = "<dict>") -> SwapPlan:
    f = _Fields(source, PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise PlanError(f"{source}: field format: expected {FORMAT!r}, got {data.get('format')!r} (is this a swapsched plan?)")
    if data.get("version") != VERSION:
        raise PlanError(f"{source}: field version: this swapsched reads version {VERSION}, got {data.get('version')!r}")
    evs = []
    for k, e in enumerate(f.get(data, "evictions", "evictions", list)):
        w = f"evictions[{k}]"
        evs.append(
            Eviction(
                tensor=f.number(e, "tensor", f"{w}.tensor", integer=True),
                swap_out_at=f.number(e, "swap_out_at", f"{w}.swap_out_at", integer=True),
                prefetch_at=f.number(e, "prefetch_at", f"{w}.prefetch_at", integer=True),
            )
        )
    return SwapPlan(
        trace=f.get(data, "trace", "trace", str),
        policy=f.get(data, "policy", "policy", str),
        evictions=tuple(sorted(evs)),
        meta=f.get(data, "meta", "meta", dict, optional=True) or {},
    )


def load_plan(path: str | Path, trace: "Trace | None" = None) -> SwapPlan:
    """Load a plan; with ``trace``, also check it against R7 and that it was made for that trace."""
    plan = plan_from_dict(open_json(path, PlanError), source=str(path))
    if trace is not None:
        if plan.trace != trace.name:
            raise PlanError(f"{path}: field trace: plan was made for {plan.trace!r}, not for trace {trace.name!r}")
        plan.validate(trace, source=str(path))
    return plan


def save_plan(plan: SwapPlan, path: str | Path) -> Path:
    return write_json(plan.to_dict(), path)
