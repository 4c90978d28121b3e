"""``python -m drmoo`` is the ``drmoo`` command (torchrun launches it this way)."""

from drmoo.cli import main

raise SystemExit(main())
