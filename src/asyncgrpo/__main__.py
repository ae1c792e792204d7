"""``python -m asyncgrpo`` = the ``asyncgrpo`` command."""

from asyncgrpo.cli import main
from asyncgrpo.process_exit import exit_without_teardown

exit_without_teardown(main())
