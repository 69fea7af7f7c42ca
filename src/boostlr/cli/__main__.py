"""``python -m boostlr.cli``: the ``boostlr`` command, as torchrun and srun start each rank
(and as a one-process CPU run re-executes itself with its allocator preloaded)."""

import sys

from boostlr.cli import main

sys.exit(main())
