from loadtest.prefix.runner import main

raise SystemExit(main())
