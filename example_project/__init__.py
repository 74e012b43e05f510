"""A small Celery application guarded by celery_redlock, and a demo that floods it with duplicates.

- `example_project.tasks`: the Celery app ``app`` and its tasks (per-account report rebuilds, a
  catalog import users trigger twice, an account sync called by name from another service, a
  search index refresh whose bursts of triggers coalesce into one follow-up run, and a beat job
  that sometimes outlasts its period);
- `example_project.recording`: demo instrumentation that writes every run and every duplicate
  to a Redis list, from the worker processes, through celery_redlock's signals;
- ``python -m example_project``: starts Redis nodes (unless URLs are configured), 3 workers and
  beat, floods the tasks with duplicates, shows live progress, checks that no two runs of one key
  ever overlapped and that every burst of a coalescing key ran at most twice, and draws a
  timeline picture. See ``example_project/README.md``.
"""
