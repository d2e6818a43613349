import sys

from gpud.cli.main import main

sys.exit(main())
