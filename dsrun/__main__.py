import sys

from dsrun.cli.__main__ import main

sys.exit(main())
