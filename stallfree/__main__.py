"""`python -m stallfree ...` is the `stallfree` command."""

import sys

from stallfree.cli import main

sys.exit(main())
