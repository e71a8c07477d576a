import sys

from .app._cli import main

sys.exit(main())
