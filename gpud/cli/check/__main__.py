import sys

from gpud.cli.check.command import check_main

sys.exit(check_main())
