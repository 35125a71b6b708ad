"""`python -m memdiff` entry point."""

import sys

from memdiff.cli import main

sys.exit(main())
