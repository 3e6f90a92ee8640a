"""``python -m specdec``: the ``specdec`` command."""
from specdec.cli import main

raise SystemExit(main())
