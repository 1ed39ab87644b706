import sys

from isolator.cli import main

sys.exit(main())
