"""mongoq benchmarks: ``python -m benchmarks [--uri URI] [--tasks N] [--json]``."""
