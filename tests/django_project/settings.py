"""Settings of the test Django project (`django_project`), read from the environment at import.

- ``CRL_DJANGO_DATABASE``: the SQLite database file (the test makes one per test module and
  migrates it);
- those of `celery_apps.subprocesses.app_environment`: ``CRL_BROKER_URL`` (broker) and
  ``CRL_LOCK_URLS`` (comma-separated lock nodes);
- ``CRL_LEASE_TTL``: ``redlock_beat_lease_ttl`` in seconds.

Celery reads its settings from here under the ``CELERY`` namespace (`celery_apps.django_app`), as
in a Django project: ``CELERY_REDLOCK_URLS`` is ``redlock_urls``.
"""

from __future__ import annotations

import os

DATABASE_VARIABLE = "CRL_DJANGO_DATABASE"
LEASE_TTL_VARIABLE = "CRL_LEASE_TTL"
LEASE_TTL = 2.0

SECRET_KEY = "celery-redlock tests only"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get(DATABASE_VARIABLE, "unset.sqlite3"),
        # Two beats and the test share the file: wait for its lock rather than fail.
        "OPTIONS": {"timeout": 20},
    }
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

_broker_url = os.environ.get("CRL_BROKER_URL", "redis://127.0.0.1:1/0")
CELERY_BROKER_URL = _broker_url
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULER = "celery_redlock.beat:LeaderDatabaseScheduler"
CELERY_REDLOCK_URLS = os.environ.get("CRL_LOCK_URLS", _broker_url).split(",")
# Replies from the lock nodes of a busy 2-core test machine may take longer than 50 ms.
CELERY_REDLOCK_NODE_TIMEOUT = 0.3
CELERY_REDLOCK_BEAT_LEASE_TTL = float(os.environ.get(LEASE_TTL_VARIABLE, LEASE_TTL))
