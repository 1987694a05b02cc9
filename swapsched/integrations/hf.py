"""Hugging Face ``Trainer``: ``runtime = swap_trainer(trainer, budget="60%")`` before ``trainer.train()``."""

from __future__ import annotations

from typing import Any

from swapsched.deploy import CompileBackend, SwapRuntime
from swapsched.errors import UserError
from swapsched.policy import Policy

__all__ = ["swap_trainer"]


def swap_trainer(trainer: Any, budget: str | int = "60%", policy: str | Policy | None = "default",
                 **runtime_options: Any) -> SwapRuntime | CompileBackend:
    """Run each of ``trainer``'s training steps under a :class:`SwapRuntime`; returns the runtime
    (its ``report()`` after training). ``runtime_options`` go to ``SwapRuntime`` (``backend``,
    ``hardware``, ``audit``...).

    The trainer's ``training_step`` (forward, loss, backward of one micro-batch) is wrapped in
    ``runtime.step()``; evaluation runs outside it, under ``no_grad``, and saves nothing. The
    runtime closes itself when training ends.

    With ``TrainingArguments(torch_compile=True)`` the plans run in the compiled graphs instead
    (R10): the model is compiled in place with a :class:`CompileBackend` (its inner compiler the
    trainer's ``torch_compile_backend`` where swapsched has it, else Inductor), accelerate's own
    compile is turned off, no hooks are installed, and the backend is returned (its ``report()``
    is the compiled report). ``runtime_options`` may then name only ``hardware`` and ``inner``."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise UserError("swap_trainer needs transformers: pip install 'swapsched[hf]'") from None
    if getattr(trainer, "_swapsched_runtime", None) is not None:
        raise UserError("this trainer already runs under a swapsched runtime")
    if getattr(trainer.args, "torch_compile", False):
        return _compiled(trainer, budget, policy, runtime_options)
    runtime = SwapRuntime(budget, policy, model=trainer.model, **runtime_options)
    inner = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        if runtime.optimizer is None and trainer.optimizer is not None and runtime.plan is None:
            # made by the trainer as training starts; accelerate wraps the torch optimizer
            runtime.attach_optimizer(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
        with runtime.step():
            return inner(*args, **kwargs)

    class _CloseAtEnd(TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            runtime.close()

    trainer.training_step = training_step
    trainer.add_callback(_CloseAtEnd())
    trainer._swapsched_runtime = runtime
    return runtime


def _compiled(trainer: Any, budget: str | int, policy: str | Policy | None, options: dict[str, Any]) -> CompileBackend:
    """``swap_trainer`` for a trainer that compiles its model (docstring above)."""
    from swapsched.compiled.backend import INNER_COMPILERS

    asked = getattr(trainer.args, "torch_compile_backend", None) or "inductor"
    backend = CompileBackend.for_integration(budget, policy, options, inner=asked if asked in INNER_COMPILERS else "inductor",
                                             compiled="the trainer compiles its model (torch_compile=True)",
                                             otherwise="set torch_compile=False")
    # accelerate compiles the model it prepares unless its dynamo backend is "no": the model is
    # compiled here, in place, so the trainer keeps the same module (saving, unwrapping)
    from accelerate.utils import DynamoBackend

    trainer.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
    trainer.model.compile(backend=backend)
    trainer._swapsched_runtime = backend
    return backend
