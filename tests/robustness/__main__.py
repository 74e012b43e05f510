"""``python -m tests.robustness``: one robustness run (`runner`)."""

import sys

from .runner import main

sys.exit(main())
