"""``python -m v41plan`` runs the CLI."""

import os
import sys

from v41plan.cli.main import main

code = main()
try:
    sys.stdout.flush()  # here, not at exit, so a closed pipe (`| head`) stays quiet
except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = code or 1
raise SystemExit(code)
