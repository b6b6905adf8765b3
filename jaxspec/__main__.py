import sys

from jaxspec.cli import main

sys.exit(main())
