"""python -m train --config FILE [--dry-run] [section.key=value ...]"""

import sys

from train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
