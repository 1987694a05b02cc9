"""Blocks that can be recomputed (R9, DESIGN.md): where a saved tensor's block is, what selective
checkpointing rebuilds, and the :class:`Segment` record a trace gives each block
(:attr:`swapsched.trace.Trace.segments`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Segment", "segment_of", "SELECTIVE_SAVE_OPS", "VIEW_OPS", "rebuilt_selectively", "recompute_transient"]


def segment_of(module: str) -> tuple[str, int] | None:
    """The container element activation checkpointing would wrap for a tensor packed in
    ``module``: ``(container path, index)`` at the first index in the path (``blocks.3.attn.qkv``
    -> ``("blocks", 3)``), as users checkpoint each element of a ``ModuleList``/``Sequential``.
    None outside any container (embeddings, a final head): not recomputable."""
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]), int(p)
    return None


#: Ops whose outputs selective activation checkpointing saves (the usual policy, as in torchtitan's
#: ``_op_sac_save_list``): matrix products, convolutions and attention. Every other op is
#: recomputed (R9, selective).
SELECTIVE_SAVE_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "convolution", "_convolution",
    "cudnn_convolution", "mkldnn_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward",
})
#: Ops whose output is a view of another op's storage: a saved view frees nothing when it is
#: recomputed unless its storage's producer is, which a trace does not record, so it is counted kept.
VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
                      "as_strided", "unsqueeze", "squeeze", "alias", "detach", "split", "chunk", "unbind"})


def rebuilt_selectively(op: str) -> bool:
    """Whether selective checkpointing recomputes (rather than saves) a saved tensor made by ``op``.
    An unknown op (an empty name) is counted kept."""
    return bool(op) and op not in SELECTIVE_SAVE_OPS and op not in VIEW_OPS


@dataclass(frozen=True)
class Segment:
    """A block that can be recomputed instead of kept or swapped (R9, DESIGN.md).

    ``anchor`` is the block's first saved tensor, its input as the block's first op saved it: a
    checkpoint keeps it (or it is swapped). ``members`` are the other tensors the block saves,
    which a recompute rebuilds. ``at`` is the event at which backward recomputes the block (the
    first unpack of a member); ``forward_s`` the block's forward compute, the gaps before its
    forward packs (R1), which the recompute spends again; ``flops`` the same from the events'
    FLOPs where every one has them.

    Selective checkpointing (R9, selective) rebuilds only ``cheap``, the members made by ops it
    does not save (:func:`rebuilt_selectively`), for ``cheap_forward_s``, the gaps before their
    forward packs; the other members stay on the device, held by the checkpoint.

    ``transient_bytes``: what the block's forward holds beyond all its members at its fullest
    (R3's other bytes of a forward gap above the least of them, with the members made by then:
    outputs it does not save), which its recompute holds again for a moment (DESIGN R9)."""

    index: int
    name: str
    anchor: int
    members: tuple[int, ...]
    at: int
    forward_s: float
    bytes: int
    flops: float | None = None
    cheap: tuple[int, ...] = ()
    cheap_forward_s: float = 0.0
    cheap_bytes: int = 0
    transient_bytes: int = 0


def recompute_transient(members: dict[int, tuple[int, int]], fwd: list[int], other: Any) -> int:
    """R3 for R9: what a block's recompute holds beyond all its members at its peak
    (``Segment.transient_bytes``). ``members``: each member's (first pack, bytes); ``fwd``: the
    events of the block's forward packs; ``other``: the trace's other bytes per gap. In each gap
    of its forward it holds the members made so far and its other bytes above the least of them
    (outputs it does not save); a member is not yet made there before its first pack."""
    if not fwd:
        return 0
    span = range(min(fwd), max(fwd) + 1)
    base = int(min(other[j] for j in span))
    peak = max(int(other[j]) - base + sum(b for first, b in members.values() if first <= j) for j in span)
    return max(0, peak - sum(b for _, b in members.values()))
