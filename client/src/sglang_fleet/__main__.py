from sglang_fleet.cli import main

raise SystemExit(main())
