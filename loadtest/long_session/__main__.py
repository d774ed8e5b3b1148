from loadtest.long_session.runner import main

raise SystemExit(main())
