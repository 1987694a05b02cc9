"""One-line deployment in the trainers PyTorch users already run (optional extras).

- ``swapsched.integrations.hf.swap_trainer(trainer, budget="60%")``: a Hugging Face ``Trainer``
  (``pip install 'swapsched[hf]'``);
- ``swapsched.integrations.lightning.SwapCallback(budget="60%")``: a PyTorch Lightning callback
  (``pip install 'swapsched[lightning]'``).

Each training step (one forward and backward; one micro-batch under gradient accumulation) runs
inside ``runtime.step()``; the runtime is closed when training ends.
"""
