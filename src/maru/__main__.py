import sys

from maru.client.cli import main

sys.exit(main())
