"""A Django app of fenced rows, for the fencing tests (tests/fencing_stores.py)."""
