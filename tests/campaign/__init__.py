"""The run-loop fault campaign: seeded runs of the loops users start (`AsyncTaskQueue.run`,
`mongoq_sync`'s ``run``, and the scenario modules others add) under faults, checked from
outside the library. ``python -m tests.campaign --help`` runs it; ``engine`` says how a run is
built, ``runner`` how runs are run, ``mutants`` which breakages it must catch."""
