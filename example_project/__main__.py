"""``python -m example_project``: run the demo (see `example_project.demo`)."""

import sys

from .demo import main

if __name__ == "__main__":
    sys.exit(main())
