"""python -m inference diffusion --checkpoint RUN_DIR [--num 64] [--steps 50] [--out grid.png]"""

import sys

from inference.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
