"""``python -m v41plan`` runs the CLI."""

from v41plan.cli import main

raise SystemExit(main())
