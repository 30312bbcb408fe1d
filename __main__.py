from pdlab.cli import main

raise SystemExit(main())
