"""``python -m isolator.bridge install DIR`` (and the executable itself, run as a module)."""

import sys

from isolator.bridge.command import _install_main, main

if sys.argv[1:2] == ["install"]:
    sys.exit(_install_main(sys.argv[2:]))
sys.exit(main())
