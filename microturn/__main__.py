"""`python -m microturn`: the same entry point as the `microturn` command."""

from microturn.main import main

raise SystemExit(main())
