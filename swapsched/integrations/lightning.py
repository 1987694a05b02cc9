"""PyTorch Lightning: ``Trainer(callbacks=[SwapCallback(budget="60%")])``."""

from __future__ import annotations

from typing import Any

from swapsched.deploy import CompileBackend, SwapRuntime
from swapsched.errors import UserError, internal_assert, present
from swapsched.policy import Policy

try:
    from pytorch_lightning import Callback
except ImportError:  # the standalone ``lightning`` package has the same class
    try:
        from lightning.pytorch import Callback  # type: ignore[no-redef]
    except ImportError:
        raise UserError("SwapCallback needs PyTorch Lightning: pip install 'swapsched[lightning]'") from None

__all__ = ["SwapCallback"]


class SwapCallback(Callback):  # type: ignore[misc]
    """Each training batch (its forward, backward and, when it is the batch that steps, the
    optimizer step) runs inside ``runtime.step()``; validation, which Lightning runs under
    ``no_grad`` between batches, runs outside it. ``self.runtime`` is made when fitting starts
    (the model is known then) and closed when it ends; ``runtime_options`` go to ``SwapRuntime``.

    A ``LightningModule`` given to ``fit`` compiled (``torch.compile(module)``) runs the compiled
    executor instead (R10): its ``forward`` and ``training_step`` are compiled again with a
    :class:`CompileBackend` (``runtime_options`` may then name only ``hardware`` and ``inner``,
    the inner compiler, default Inductor), no hooks are installed, and ``self.runtime`` is that
    backend (its ``report()`` is the compiled report). Validation keeps the user's compile."""

    def __init__(self, budget: str | int = "60%", policy: str | Policy | None = "default", **runtime_options: Any):
        self.budget, self.policy, self.options = budget, policy, runtime_options
        self.runtime: SwapRuntime | CompileBackend | None = None
        self._step: Any = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        ctx = getattr(pl_module, "_compiler_ctx", None)
        if ctx is None:
            self.runtime = SwapRuntime(self.budget, self.policy, model=pl_module, **self.options)
            return
        import torch

        backend = CompileBackend.for_integration(self.budget, self.policy, self.options,
                                                 compiled="this LightningModule is compiled",
                                                 otherwise="fit the module uncompiled")
        # Lightning keeps the uncompiled methods (pytorch_lightning.utilities.compile.from_compiled)
        pl_module.forward = torch.compile(ctx["original_forward"], backend=backend)
        pl_module.training_step = torch.compile(ctx["original_training_step"], backend=backend)
        self.runtime = backend

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(self.runtime, CompileBackend):
            return  # the compiled graphs carry the plans: no hooks, no step to open
        internal_assert(self._step is None, "a training batch starts while the last one's step is open")
        runtime = present(self.runtime, "the runtime made when fitting started")
        assert isinstance(runtime, SwapRuntime)
        if runtime.optimizer is None and runtime.plan is None and len(trainer.optimizers) == 1:
            # its state may move (R13); Lightning wraps the torch optimizer in a LightningOptimizer
            opt = trainer.optimizers[0]
            runtime.attach_optimizer(getattr(opt, "_optimizer", opt))
        self._step = runtime.step()
        self._step.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        step, self._step = self._step, None
        if step is not None:  # the step ends with the exception: the runtime lets go of everything
            step.__exit__(type(exception), exception, exception.__traceback__)
        self._close()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def _close(self) -> None:
        if isinstance(self.runtime, SwapRuntime):
            self.runtime.close()
