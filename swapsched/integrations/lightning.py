"""PyTorch Lightning: ``Trainer(callbacks=[SwapCallback(budget="60%")])``."""

from __future__ import annotations

from typing import Any

from swapsched.deploy import SwapRuntime
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
    (the model is known then) and closed when it ends; ``runtime_options`` go to ``SwapRuntime``."""

    def __init__(self, budget: str | int = "60%", policy: str | Policy | None = "default", **runtime_options: Any):
        self.budget, self.policy, self.options = budget, policy, runtime_options
        self.runtime: SwapRuntime | None = None
        self._step: Any = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.runtime = SwapRuntime(self.budget, self.policy, model=pl_module, **self.options)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        internal_assert(self._step is None, "a training batch starts while the last one's step is open")
        self._step = present(self.runtime, "the runtime made when fitting started").step()
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
        if self.runtime is not None:
            self.runtime.close()
