"""The robustness suite: a workload of lock clients (and Celery workers) that records every
operation to a history, nemeses that inject faults while it runs, and a checker that judges the
merged history against the library's promises, whatever fault broke them.

Run it with ``nox -s robustness -- --minutes N --seed S [--nemesis pause,cut,...]`` (or
``python -m tests.robustness ...`` in a virtualenv with the test extras); docs/testing.md says
how. The modules: `history` (the records and their files), `checker` (the promises),
`workload` (a client process), `nemeses` (the faults), `runner` (one run: nodes, clients,
nemeses, the verdict).
"""
