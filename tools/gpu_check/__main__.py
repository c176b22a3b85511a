"""`python -m tools.gpu_check`: see tools/gpu_check/__init__.py."""

import sys

from tokenmill.tools.gpu_check.runner import main

sys.exit(main())
