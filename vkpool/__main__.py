import sys

from vkpool.cli import main

sys.exit(main())
