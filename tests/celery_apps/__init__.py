"""Celery apps and helpers for the tests that need real workers.

For tests/test_celery_*.py: `support` (apps on harness Redis nodes, embedded workers, the run
log that proves runs never overlap, lock-signal recording) and `fixtures` (their pytest
fixtures). For the tests with real ``celery worker``/``celery beat`` subprocesses
(tests/test_celery_prefork.py, test_beat.py, test_fleet.py): `subprocesses` (starting, watching
and killing them; the apps' configuration; `Recorder`) and the apps they load, `prefork_app`,
`beat_app` and `fleet_app`.
"""
