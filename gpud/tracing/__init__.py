"""Triton's trace extension: which requests gpud traces, by which settings, into which files (tracer, settings,
output)."""
