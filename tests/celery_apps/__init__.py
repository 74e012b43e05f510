"""Celery apps and helpers for the tests that need real workers.

For tests/test_celery_*.py: `support` (apps on harness Redis nodes, embedded workers, the run
log that proves runs never overlap, lock-signal recording, prefork subprocess workers),
`fixtures` (their pytest fixtures) and `prefork_app` (the app that real
``celery -A celery_apps.prefork_app worker -P prefork`` subprocesses load).
"""
