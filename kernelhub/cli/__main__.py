"""``python -m kernelhub.cli``: the same as the ``kernelhub`` command."""

from kernelhub.cli import main

raise SystemExit(main())
