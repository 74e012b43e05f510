"""The lock itself, usable without Celery: the Redlock algorithm (`redlock`), the Lua scripts that
make each node's part atomic (`scripts`) and what they may answer (`replies`), the stored formats
(`keyspace`, `owner`), the typed outcomes (`outcomes`), the keeper that extends held locks
(`keeper`), and every connection to the lock nodes (`nodes`)."""
