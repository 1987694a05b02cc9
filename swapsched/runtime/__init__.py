"""The live side: profile a real step into a Trace, and execute a SwapPlan in real training.

Step 1 is profiled into a Trace (``timing: measured``) while every saved tensor goes to the host
and comes back on demand (PyTorch's ``save_on_cpu`` semantics, so the profiling step fits any
feasible budget); the policy then plans once (on the CPU backend, once more after the first
executed steps have re-timed the trace: ``timed_by_execution``). Later steps execute the plan by
the rules the simulator uses (R4-R7): at each hook call *i* (an event of the trace) the runtime (a)
makes the unpacked tensor resident, waiting for its swap-in or copying it on demand, (b) frees
tensors whose last use is *i*, (c) issues the swap-outs planned at *i*, (d) issues the prefetches
planned at *i*, which wait in issue order for room under the budget.

Each step's events are checked against the trace. A step whose first saved tensor has other
bytes is another shape: it runs that shape's plan, or one predicted for it from its family's
profiled sizes (``shapes.py``), or is profiled as it runs and planned after it. A step that leaves
its trace later (other control flow, a wrong prediction) diverges: it finishes on demand (nothing
new is planned, everything evicted comes back when unpacked, R4 still makes room) and the next
step is profiled and planned again. A guard evicts on the spot, by the MIN rule, when the
accounted device memory would exceed the budget despite the plan.

Where each job lives (each imports only the modules below it: the contract in ``pyproject.toml``):

- ``swapper.py``: ``PolicyRuntime``, the phases, R9's two stages, the re-timing of the current plan;
- ``execute_step.py``: the executing step's hooks, following the plan's events; ``copies.py``: its
  copies and its room under the budget, the guard included; ``profile_step.py``: the profiling step;
- ``plans.py``: the plans per shape (layouts, predictions, first plans, the policy's on a thread);
- ``accounting.py``: what both steps count; ``frame.py``: what a step reads of the runtime;
- ``budgets.py``: the budget per shape; ``retime.py``: re-timing from executed steps;
  ``background.py``: the planner thread; ``recompute.py``: the checkpointed blocks (R9);
- ``layout.py``: a plan laid out for the hooks; ``reports.py``: steps' and the run's records;
  ``stash.py``: what autograd keeps per saved tensor;
- ``shapes.py``: families of shapes; ``backends.py``: the copy engines (``host_pool.py``: their host
  buffers); ``profiler.py``: a whole step profiled outside the runtime, and static bytes;
  ``recorder.py``: what the hooks record, and storages' identity. ``calibrate.py`` and ``live_env.py`` sit on top.
"""
