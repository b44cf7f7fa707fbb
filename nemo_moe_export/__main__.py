from nemo_moe_export.cli import main

raise SystemExit(main())
