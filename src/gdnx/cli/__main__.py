"""`python -m gdnx.cli`: the gdnx command."""

import sys

from gdnx.cli import main

sys.exit(main())
