"""`python -m tvm_ext ...`: see tvm_ext.cli."""

from .cli import main

raise SystemExit(main())
