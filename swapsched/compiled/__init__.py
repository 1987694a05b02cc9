"""The compiled executor (DESIGN.md, R10): plans lowered into ``torch.compile``'s graphs.

``graph_trace`` reads a partitioned graph pair as a Trace, ``lowering`` tags and places a plan in
it, ``backend`` is the ``torch.compile`` backend (``PlannedBackend``; ``swapsched.CompileBackend``
takes policy names).
"""
