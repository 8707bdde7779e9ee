import sys

from depthgate.commands.cli import main

sys.exit(main())
