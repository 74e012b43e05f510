"""The Celery integration: `SingletonTask` and `singleton_task` (`task`), one run of a task from its
token to its release (`run`) and the decision table it follows (`policy`), a task's options
(`plan`) and lock keys (`keys`), what ends a delivery without running it (`deferral`,
`coalesce`), enqueue-time claims (`enqueue`), message identity (`messages`), lost pool processes
(`process_loss`), outcomes reported (`events`), and the signal handlers (`wiring`)."""
