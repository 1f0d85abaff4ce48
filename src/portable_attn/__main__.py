"""``python -m portable_attn`` runs the ``portable-attn`` command line."""

from ._cli import main

raise SystemExit(main())
