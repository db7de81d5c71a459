import sys

from maru.server.cli import main

sys.exit(main())
