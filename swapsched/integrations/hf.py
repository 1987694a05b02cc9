"""Hugging Face ``Trainer``: ``runtime = swap_trainer(trainer, budget="60%")`` before ``trainer.train()``."""

from __future__ import annotations

from typing import Any

from swapsched.deploy import SwapRuntime
from swapsched.errors import UserError
from swapsched.policy import Policy

__all__ = ["swap_trainer"]


def swap_trainer(trainer: Any, budget: str | int = "60%", policy: str | Policy | None = "default",
                 **runtime_options: Any) -> SwapRuntime:
    """Run each of ``trainer``'s training steps under a :class:`SwapRuntime`; returns the runtime
    (its ``report()`` after training). ``runtime_options`` go to ``SwapRuntime`` (``backend``,
    ``hardware``, ``audit``...).

    The trainer's ``training_step`` (forward, loss, backward of one micro-batch) is wrapped in
    ``runtime.step()``; evaluation runs outside it, under ``no_grad``, and saves nothing. The
    runtime closes itself when training ends."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise UserError("swap_trainer needs transformers: pip install 'swapsched[hf]'") from None
    if getattr(trainer, "_swapsched_runtime", None) is not None:
        raise UserError("this trainer already runs under a swapsched runtime")
    runtime = SwapRuntime(budget, policy, model=trainer.model, **runtime_options)
    inner = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        with runtime.step():
            return inner(*args, **kwargs)

    class _CloseAtEnd(TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            runtime.close()

    trainer.training_step = training_step
    trainer.add_callback(_CloseAtEnd())
    trainer._swapsched_runtime = runtime
    return runtime
