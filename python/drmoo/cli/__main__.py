"""``python -m drmoo.cli``: the same as ``drmoo``."""

from drmoo.cli import main

raise SystemExit(main())
