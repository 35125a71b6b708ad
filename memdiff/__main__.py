"""`python -m memdiff` entry point."""

import sys

from memdiff.cli import main

# Guarded: worker processes started with `spawn` import the main module again.
if __name__ == "__main__":
    sys.exit(main())
