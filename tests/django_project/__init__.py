"""A minimal Django project for tests/test_django_beat.py: django-celery-beat on SQLite.

Its Celery app is `celery_apps.django_app`; the names of the headers that app's beats stamp on
each message they publish are here, so that the test reads them without importing the app.
"""

SENT_AT_HEADER = "crl_sent_at"
"""``time.time()`` in the beat just before it published the message."""
PID_HEADER = "crl_pid"
"""The process id of the beat that published the message."""
