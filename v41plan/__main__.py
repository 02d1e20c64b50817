"""``python -m v41plan`` runs the CLI."""

from v41plan.cli.main import main

raise SystemExit(main())
