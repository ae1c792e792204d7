"""``python -m asyncgrpo`` = the ``asyncgrpo`` command."""

import sys

from asyncgrpo.cli import main

sys.exit(main())
