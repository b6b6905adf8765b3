import sys

from jaxspec.cli import main

if __name__ == "__main__":  # not when a spawned worker process (constraint compilers) imports it
    sys.exit(main())
