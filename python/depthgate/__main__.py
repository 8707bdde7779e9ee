import sys

from depthgate.cli import main

sys.exit(main())
