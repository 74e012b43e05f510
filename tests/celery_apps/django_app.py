"""The app that ``celery -A celery_apps.django_app beat`` runs in tests/test_django_beat.py: a
Celery app of the Django project `django_project`, configured from its settings (``CELERY_*``),
whose periodic tasks live in django-celery-beat's tables.

No worker runs: the task messages stay in the broker's ``celery`` queue, where the test reads
them. Each message a beat of this app publishes carries two headers of the test's (added in the
beat process by ``before_task_publish``): ``django_project.SENT_AT_HEADER`` (``time.time()`` just
before it was published) and ``django_project.PID_HEADER`` (the beat's process id).

The test process does not import this module: like a project's ``celery.py`` it sets
``DJANGO_SETTINGS_MODULE``, which would turn on Celery's Django fix-up for every app made after.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, signals
from django_project import PID_HEADER, SENT_AT_HEADER

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_project.settings")

app = Celery("celery_apps.django_app")
app.config_from_object("django.conf:settings", namespace="CELERY")


def _stamp_message(headers: Any = None, **_: Any) -> None:
    """Mark a message published by this beat with the time and the process."""
    if isinstance(headers, dict):
        headers[SENT_AT_HEADER] = time.time()
        headers[PID_HEADER] = os.getpid()


@signals.beat_init.connect
def _stamp_what_beat_publishes(sender: Any = None, **_: Any) -> None:
    """Only in a beat process of this app."""
    if getattr(sender, "app", None) is app:
        signals.before_task_publish.connect(_stamp_message)
