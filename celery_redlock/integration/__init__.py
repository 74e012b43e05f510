"""The Celery integration: `SingletonTask` and `singleton_task` (`task`), one run of a task from its
token to its release (`run`) and the decision table it follows (`policy`), and their helpers."""
