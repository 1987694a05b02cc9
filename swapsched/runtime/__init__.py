"""The live side: profile a real step into a Trace, and execute a SwapPlan in real training."""
