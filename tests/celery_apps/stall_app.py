"""The app of the real worker in tests/test_stalls.py: the default node timeout (50 ms), and a
task that fails at once when no quorum of lock nodes answers (``on_unavailable="raise"``)."""

from __future__ import annotations

from celery_apps.subprocesses import subprocess_app
from celery_apps.support import RunLog
from celery_redlock import SingletonTask

app = subprocess_app("stall_app")
LOG = RunLog(app.conf.broker_url)


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=60, on_unavailable="raise")
def job(self: SingletonTask, key: str) -> str:
    """Record the run and return the key."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id):
        return key
