"""`python -m shared.cli`: the same entry point as the `microturn` command."""

from shared.cli.main import main

raise SystemExit(main())
