import sys

from maru.cli import main

sys.exit(main())
