import sys

from isolator.cli.main import main

sys.exit(main())
